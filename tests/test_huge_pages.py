"""The packed weights' huge-page arena (charioteer.model.huge_pages)."""
import pytest
import torch

from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels, huge_pages


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(not huge_pages.enabled(), reason="huge pages: Linux only")
def test_the_arena_holds_equal_copies_side_by_side_on_huge_pages():
    tensors = [torch.randn(1000, 577), torch.randint(-127, 128, (3, 5, 7), dtype=torch.int8),
               torch.randn(2048, 1024).bfloat16(), torch.empty(0)]
    before = _anon_huge_kb()
    copies = huge_pages.into_arena(tensors)
    assert [c.dtype for c in copies] == [t.dtype for t in tensors]
    assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c, t in zip(copies, tensors) if t.numel())
    storage = copies[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == storage for c in copies)  # one buffer, the copies keep it alive
    assert all(c.data_ptr() % huge_pages.ALIGNMENT == 0 for c in copies)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the first weight starts a huge page
    if _thp_mode() != "never":  # 6 MB of copies: at least one 2 MB page was given
        assert _anon_huge_kb() - before >= 2048


def test_the_switch_keeps_the_weights_where_they_were(monkeypatch):
    monkeypatch.setenv("CHARIOTEER_HUGE_PAGES", "0")
    tensors = [torch.randn(4, 4)]
    assert not huge_pages.enabled()
    assert huge_pages.into_arena(tensors)[0] is tensors[0]


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("settings", [{}, {"quantization": "int8"}, {"dtype": "bfloat16"}])
def test_a_model_streams_its_packed_weights_from_one_arena_with_the_same_results(default_model, settings,
                                                                                 monkeypatch):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    outputs = {}
    for on in (True, False):
        monkeypatch.setenv("CHARIOTEER_HUGE_PAGES", "1" if on else "0")
        llm = LLM(default_model, max_num_seqs=2, **settings)
        model = llm.engine.runner.model
        panels = [lin.panels for layer in model.linears for lin in layer.values()] + [model.lm_head_linear.panels]
        storages = {p.untyped_storage().data_ptr() for p in panels}
        assert (len(storages) == 1) == (on and huge_pages.enabled())
        outputs[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]  # the same kernels on the same bits, elsewhere in memory
