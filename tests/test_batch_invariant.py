"""The batch-invariant mode (`LLM(batch_invariant=True)`): one request's tokens and logprobs are
bitwise the same alone and in other batches, chunk sizes, policies and pipeline stages, greedy and
seeded sampling, on the native kernels and on the portable torch path. The default mode is not
(README says so, and the last test shows it).

Logprobs are compared as tensors with torch.equal: the top 20 of every prompt and output position
(the sampled token's among them), each an fp32 value, so equal tensors are equal bits.
"""
import pytest
import torch
import torch.nn.functional as F

from charioteer import LLM, SamplingParams
from charioteer.model import cpu_kernels, invariant
from charioteer.model.llama import rms_norm
from charioteer.model.loader import load_model
from texts import prompt_ids

TARGET_LEN, OTHER_LENS = 13, (40, 6, 21, 3, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=20, prompt_logprobs=20)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=4, ignore_eos=True, logprobs=20)
OTHER = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)  # unseeded: draws from the global generator

each_isa = pytest.mark.parametrize("isa", [
    pytest.param(isa, marks=pytest.mark.skipif(cpu_kernels.load_reason(isa) is not None,
                                               reason=f"{isa} kernels: {cpu_kernels.load_reason(isa)}"))
    for isa in cpu_kernels.ISAS])
native_only = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.status()}")


@pytest.fixture(scope="module")
def short_model():
    """SmolLM2-135M's first 4 layers: its real weights, kernels and shapes, at a seventh of the time per step."""
    return load_model(num_layers=4)


@pytest.fixture(scope="module")
def prompts(short_model):
    tok = short_model.tokenizer
    return prompt_ids(tok, TARGET_LEN, 5), [prompt_ids(tok, n, 30 + 11 * i) for i, n in enumerate(OTHER_LENS)]


def fingerprint(output):
    """(tokens, (token ids, prompt logprobs), (token ids, output logprobs)) of one request."""
    def table(steps):  # each position's top 20 and sampled token: 20 or 21 (id, logprob) pairs, all in a row
        steps = [s for s in steps or [] if s is not None]
        ids = [t for s in steps for t in [len(s)] + sorted(s)]  # each position's count, then its token ids
        return torch.tensor(ids), torch.tensor([s[t] for s in steps for t in sorted(s)], dtype=torch.float64)

    out = output.outputs[0]
    return out.token_ids, table(output.prompt_logprobs), table(out.logprobs)


def assert_bitwise(reference, candidate, label):
    tokens, (prompt_ids_, prompt_lp), (ids, lp) = candidate
    assert tokens == reference[0], f"{label}: tokens {tokens} != {reference[0]}"
    assert torch.equal(prompt_ids_, reference[1][0]) and torch.equal(prompt_lp, reference[1][1]), \
        f"{label}: prompt logprobs differ"
    assert torch.equal(ids, reference[2][0]) and torch.equal(lp, reference[2][1]), f"{label}: output logprobs differ"


def run_mixes(llm, target, others, params, mixes):
    """The target request's fingerprint in each mix: (others before it, others after it) as indexes."""
    results = []
    for before, after in mixes:
        batch = [others[i] for i in before] + [target] + [others[i] for i in after]
        outputs = llm.generate(batch, [OTHER] * len(before) + [params] + [OTHER] * len(after))
        assert llm.engine.blocks.num_used_blocks == 0
        results.append(fingerprint(outputs[len(before)]))
    return results


MIXES = [((), ()), ((0,), (1, 2)), ((1, 3), (4,)), ((), (0, 1, 2, 3, 4)), ((4, 2, 0), ())]
# (engine settings, mixes): five chunk sizes and every policy; max_num_seqs=3 varies the decode batch size.
CONFIGS = [
    (dict(scheduler="sarathi", chunk_size=5), MIXES[:3]),
    (dict(scheduler="sarathi", chunk_size=8, max_num_seqs=3), MIXES[1:3]),
    (dict(scheduler="sarathi", chunk_size=32, token_budget_mode=True, max_num_batched_tokens=19,
          max_num_partial_prefills=2), MIXES[1:4]),
    (dict(scheduler="sarathi", chunk_size=64), MIXES[3:]),
    (dict(scheduler="orca"), MIXES[:3]),
    (dict(scheduler="vllm", max_num_batched_tokens=64), MIXES[1:3]),
    (dict(scheduler="request-level", max_num_seqs=3), MIXES[2:4]),
]


@pytest.fixture(scope="module")
def references(short_model, prompts):
    """The target alone, its whole prompt in one chunk: greedy and seeded."""
    llm = LLM(short_model, batch_invariant=True, chunk_size=256)
    return {name: run_mixes(llm, prompts[0], prompts[1], params, [((), ())])[0]
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@native_only
@pytest.mark.parametrize("config,mixes", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values())
                         if isinstance(c, dict) else None)
def test_same_bits_in_every_mix_chunk_size_and_policy(short_model, prompts, references, config, mixes):
    llm = LLM(short_model, batch_invariant=True, **{"max_num_seqs": 8, **config})
    assert llm.engine.model.kernels.invariant == "native"
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        for mix, result in zip(mixes, run_mixes(llm, *prompts, params, mixes)):
            assert_bitwise(references[name], result, f"{config} {name} mix {mix}")


@native_only
def test_same_bits_after_preemption(short_model, prompts, references):
    """Few KV blocks: requests are preempted and recomputed, the target's bits do not change."""
    llm = LLM(short_model, batch_invariant=True, chunk_size=16, block_size=4, num_kv_blocks=14, max_num_seqs=6)
    preempted = []
    llm.engine.subscribe(lambda step: preempted.extend(step.preempted))
    for mix, result in zip(MIXES[3:], run_mixes(llm, *prompts, GREEDY, MIXES[3:])):
        assert_bitwise(references["greedy"], result, f"preempting mix {mix}")
    assert preempted, "the KV cache was meant to be too small for the batch"


@native_only
def test_same_bits_with_two_pipeline_stages(short_model, prompts, references):
    llm = LLM(short_model, batch_invariant=True, pipeline_parallel_size=2, chunk_size=8, max_num_seqs=4)
    try:
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            for mix, result in zip(MIXES[1:3], run_mixes(llm, *prompts, params, MIXES[1:3])):
                assert_bitwise(references[name], result, f"2 stages {name} mix {mix}")
    finally:
        llm.shutdown()


def test_portable_path_same_bits(short_model, prompts, monkeypatch):
    """CHARIOTEER_BATCH_INVARIANT_KERNELS=portable: torch alone, slower, and as invariant."""
    monkeypatch.setenv(invariant.KERNELS_ENV, "portable")
    target, others = prompts
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    alone = LLM(short_model, batch_invariant=True, chunk_size=256)
    assert alone.engine.model.kernels.invariant == "portable"
    reference = run_mixes(alone, target, others, short, [((), ())])[0]
    chunked = LLM(short_model, batch_invariant=True, chunk_size=6, max_num_seqs=4)
    for mix, result in zip(MIXES[1:3], run_mixes(chunked, target, others, short, MIXES[1:3])):
        assert_bitwise(reference, result, f"portable mix {mix}")


def test_default_mode_is_not_batch_invariant(short_model, prompts):
    """README: the default mode does not promise equal bits, and here its logprobs differ between mixes: alone,
    the target runs the panel kernel; beside a long prompt's chunk, its rows are in a batch of more rows than
    the panel kernel takes (cpu_kernels.max_rows()), which runs MKL's GEMM."""
    target, _ = prompts
    long_len = cpu_kernels.max_rows() + 40
    llm = LLM(short_model, chunk_size=long_len + 8, max_num_seqs=8)
    long = prompt_ids(short_model.tokenizer, long_len, 77)
    alone, mixed = run_mixes(llm, target, [long], GREEDY, [((), ()), ((), (0,))])
    assert not torch.equal(alone[1][1], mixed[1][1]) or not torch.equal(alone[2][1], mixed[2][1])


def test_settings_are_refused_clearly():
    for bad in (dict(dtype="bfloat16"), dict(quantization="int8"), dict(device="cuda")):
        with pytest.raises(ValueError, match="batch_invariant runs float32 CPU kernels only"):
            LLM("synthetic:tiny", batch_invariant=True, **bad)


# ---- the building blocks, row by row ---------------------------------------------------------------

ROW_COUNTS = (1, 2, 5, 17, 33, 64, 130)


def rows_everywhere(fn, x, check_row=3):
    """fn on batches of every size in ROW_COUNTS with row `check_row` of x at several places: its output row is
    bitwise fn(x[check_row:check_row + 1])."""
    alone = fn(x[check_row:check_row + 1])[0]
    for rows in ROW_COUNTS:
        for place in {0, rows // 2, rows - 1}:
            batch = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(rows))[:rows]].clone()
            batch[place] = x[check_row]
            assert torch.equal(fn(batch)[place], alone), f"{rows} rows, row at {place}"


@each_isa
def test_panel_gemm_rows_do_not_depend_on_the_batch(isa):
    x, w = torch.randn(140, 200), torch.randn(77, 200)
    panels = cpu_kernels.pack(w, isa=isa)
    rows_everywhere(lambda b: cpu_kernels.linear(b, panels, 77, isa=isa), x)


def test_portable_gemm_rows_do_not_depend_on_the_batch():
    x, w = torch.randn(140, 200), torch.randn(77, 200)
    rows_everywhere(lambda b: invariant.rowwise_linear(b, w), x)


def test_torch_row_ops_do_not_depend_on_the_batch():
    """What both paths leave to torch: RMSNorm (the first and final norms), the log-softmax of logprobs."""
    x, weight = torch.randn(140, 576), torch.randn(576)
    rows_everywhere(lambda b: rms_norm(b, weight, 1e-5), x)
    logits = torch.randn(140, 4099) * 5
    rows_everywhere(lambda b: torch.log_softmax(b, dim=-1), logits)


@pytest.mark.parametrize("native", [pytest.param(True, marks=native_only), False], ids=["native", "portable"])
def test_attention_query_does_not_depend_on_its_batch_or_cache(native):
    """A query at position p against keys 0..p: alone, among other queries, in a wider padded slot table."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(300, 3, 64), torch.randn(300, 3, 64)
    q = torch.randn(40, 9, 64)
    context = torch.randperm(299)[:120]  # slot 299 stays free as padding

    def attend(queries, positions, width):
        slots = torch.full((len(queries), width), 299, dtype=torch.long)
        slots[:, :min(width, 120)] = context[:width]
        out = torch.empty(len(queries), 9, 64)
        invariant.attend_each_query(q[queries], k_cache, v_cache, slots, torch.tensor(positions) + 1, 0.125, native, out)
        return out

    alone = attend([7], [50], 51)[0]
    assert torch.equal(attend([3, 7, 9], [100, 50, 119], 120)[1], alone)
    assert torch.equal(attend(list(range(30)), [i + 30 for i in range(30)], 200)[7], attend([7], [37], 38)[0])
    torch.testing.assert_close(alone, F.scaled_dot_product_attention(
        q[7][None, :, None], k_cache[context[:51]].transpose(0, 1)[None], v_cache[context[:51]].transpose(0, 1)[None],
        enable_gqa=True)[0, :, 0], rtol=1e-5, atol=1e-5)
