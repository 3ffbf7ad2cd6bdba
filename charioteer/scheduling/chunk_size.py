"""Choosing SARATHI's chunk size C from measured batch times (the paper's section 4.4, made concrete).

Inputs are a timing table, `TimingTable`: the iteration time of a batch of n rows for
n = 1..N (measured by `charioteer tune`, or given by a test), plus the time of a decode-only batch
of B requests and the extra attention cost of one decode. From it a steady-state model predicts
throughput for a workload with P prompt and D output tokens per request:

- each request's prompt takes floor(P / C) batches of C + d rows and, if C does not divide P, one
  of (P mod C) + d rows, where d = min(B - 1, D / chunks) decodes ride along;
- decodes that cannot ride (P:D < C/(B-1)) run in decode-only batches of B;
- throughput = (P + D) / (time per request).

The recommendation is the C with the highest predicted throughput. Steps in the table (tile or
kernel boundaries) make C + (B - 1) land on an efficient size by themselves, and small C pays for
its low matmul efficiency through the table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class TimingTable:
    batch_ms: list[float]  # batch_ms[n - 1]: iteration time of a batch of n rows (prompt tokens)
    decode_only_ms: float  # a decode-only batch of `batch_size` requests, at the workload's context
    decode_attention_ms: float = 0.0  # extra time per decode riding in a hybrid batch (its attention)
    batch_size: int = 1  # B the decode-only time was measured at
    steps: list[int] = field(default_factory=list)  # row counts where the time steps up
    # What was measured, so a simulator can scale the table to other layer counts and contexts.
    num_layers: int = 1
    hidden_size: int = 0
    context_len: int = 0  # the decodes' context length

    def __post_init__(self) -> None:
        if not self.batch_ms or min(self.batch_ms) <= 0:
            raise ValueError("the timing table needs a positive time for every row count from 1")
        if self.decode_only_ms <= 0 or self.batch_size < 1:
            raise ValueError("decode_only_ms must be > 0 and batch_size >= 1")

    @property
    def max_rows(self) -> int:
        return len(self.batch_ms)

    def rows_ms(self, n: int) -> float:
        """Time of a batch of n rows; beyond the table, linear in n from its last point."""
        if n <= self.max_rows:
            return self.batch_ms[n - 1]
        return self.batch_ms[-1] * n / self.max_rows

    @property
    def tile_size(self) -> int | None:
        """Rows per tile: where the largest step (relative jump) starts, if the table has a step.

        Small kernels show several small steps too (MKL's packed GEMM steps at 2^k + 1 rows);
        the largest one is what chunk alignment has to respect.
        """
        steps = [n for n in self.steps if 2 <= n <= self.max_rows]
        if not steps:
            return None
        return max(steps, key=lambda n: self.batch_ms[n - 1] / self.batch_ms[n - 2]) - 1


def predict_throughput(table: TimingTable, chunk_size: int, prompt_len: float, decode_len: float) -> float:
    """Predicted steady-state tokens/s of SARATHI with chunk C on requests of P prompt, D output tokens."""
    if chunk_size < 1 or prompt_len <= 0 or decode_len < 0:
        raise ValueError(f"need chunk_size >= 1, prompt_len > 0, decode_len >= 0; got {chunk_size}, {prompt_len}, {decode_len}")
    b = table.batch_size
    full = math.floor(prompt_len / chunk_size)
    rest = math.ceil(prompt_len - full * chunk_size)  # the prompt's last, shorter chunk
    chunks = full + (1 if rest > 0 else 0)
    riding = min(b - 1, decode_len / chunks)  # decodes per chunk batch
    extra = math.ceil(riding)
    ms = full * table.rows_ms(chunk_size + extra) + (table.rows_ms(rest + extra) if rest > 0 else 0.0)
    ms += chunks * riding * table.decode_attention_ms
    left = max(0.0, decode_len - riding * chunks)  # decodes that run without a chunk
    ms += left / b * table.decode_only_ms
    return (prompt_len + decode_len) / ms * 1e3


@dataclass
class Recommendation:
    chunk_size: int
    predicted_tok_s: float
    balanced_chunk_size: float  # (P/D)·(B-1), where every decode rides on a chunk
    curve: list[dict]  # {"chunk_size", "predicted_tok_s"} for every candidate


def recommend_chunk_size(table: TimingTable, prompt_len: float, decode_len: float,
                         min_chunk: int = 1, max_chunk: int | None = None) -> Recommendation:
    """The C in [min_chunk, max_chunk] with the highest predicted throughput."""
    max_chunk = max_chunk or max(table.max_rows, min_chunk)
    if not 1 <= min_chunk <= max_chunk:
        raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
    curve = [{"chunk_size": c, "predicted_tok_s": round(predict_throughput(table, c, prompt_len, decode_len), 3)}
             for c in range(min_chunk, max_chunk + 1)]
    best = max(curve, key=lambda p: p["predicted_tok_s"])
    balanced = prompt_len / decode_len * (table.batch_size - 1) if decode_len else math.inf
    return Recommendation(best["chunk_size"], best["predicted_tok_s"], balanced, curve)


def split_for_pd(seq_len: int, pd_ratio: float) -> tuple[int, int]:
    """(P, D) for a request of seq_len tokens at a P:D ratio."""
    if seq_len < 2 or pd_ratio <= 0:
        raise ValueError(f"need seq_len >= 2 and pd_ratio > 0, got {seq_len}, {pd_ratio}")
    p = min(max(round(seq_len * pd_ratio / (pd_ratio + 1)), 1), seq_len - 1)
    return p, seq_len - p
