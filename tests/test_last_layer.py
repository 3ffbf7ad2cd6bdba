"""The last layer computes only the rows whose logits are wanted (LlamaModel's `full_last_layer` off), and
that changes neither those logits nor any row's K and V in the cache."""
import dataclasses

import pytest
import torch

from charioteer.bench.batch_timer import BatchTimer
from charioteer.model.llama import LlamaModel, PrefillSpan, _span_queries
from charioteer.scheduling.base import Batch, BatchEntry

# (chunk tokens, tokens cached before it, whether the chunk ends its prompt and samples), then decodes' contexts
PREFILLS = ((40, 0, False), (23, 57, True), (64, 0, True))
DECODES = (31, 90, 12)


def _batch(timer: BatchTimer, prefills=PREFILLS, decodes=DECODES, prompt_logprobs: int | None = None) -> Batch:
    """The chunks and decodes as a batch; the chunk at index `prompt_logprobs` wants every row's logits."""
    batch = Batch()
    for i, (n, cached, samples) in enumerate(prefills):
        request = timer._request(cached + n)
        if i == prompt_logprobs:
            request.params = dataclasses.replace(request.params, prompt_logprobs=1)
        batch.entries.append(BatchEntry(request, cached, n, True, samples))
    for context in decodes:
        batch.entries.append(BatchEntry(timer._request(context), context - 1, 1, False, True))
    return batch


def _run(model: LlamaModel, timer: BatchTimer, batch: Batch, full: bool):
    """(logits, the whole KV cache after the batch, the rows the last layer's MLP ran) with every row through
    the last layer or not."""
    model.full_last_layer = full
    inp, _, _ = timer.runner.prepare(batch)
    timer.runner.kv.data.zero_()
    last, mlp_rows = model.linears[-1], []
    gate_up = last["gate_up"]
    last["gate_up"] = lambda h: mlp_rows.append(h.shape[0]) or gate_up(h)
    try:
        logits = model.forward(inp, timer.runner.kv)
    finally:
        last["gate_up"] = gate_up
    return logits, timer.runner.kv.data.clone(), mlp_rows


@pytest.fixture(params=["kernels", "sdpa", "invariant"])
def model(request, default_model, monkeypatch):
    if request.param == "sdpa":  # torch's SDPA for the prompt chunks: the mask of some queries is built
        monkeypatch.setenv("CHARIOTEER_VECTOR_ATTENTION", "0")
        monkeypatch.setenv("CHARIOTEER_AMX_ATTENTION", "0")
    return LlamaModel(default_model.config, default_model.state_dict, batch_invariant=request.param == "invariant")


def test_pruned_last_layer_keeps_the_logits_and_every_row_of_kv(model):
    timer = BatchTimer(model, 4096)
    batch = _batch(timer)
    pruned, kv_pruned, pruned_rows = _run(model, timer, batch, full=False)
    full, kv_full, full_rows = _run(model, timer, batch, full=True)
    # the sampling chunks' last rows and the decodes: 2 + 3 rows of the batch's 130
    assert pruned.shape == full.shape == (5, model.config.vocab_size)
    assert (pruned_rows, full_rows) == ([5], [sum(n for n, _, _ in PREFILLS) + len(DECODES)])
    assert torch.equal(kv_pruned, kv_full), "every row's K and V must be stored in every layer"
    if model.kernels.invariant:  # each row computed on its own, whatever else the layer runs
        assert torch.equal(pruned, full)
    else:  # the last layer's GEMMs see 5 rows instead of 130: other kernels, the same sums to rounding
        assert (pruned - full).abs().max().item() < 1e-4
        assert torch.equal(pruned.argmax(-1), full.argmax(-1))


def test_a_chunk_that_wants_prompt_logprobs_keeps_its_rows(default_model):
    model = LlamaModel(default_model.config, default_model.state_dict)
    timer = BatchTimer(model, 4096)
    batch = _batch(timer, prompt_logprobs=1)  # the second chunk's 23 rows, beside the others' last rows
    pruned, kv_pruned, pruned_rows = _run(model, timer, batch, full=False)
    full, kv_full, _ = _run(model, timer, batch, full=True)
    assert pruned_rows == [1 + 23 + 3] and pruned.shape == full.shape
    assert torch.equal(kv_pruned, kv_full)
    assert (pruned - full).abs().max().item() < 1e-4


def test_a_batch_that_samples_nothing_still_fills_the_cache(default_model):
    model = LlamaModel(default_model.config, default_model.state_dict)
    timer = BatchTimer(model, 4096)
    batch = _batch(timer, prefills=((48, 0, False), (30, 16, False)), decodes=())
    pruned, kv_pruned, pruned_rows = _run(model, timer, batch, full=False)
    full, kv_full, _ = _run(model, timer, batch, full=True)
    assert pruned.shape == full.shape == (0, model.config.vocab_size)
    assert pruned_rows == []  # the last layer stops after storing its K and V
    assert torch.equal(kv_pruned, kv_full)


def test_span_queries_cover_the_wanted_rows_of_each_chunk():
    span = PrefillSpan(10, 20, 5, None, None)  # batch rows 10..29
    assert _span_queries(span, None) == (0, 20)
    assert _span_queries(span, [3, 29, 31]) == (19, 20)  # the chunk's last row only
    assert _span_queries(span, [12, 15, 40]) == (2, 6)  # first to last wanted, the rows between too
    assert _span_queries(span, [0, 9, 30]) is None
