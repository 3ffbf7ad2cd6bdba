"""The highest MFU a workload's batches can reach on this machine: its roofline's ceiling.

The simulator drives the engine's own scheduler over the workload, so it plans the batches the engine
plans, and prices each with `RooflineCostModel` at the measured peak and read bandwidth alone: every
efficiency 1, no tiles, no per-kernel cost, each GEMM, attention and element-wise pass at
max(FLOPs / peak, bytes / bandwidth). No run of those batches here takes less time, so the workload's
model FLOPs over that time, over the peak, bound the MFU that `roofline.mfu` gives any run of it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from charioteer.model.config import ModelConfig
from charioteer.sim.cost import RooflineCostModel
from charioteer.sim.simulator import ReplicaSetup, Simulator
from charioteer.sim.specs import ClusterConfig, HardwareSpec, ModelShape
from charioteer.sim.workload import Workload

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
WEIGHT_BYTES = {"int8": 1}  # weight-only quantization's linear weights; activations and KV keep the dtype's


def roofline_hardware(roof: dict) -> HardwareSpec:
    """This machine as the simulator's hardware: the roofline's peak and bandwidth, reached in full."""
    return HardwareSpec(f"{roof.get('device', 'cpu')} roofline ({roof.get('dtype', '?')})",
                        roof["peak_matmul_gflops"] * 1e9, roof["memory_bandwidth_gbs"] * 1e9, 1 << 40,
                        num_sms=1, tile_m=1, tile_n=1, matmul_efficiency=1.0, attention_efficiency=1.0,
                        memory_efficiency=1.0, kernel_overhead_s=0.0)


def priced(dtype: str, quantization: str | None = None) -> bool:
    """Whether the simulator's shapes price this precision (GGUF's block formats: not yet)."""
    return dtype in DTYPE_BYTES and (quantization is None or quantization in WEIGHT_BYTES)


def model_shape_of(config: ModelConfig, dtype: str, quantization: str | None = None) -> ModelShape:
    """The simulator's shape of an engine model in a precision (`PRECISION_SETTINGS`' dtype and quantization)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"no roofline ceiling for dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if quantization is not None and quantization not in WEIGHT_BYTES:
        raise ValueError(f"no roofline ceiling for quantization {quantization!r}: choose one of {', '.join(WEIGHT_BYTES)}")
    return ModelShape(config.name, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                      config.num_kv_heads, config.vocab_size, head_dim=config.head_dim,
                      max_position=config.max_position, dtype_bytes=DTYPE_BYTES[dtype],
                      weight_bytes=WEIGHT_BYTES.get(quantization, 0))


def roofline_makespan(shape: ModelShape, roof: dict, engine_kwargs: dict, prompt_lens: Sequence[int],
                      decode_lens: Sequence[int]) -> float:
    """Seconds the roofline allows for the requests, all arriving at once, under the engine's scheduler
    settings (`EngineArgs` keywords: scheduler, max_num_seqs, chunk_size, ...; KV reserved per request)."""
    prompts, decodes = np.asarray(prompt_lens, dtype=np.int64), np.asarray(decode_lens, dtype=np.int64)
    setup = ReplicaSetup(engine_kwargs["scheduler"], engine_kwargs["max_num_seqs"], int((prompts + decodes).max()),
                         chunk_size=engine_kwargs["chunk_size"], tile_size=engine_kwargs.get("tile_size"),
                         max_num_batched_tokens=engine_kwargs.get("max_num_batched_tokens"),
                         block_size=engine_kwargs.get("block_size", 16))
    cluster = ClusterConfig()
    cost = RooflineCostModel(shape, roofline_hardware(roof), cluster)
    return Simulator(setup, cluster, cost).run(Workload(np.zeros(len(prompts)), prompts, decodes)).makespan_s


def mfu_ceiling(flops: float, makespan_s: float, roof: dict) -> float:
    """The MFU of `flops` done in the roofline's makespan: no measured run of them can exceed it."""
    return flops / makespan_s / (roof["peak_matmul_gflops"] * 1e9)
