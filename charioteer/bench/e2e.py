"""End-to-end throughput on the paper's workload (section 5.1): the real engine, start to finish.

Every request has the same sequence length L and P:D ratio, so P prompt tokens and D = L - P
generated tokens (EOS ignored); all arrive at once and the batch size B is set. The policies:

- `request-level`: the baseline, prefill-only batches then decode-only batches;
- `orca-worst`: Orca with no limit, all prompts of a wave in one batch, so requests start and end
  together and nothing overlaps (the paper's worst case; it behaves like the baseline);
- `orca-best`: Orca with a token budget of P + B - 1, so each batch holds exactly one whole prompt
  plus the running decodes (the paper's best case, "SARATHI with C equal to the whole prompt");
- `sarathi`: one C-token chunk plus up to B - 1 decodes per batch.

The KV cache reserves each request's full length at admission, as the paper did, and holds B
requests, so B is both the memory limit and the batch cap.
"""
from __future__ import annotations

import gc
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from charioteer.bench.batch_timer import OPS, OpClock
from charioteer.config import EngineArgs
from charioteer.engine.llm_engine import LLMEngine
from charioteer.memory.block_manager import cdiv
from charioteer.model.loader import LoadedModel
from charioteer.request import SamplingParams
from charioteer.scheduling.chunk_size import split_for_pd

POLICIES = ("request-level", "orca-worst", "orca-best", "sarathi")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    seq_len: int  # L = P + D
    pd_ratio: float
    num_requests: int

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one prompt and one generated token), got {self.seq_len}")
        if self.pd_ratio <= 0:
            raise ValueError(f"pd_ratio must be > 0, got {self.pd_ratio}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")

    @property
    def prompt_len(self) -> int:
        return split_for_pd(self.seq_len, self.pd_ratio)[0]

    @property
    def decode_len(self) -> int:
        return self.seq_len - self.prompt_len


def balanced_pd(chunk_size: int, batch_size: int) -> float:
    """The paper's P:D = C / (B - 1): every decode piggybacks on a prompt chunk."""
    return chunk_size / max(batch_size - 1, 1)


def engine_args(policy: str, chunk_size: int | str, batch_size: int, workload: Workload, device: str,
                tile_size: int | None = None, **extra) -> EngineArgs:
    """The paper's setup for a policy: KV reserved at admission for exactly B requests of the workload's length,
    every row through every layer (the benchmark model is one layer standing for each of a deeper model's)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    scheduler = {"request-level": "request-level", "orca-worst": "orca", "orca-best": "orca", "sarathi": "sarathi"}[policy]
    budget = workload.prompt_len + batch_size - 1 if policy == "orca-best" else None
    return EngineArgs(
        scheduler=scheduler, chunk_size=chunk_size, max_num_seqs=batch_size, max_num_batched_tokens=budget,
        tile_size=tile_size if policy == "sarathi" else None,
        kv_policy="reserve", block_size=BLOCK_SIZE,
        num_kv_blocks=batch_size * cdiv(workload.seq_len, BLOCK_SIZE), device=device, full_last_layer=True, **extra,
    )


def add_requests(engine: LLMEngine, workload: Workload, salt: int = 0) -> None:
    """Queue the workload's requests: distinct token-id prompts of P tokens, exactly D outputs (EOS ignored)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=workload.decode_len, ignore_eos=True)
    for i in range(workload.num_requests):
        engine.add_request([(salt + 31 * i + 7 * j + 1) % vocab for j in range(workload.prompt_len)], params)


def run_e2e(loaded: LoadedModel, policy: str, chunk_size: int, batch_size: int, workload: Workload,
            device: str = "cpu", op_breakdown: bool = False, tile_size: int | None = None,
            precision: dict | None = None) -> dict:
    """Run the workload to completion on a fresh engine; return throughput and batch statistics.
    `precision`: dtype and quantization settings (default: the engine's)."""
    args = engine_args(policy, chunk_size, batch_size, workload, device, tile_size, **(precision or {}))
    clock = OpClock(torch.device(device)) if op_breakdown else None
    engine = LLMEngine(args, loaded=loaded, op_hooks=clock)
    counts: dict[str, int] = defaultdict(int)
    batch_kinds = {"mixed": "hybrid_batches", "prefill": "prefill_only_batches", "decode": "decode_only_batches"}

    def count(step) -> None:
        counts[batch_kinds[step.kind]] += 1
        counts["decodes_with_prefill" if step.num_prefill_tokens else "decodes_alone"] += step.num_decode_tokens

    engine.subscribe(count)
    add_requests(engine, workload)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = workload.num_requests * workload.seq_len
    decodes = counts["decodes_with_prefill"] + counts["decodes_alone"]
    row = {
        "policy": policy, "chunk_size": chunk_size if policy == "sarathi" else None,
        "pd_ratio": round(workload.pd_ratio, 3), "batch_size": batch_size, "seq_len": workload.seq_len,
        "prompt_len": workload.prompt_len, "decode_len": workload.decode_len, "num_requests": workload.num_requests,
        "elapsed_s": round(elapsed, 3), "throughput_tok_s": round(tokens / elapsed, 2),
        "batches": engine.num_steps,
        "prefill_only_batches": counts["prefill_only_batches"], "decode_only_batches": counts["decode_only_batches"],
        "hybrid_batches": counts["hybrid_batches"],
        "piggybacked_decode_fraction": round(counts["decodes_with_prefill"] / decodes, 3) if decodes else 0.0,
    }
    if clock is not None:
        row["ops_s"] = {op: round(clock.times.get(op, 0.0), 3) for op in OPS}
        row["ops_s"]["other"] = round(max(0.0, elapsed - sum(clock.times.get(op, 0.0) for op in OPS)), 3)
    del engine
    gc.collect()
    return row


def pd_grid(chunk_sizes: list[int], batch_size: int, base: list[float]) -> list[float]:
    """The base P:D ratios plus each chunk size's balanced point, so every peak has a point on it; all
    to 2 decimals, so a base ratio given as a balanced point (3.2667 for C = 49, B = 16) runs once."""
    points = {round(pd, 2) for pd in base} | {round(balanced_pd(c, batch_size), 2) for c in chunk_sizes}
    return sorted(points)
