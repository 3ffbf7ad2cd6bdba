"""One request's decode step taken apart (`charioteer bench single-stream --parts`): the layers in one call
with their weights streamed from memory, the LM head after them, and the first layers alone, small enough
that their weights stay in the caches between calls. A step's time less its layers' and head's is what runs
around them: scheduling, the input's tensors, sampling and the step record, in Python.

The parts run on a batch of their own (`BatchTimer`: its own KV blocks and cache, one decode at the given
context) through the model's one-call path, the same call the engine makes, so the engine is not touched."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from charioteer.bench.batch_timer import BatchShape, BatchTimer
from charioteer.model.llama import LlamaModel

CACHED_LAYERS = 2  # SmolLM2's GGUF layers: 4.4 MB of weights, which the 32 MB L3 of a Zen 4 keeps between calls
CACHED_CALLS = 20  # calls of the cached layers a round (their median), after one that brings them in
STREAMED_CALLS = 3  # calls of all layers and the head a round (their medians)


@dataclass
class DecodeParts:
    model: LlamaModel
    timer: BatchTimer  # holds the batch's KV cache
    inp: object  # the decode's ForwardInput
    cached_runner: object  # a decode runner of the first `cached_layers` layers
    cached_layers: int

    @classmethod
    def build(cls, model: LlamaModel, context: int) -> DecodeParts | None:
        """The parts of a one-decode step at `context` positions; None where the model does not run such a step
        in one call (bf16 activations, a pipeline stage, the CPU kernels off)."""
        timer = BatchTimer(model, context)
        inp, _, _ = timer.runner.prepare(timer.plan(BatchShape(decodes=(context,))))
        if not model.decodes_in_one_call(inp, timer.runner.kv):
            return None
        count = min(CACHED_LAYERS, len(model.layers))
        return cls(model, timer, inp, model.decode_runner(count), count)

    def time(self) -> dict[str, float]:
        """One round: `layers_s` (every layer, from memory), `head_s` (the LM head after them) and `cached_layer_s`
        (a layer of the first ones, from the caches), each a median of its calls."""
        model, kv = self.model, self.timer.runner.kv.data
        layers, head = [], []
        for _ in range(STREAMED_CALLS):
            start = time.perf_counter()
            h = model.run_decodes(self.inp, kv)
            middle = time.perf_counter()
            model.lm_head_linear(h)
            layers.append(middle - start)
            head.append(time.perf_counter() - middle)
        cached = []
        for _ in range(CACHED_CALLS + 1):
            start = time.perf_counter()
            model.run_decodes(self.inp, kv[:self.cached_layers], self.cached_runner)
            cached.append((time.perf_counter() - start) / self.cached_layers)
        return {"layers_s": statistics.median(layers), "head_s": statistics.median(head),
                "cached_layer_s": statistics.median(cached[1:])}

    @property
    def head_bytes(self) -> int:
        return self.model.lm_head_linear.nbytes
