"""Time one batch of a given shape on the real model, per operation.

A `BatchShape` says what a batch holds: prompt chunks (tokens, and tokens already cached before
them) and decodes (context length each). `BatchTimer` builds that Batch plan with real requests
and KV blocks, runs it through the engine's ModelRunner, and times each operation of the forward
pass through `LlamaModel.forward`'s hooks. The profiler and the paper's micro-benchmarks use it.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from charioteer.engine.model_runner import ModelRunner
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.model.config import ModelConfig
from charioteer.model.llama import LlamaModel
from charioteer.request import Request, SamplingParams
from charioteer.scheduling.base import Batch, BatchEntry

OPS = ("preproj", "attention", "postproj", "ffn")  # the paper's Table 2 columns; the rest is "other"


@dataclass(frozen=True)
class BatchShape:
    prefills: tuple[tuple[int, int], ...] = ()  # (chunk tokens, tokens cached before the chunk)
    decodes: tuple[int, ...] = ()  # context length of each decode, its new token included
    prefills_sample: bool = True  # whether each chunk ends its prompt and samples a token

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)

    def flops(self, config: ModelConfig) -> float:
        """Model FLOPs: linear layers for every token, LM head for sampled rows, attention scores and values."""
        rows = len(self.decodes) + (len(self.prefills) if self.prefills_sample else 0)
        total = config.linear_flops_per_token() * self.num_tokens + 2 * config.hidden_size * config.vocab_size * rows
        per_key = 4 * config.q_size * config.num_layers  # QK^T and AV, per query-key pair
        for n, cached in self.prefills:
            total += per_key * n * (cached + (n + 1) / 2)  # causal: query i sees cached + i + 1 keys
        total += per_key * sum(self.decodes)
        return total


@dataclass
class BatchTiming:
    shape: BatchShape
    total_s: float
    ops_s: dict[str, float] = field(default_factory=dict)  # OPS plus "other" (norms, RoPE, LM head, sampling)
    samples_s: list[float] = field(default_factory=list)


class OpClock:
    """hooks(op_name, fn) for LlamaModel.forward: accumulates wall time per operation."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.times: dict[str, float] = defaultdict(float)

    def __call__(self, name: str, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        self.times[name] += time.perf_counter() - start
        return out


class BatchTimer:
    def __init__(self, model: LlamaModel, max_cached_tokens: int, block_size: int = 16) -> None:
        self.model = model
        self.config = model.config
        # Room for the largest batch a benchmark builds, plus one block of slack per request.
        self.blocks = BlockManager(cdiv(max_cached_tokens, block_size) + 256, block_size, "paged")
        self.runner = ModelRunner(model, self.blocks)
        self.runner.kv.data.zero_()  # uninitialised memory may hold denormals, which are slow
        self._ids = 0

    def _request(self, length: int) -> Request:
        self._ids += 1
        vocab = self.config.vocab_size
        tokens = [(7 * i + self._ids) % vocab for i in range(length)]
        request = Request(f"t{self._ids}", tokens, SamplingParams(max_tokens=1, ignore_eos=True))
        self.blocks.admit(request, length)
        if not self.blocks.ensure(request, length):
            raise ValueError(f"batch does not fit the timer's KV cache ({self.blocks.capacity_tokens} tokens)")
        return request

    def plan(self, shape: BatchShape) -> Batch:
        batch = Batch()
        for n, cached in shape.prefills:
            request = self._request(cached + n)
            batch.entries.append(BatchEntry(request, cached, n, True, shape.prefills_sample))
        for context in shape.decodes:
            request = self._request(context)
            batch.entries.append(BatchEntry(request, context - 1, 1, False, True))
        return batch

    def release(self, batch: Batch) -> None:
        for entry in batch.entries:
            self.blocks.free(entry.request)

    def run_once(self, batch: Batch) -> tuple[float, dict[str, float]]:
        clock = OpClock(self.model.device)
        clock.sync()
        start = time.perf_counter()
        result = self.runner.execute(batch, hooks=clock)
        clock.sync()
        elapsed = time.perf_counter() - start
        for entry in batch.entries:
            self.runner.sampler.forget(entry.request.request_id)
        del result
        return elapsed, dict(clock.times)

    def time(self, shape: BatchShape, repeats: int = 5, warmup: int = 1) -> BatchTiming:
        """Median over `repeats` runs of the same batch (its K/V is rewritten each time, same values)."""
        batch = self.plan(shape)
        try:
            for _ in range(warmup):
                self.run_once(batch)
            runs = [self.run_once(batch) for _ in range(repeats)]
        finally:
            self.release(batch)
        return self._summarise(shape, runs)

    def time_pair(self, a: BatchShape, b: BatchShape, repeats: int = 7, warmup: int = 1) -> tuple[BatchTiming, BatchTiming, float]:
        """Time two batches alternately; also return the median of the paired differences a - b.

        Differences of interleaved runs cancel slow drifts of a noisy machine (other load, clocks),
        which matters when the difference is small, as with the marginal cost of a few decodes.
        """
        batch_a, batch_b = self.plan(a), self.plan(b)
        try:
            for _ in range(warmup):
                self.run_once(batch_a)
                self.run_once(batch_b)
            runs_a, runs_b = [], []
            for _ in range(repeats):
                runs_a.append(self.run_once(batch_a))
                runs_b.append(self.run_once(batch_b))
        finally:
            self.release(batch_a)
            self.release(batch_b)
        diff = statistics.median(ta - tb for (ta, _), (tb, _) in zip(runs_a, runs_b))
        return self._summarise(a, runs_a), self._summarise(b, runs_b), diff

    @staticmethod
    def _summarise(shape: BatchShape, runs) -> BatchTiming:
        total = statistics.median(t for t, _ in runs)
        ops = {op: statistics.median(r.get(op, 0.0) for _, r in runs) for op in OPS}
        ops["other"] = max(0.0, total - sum(ops.values()))
        return BatchTiming(shape, total, ops, [t for t, _ in runs])
