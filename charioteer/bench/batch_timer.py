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

from charioteer.bench.stats import interleaved
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
    samples_s: list[float] = field(default_factory=list)  # every run's total, in round order
    ops_samples_s: list[dict[str, float]] = field(default_factory=list)  # every run's per-op times

    def op_samples(self, op: str) -> list[float]:
        return [r.get(op, 0.0) for r in self.ops_samples_s]


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
        return self.time_interleaved({"only": shape}, repeats, warmup)["only"]

    def time_interleaved(self, shapes: dict[str, BatchShape], repeats: int = 5, warmup: int = 1,
                         after_each=None) -> dict[str, BatchTiming]:
        """Time several batches in rounds, each batch once per round (A B C A B C ...).

        Interleaving spreads the slow drifts of a noisy machine (other load, clocks) over every
        batch alike; the i-th samples of all batches come from the same round, so per-round
        differences and ratios (`BatchTiming.samples_s`) cancel most of the drift. Each batch is
        planned just before its run and released after it, so any number of them fit the cache.
        """
        def runner(shape: BatchShape):
            def run():
                batch = self.plan(shape)
                try:
                    return self.run_once(batch)
                finally:
                    self.release(batch)
            return run

        runs = interleaved([(name, runner(shape)) for name, shape in shapes.items()], repeats, warmup, after_each)
        return {name: self._summarise(shapes[name], runs[name]) for name in shapes}

    @staticmethod
    def _summarise(shape: BatchShape, runs) -> BatchTiming:
        total = statistics.median(t for t, _ in runs)
        ops = {op: statistics.median(r.get(op, 0.0) for _, r in runs) for op in OPS}
        ops["other"] = max(0.0, total - sum(ops.values()))
        return BatchTiming(shape, total, ops, [t for t, _ in runs], [r for _, r in runs])
