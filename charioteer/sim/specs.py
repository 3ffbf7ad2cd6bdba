"""What the simulator simulates: model shapes, accelerators and clusters.

All three are plain dataclasses validated once when built (at the edge: CLI, config files, tests).
Numbers are public datasheet values; efficiency factors are documented per field and are *not*
fitted to any result of the paper.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from charioteer.memory.block_manager import kv_bytes_per_token
from charioteer.model.config import ModelConfig
from charioteer.model.shapes import LLAMA_SHAPES
from charioteer.parallel import kv_heads_per_rank


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value!r}")


def _fraction(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not 0 < value <= 1:
            raise ValueError(f"{owner}: {name} must be in (0, 1], got {value!r}")


# ---- model shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer, as far as cost and memory go.

    `mlp_matrices` is 2 for a GELU MLP (GPT-3: up, down) and 3 for a gated SwiGLU MLP (LLaMA:
    gate, up, down). Weights and KV cache are `dtype_bytes` each (2 = fp16/bf16), except that the linear
    layers' weights take `weight_bytes` each where they are narrower (weight-only int8: 1; 0: `dtype_bytes`).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    mlp_matrices: int = 3
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_position: int = 4096
    dtype_bytes: int = 2
    weight_bytes: float = 0

    def __post_init__(self) -> None:
        _positive(f"model {self.name}", num_layers=self.num_layers, num_heads=self.num_heads,
                  num_kv_heads=self.num_kv_heads, max_position=self.max_position, dtype_bytes=self.dtype_bytes)
        # The engine's ModelConfig of the same shape: its head_dim default, checks and widths are ours.
        config = ModelConfig(self.name, self.vocab_size, self.hidden_size, self.intermediate_size, self.num_layers,
                             self.num_heads, self.num_kv_heads, head_dim=self.head_dim, max_position=self.max_position)
        _positive(f"model {self.name}", head_dim=config.head_dim)
        object.__setattr__(self, "head_dim", config.head_dim)
        object.__setattr__(self, "_config", config)
        if self.weight_bytes < 0:
            raise ValueError(f"model {self.name}: weight_bytes must be >= 0 (0: dtype_bytes), got {self.weight_bytes}")
        if self.mlp_matrices not in (2, 3):
            raise ValueError(f"model {self.name}: mlp_matrices must be 2 (GELU) or 3 (gated), got {self.mlp_matrices}")

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes of one linear layer weight element."""
        return self.weight_bytes or self.dtype_bytes

    @property
    def q_size(self) -> int:
        return self._config.q_size

    @property
    def kv_size(self) -> int:
        return self._config.kv_size

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer's linear layers (QKV, O, MLP); norms/biases ignored.

        ModelConfig counts 2 FLOPs per weight and token for a gated (3-matrix) MLP; a GELU MLP has
        one matrix fewer.
        """
        gated = self._config.linear_flops_per_token() // (2 * self.num_layers)
        return gated - (3 - self.mlp_matrices) * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Layers + input embedding + LM head (untied)."""
        return self.num_layers * self.layer_params + 2 * self.embedding_params

    def kv_bytes_per_token(self, num_layers: int | None = None, tp: int = 1) -> int:
        """m_kv: bytes of K and V for one token over `num_layers` layers (default all) on one of `tp` ranks."""
        layers = self.num_layers if num_layers is None else num_layers
        return kv_bytes_per_token(layers, kv_heads_per_rank(self.num_kv_heads, tp), self.head_dim, self.dtype_bytes)

    def check_tp(self, tp: int) -> None:
        """Tensor parallelism splits the attention heads and the MLP width evenly."""
        if self.num_heads % tp or self.intermediate_size % tp:
            raise ValueError(f"model {self.name}: tp={tp} must divide num_heads ({self.num_heads}) and the MLP "
                             f"width ({self.intermediate_size})")


MODEL_PRESETS: dict[str, ModelShape] = {
    # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads of 128, MLP 4x.
    "gpt3-175b": ModelShape("gpt3-175b", 96, 12288, 4 * 12288, 96, 96, 50257, mlp_matrices=2, max_position=4096),
    **{name: ModelShape(name, **shape) for name, shape in LLAMA_SHAPES.items()},
}


def _given_or_preset(spec, cls, presets: dict):
    """`spec` if it is a `cls` already, one built from a dict of its fields, or the preset it names; else None."""
    if isinstance(spec, cls):
        return spec
    if isinstance(spec, dict):
        return cls(**spec)
    return presets.get(spec)


def model_shape(spec: str | ModelShape | dict) -> ModelShape:
    """A preset name, a ModelShape, a dict of fields, a Hugging Face config.json (or its directory), or
    'layers=..,hidden=..,ffn=..,heads=..[,kv_heads=..,vocab=..,mlp=2|3]'."""
    shape = _given_or_preset(spec, ModelShape, MODEL_PRESETS)
    if shape is not None:
        return shape
    if spec.endswith(".json") or os.path.isdir(spec):
        return hf_config_shape(spec)
    if "=" in spec:
        return _parse_model_shape(spec)
    raise ValueError(f"unknown model {spec!r}: choose one of {', '.join(MODEL_PRESETS)}, a Hugging Face config.json, "
                     f"or give 'layers=..,hidden=..,ffn=..,heads=..'")


_HF_KEYS = {  # ModelShape field -> config.json keys, LLaMA-style names first, then GPT-2's
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_heads": ("num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
}
_HF_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _hf_value(config: dict, keys: tuple[str, ...], default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def hf_config_shape(path: str) -> ModelShape:
    """The ModelShape of a Hugging Face config.json (a LLaMA-style or GPT-2-style decoder), named after its directory."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {file}: {exc}") from None
    fields = {name: _hf_value(config, keys) for name, keys in _HF_KEYS.items()}
    missing = [keys[0] for name, keys in _HF_KEYS.items() if fields[name] is None]
    if missing:
        raise ValueError(f"model config {file} lacks {', '.join(missing)}")
    hidden = fields["hidden_size"]
    gated = config.get("hidden_act", "silu") in ("silu", "swiglu") and "n_embd" not in config
    fields.update(
        num_kv_heads=_hf_value(config, ("num_key_value_heads",), fields["num_heads"]),
        intermediate_size=_hf_value(config, ("intermediate_size", "n_inner"), 4 * hidden),
        head_dim=config.get("head_dim") or 0,
        max_position=_hf_value(config, ("max_position_embeddings", "n_positions"), 4096),
        mlp_matrices=3 if gated else 2,
        dtype_bytes=_HF_DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2),
    )
    name = os.path.basename(os.path.dirname(os.path.abspath(file))) or "hf-model"
    return ModelShape(name, **fields)


def _parse_model_shape(spec: str) -> ModelShape:
    """'layers=..,hidden=..,ffn=..,heads=..[,...]' -> a ModelShape named 'custom'."""
    keys = {"layers": "num_layers", "hidden": "hidden_size", "ffn": "intermediate_size",
            "intermediate": "intermediate_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
            "vocab": "vocab_size", "mlp": "mlp_matrices", "head_dim": "head_dim", "context": "max_position",
            "dtype_bytes": "dtype_bytes", "weight_bytes": "weight_bytes"}
    fields: dict = {"name": "custom", "vocab_size": 32000}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in keys:
            raise ValueError(f"unknown model shape key {key!r}: use {', '.join(sorted(keys))}")
        fields[keys[key]] = int(value)
    fields.setdefault("num_kv_heads", fields.get("num_heads", 1))
    missing = {"num_layers", "hidden_size", "intermediate_size", "num_heads"} - fields.keys()
    if missing:
        raise ValueError(f"model shape {spec!r} lacks {', '.join(sorted(missing))}")
    return ModelShape(**fields)


# ---- hardware ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. Peak numbers are dense fp16/bf16 tensor-core datasheet values.

    Efficiency factors (fractions of peak actually reached; documented, not fitted):
    - `matmul_efficiency`: large cuBLAS GEMMs reach ~70-80 % of tensor-core peak on Ampere/Hopper.
    - `attention_efficiency`: FlashAttention-2 forward reaches ~50-70 % of peak on A100 (Dao 2023);
      we use the low end since chunks are short.
    - `memory_efficiency`: streaming kernels reach ~80-90 % of HBM datasheet bandwidth.
    - `attention_memory_efficiency`: the share of HBM bandwidth attention reaches reading the KV
      cache (None: `memory_efficiency`). Decode attention over many short per-request caches
      (paged or per-request kernels) can stay well below streaming bandwidth.
    - `kernel_overhead_s`: fixed cost per kernel (launch and tail), ~3-5 us on CUDA.
    - `memory_fraction`: share of device memory the engine may use (vLLM's default 0.9); the rest
      is the CUDA context, activations, NCCL buffers and fragmentation.
    Tiles: GEMM output tiles of `tile_m` x `tile_n` are spread over `num_sms` SMs in waves; a
    partial tile or a partial wave costs as much as a full one (tile and wave quantization).
    """

    name: str
    peak_flops: float  # FLOP/s, dense fp16
    memory_bandwidth: float  # bytes/s, HBM
    memory_bytes: int
    num_sms: int = 108
    tile_m: int = 128
    tile_n: int = 128
    matmul_efficiency: float = 0.75
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.85
    attention_memory_efficiency: float | None = None
    kernel_overhead_s: float = 4e-6
    memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        _positive(f"hardware {self.name}", peak_flops=self.peak_flops, memory_bandwidth=self.memory_bandwidth,
                  memory_bytes=self.memory_bytes, num_sms=self.num_sms, tile_m=self.tile_m, tile_n=self.tile_n)
        _fraction(f"hardware {self.name}", matmul_efficiency=self.matmul_efficiency,
                  attention_efficiency=self.attention_efficiency, memory_efficiency=self.memory_efficiency,
                  memory_fraction=self.memory_fraction)
        if self.attention_memory_efficiency is not None:
            _fraction(f"hardware {self.name}", attention_memory_efficiency=self.attention_memory_efficiency)
        if self.kernel_overhead_s < 0:
            raise ValueError(f"hardware {self.name}: kernel_overhead_s must be >= 0")


GB = 10**9
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s fp16 dense, 2039 GB/s HBM2e, 108 SMs.
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2039e9, 80 * GB, num_sms=108),
    # NVIDIA RTX A6000: 154.8 TFLOP/s fp16 tensor dense (309.7 with sparsity), 768 GB/s GDDR6, 84 SMs.
    "a6000": HardwareSpec("a6000", 154.8e12, 768e9, 48 * GB, num_sms=84),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s fp16 dense, 3350 GB/s HBM3, 132 SMs.
    "h100": HardwareSpec("h100", 989e12, 3350e9, 80 * GB, num_sms=132, matmul_efficiency=0.7),
    # NVIDIA H200 SXM 141GB: same compute as H100, 4800 GB/s HBM3e.
    "h200": HardwareSpec("h200", 989e12, 4800e9, 141 * GB, num_sms=132, matmul_efficiency=0.7),
}


# The names a datasheet gives them.
HARDWARE_ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "h200-141gb": "h200"}


def hardware_spec(spec: str | HardwareSpec | dict) -> HardwareSpec:
    hardware = _given_or_preset(spec, HardwareSpec, HARDWARE_PRESETS)
    if hardware is not None:
        return hardware
    if isinstance(spec, str) and spec.lower() in HARDWARE_ALIASES:
        return HARDWARE_PRESETS[HARDWARE_ALIASES[spec.lower()]]
    raise ValueError(f"unknown hardware {spec!r}: choose one of {', '.join(HARDWARE_PRESETS)}")


# ---- cluster -----------------------------------------------------------------------------------

DISPATCH_POLICIES = ("round-robin", "least-loaded")
PP_SCHEDULING = ("virtual-engines", "shared", "shared-capped")


@dataclass(frozen=True)
class ClusterConfig:
    """Replicas of one model, each split TP-ways inside a node and PP-ways across nodes.

    Links (per GPU): intra-node NVLink (A100 DGX: 300 GB/s per direction per GPU through NVSwitch),
    inter-node InfiniBand (HDR 200 Gb/s = 25 GB/s per GPU, one NIC per GPU as in a DGX A100).
    Latencies are per message/hop (NVLink ~1 us, IB ~5 us). `link_efficiency` is the share of link
    bandwidth NCCL reaches (~0.75-0.8 for large all-reduces).

    `pp_scheduling`: how a replica's scheduler feeds `pp` micro-batches:
    - "virtual-engines" (default; vLLM v0's PP design): one scheduler per micro-batch slot, each
      with batch cap B and 1/pp of the KV cache; a slot plans its next batch when its last one returns.
    - "shared": one scheduler with cap pp*B and the whole KV cache; up to pp of its batches in flight.
      The engine's max_num_seqs caps running requests, not a batch, so a batch may hold up to pp*B.
    - "shared-capped" (Orca's own PP design, the engine's `micro_batch_cap`): as "shared", but each
      planned batch holds at most B requests (`Scheduler.schedule(max_requests=B)`).
    """

    replicas: int = 1
    tp: int = 1
    pp: int = 1
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 300e9
    intra_node_latency: float = 1e-6
    inter_node_bandwidth: float = 25e9
    inter_node_latency: float = 5e-6
    link_efficiency: float = 0.8
    dispatch: str = "round-robin"
    pp_scheduling: str = "virtual-engines"

    def __post_init__(self) -> None:
        for name in ("replicas", "tp", "pp", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster: {name} must be an integer >= 1, got {value!r}")
        _positive("cluster", intra_node_bandwidth=self.intra_node_bandwidth,
                  inter_node_bandwidth=self.inter_node_bandwidth)
        _fraction("cluster", link_efficiency=self.link_efficiency)
        if self.intra_node_latency < 0 or self.inter_node_latency < 0:
            raise ValueError("cluster: link latencies must be >= 0")
        if self.tp > self.gpus_per_node:
            raise ValueError(f"cluster: tp ({self.tp}) must fit in one node of {self.gpus_per_node} GPUs")
        if self.dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"cluster: dispatch must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch!r}")
        if self.pp_scheduling not in PP_SCHEDULING:
            raise ValueError(f"cluster: pp_scheduling must be one of {', '.join(PP_SCHEDULING)}, got {self.pp_scheduling!r}")

    @property
    def num_gpus(self) -> int:
        return self.replicas * self.tp * self.pp

    def pp_link(self) -> tuple[float, float]:
        """(bandwidth, latency) between consecutive stages: inter-node once a stage fills a node."""
        if self.tp * 2 <= self.gpus_per_node:  # two stages can share a node
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["ModelShape", "MODEL_PRESETS", "model_shape", "HardwareSpec", "HARDWARE_PRESETS", "hardware_spec",
           "ClusterConfig", "DISPATCH_POLICIES", "PP_SCHEDULING", "field"]
