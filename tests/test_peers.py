"""`charioteer bench peers`: workloads, FLOP counting, and a real side-by-side run of two engines."""
import json
import sys

import pytest

from charioteer.bench import peers
from charioteer.bench.common import PRECISION_SETTINGS, choices
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


def test_token_budgets_reach_sarathi_and_vllm_alike():
    w = peers.workload_b(vocab_size=49152, num_requests=4, token_budget=512, vllm_token_budget=512)
    assert w.engine_args["charioteer-sarathi"]["max_num_batched_tokens"] == 512
    assert w.job("vllm-cpu")["engine_args"] == {"max_num_batched_tokens": 512}
    assert peers.workload_b(49152, 4, token_budget=512).job("vllm-cpu")["engine_args"] == {}  # vLLM's default


def test_workload_c_is_the_balanced_point():
    w = peers.workload_c(vocab_size=1000, num_requests=8)
    assert {len(p) for p in w.prompts} == {196} and w.max_tokens == [60] * 8  # P:D = 49/15, L = 256
    sarathi = w.engine_args["charioteer-sarathi"]
    assert sarathi["scheduler"] == "sarathi" and sarathi["chunk_size"] == 49 and sarathi["max_num_seqs"] == 16
    assert w.engine_args["charioteer-orca"]["scheduler"] == "orca"
    # the worker passes each --dtypes precision beside these: none of its arguments may be here twice
    for settings in PRECISION_SETTINGS.values():
        assert not settings.keys() & sarathi.keys()


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
        choices("A,D", peers.WORKLOADS, "--workloads")


def test_side_by_side_run(tmp_path, monkeypatch):
    """Charioteer and HF static batching really run workload A in their own processes, twice each,
    interleaved; vLLM is reported as skipped with the reason when it is not given."""
    find_spec = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None if name == "vllm" else find_spec(name))
    order = []
    run_engine = peers.run_engine
    monkeypatch.setattr(peers, "run_engine", lambda python, engine, *a: order.append(engine) or run_engine(python, engine, *a))
    roof = {"peak_matmul_gflops": 10_000.0, "memory_bandwidth_gbs": 100.0}  # above any CPU: no re-measuring
    result = peers.run_peers(["A"], ["charioteer-sarathi", "hf-static", "vllm-cpu"], cache_dir=str(tmp_path),
                             roofline=roof, repeats=2)
    assert order == ["charioteer-sarathi", "hf-static"] * 2  # A B A B
    rows = {r["engine"]: r for r in result["rows"]}
    for engine in ("charioteer-sarathi", "hf-static"):
        row = rows[engine]
        assert row["status"] == "ok", row["status"]
        assert row["generated_tokens"] == 16 * 64 and row["tokens_per_s"] > 0 and row["repeats"] == 2
        lo, hi = row["tokens_per_s_spread"]
        assert lo <= row["tokens_per_s"] <= hi and len(row["tokens_per_s_samples"]) == 2
        assert 0 <= row["mfu_spread"][0] <= row["mfu"] <= row["mfu_spread"][1] < 1
        assert row["same_outputs_every_run"]
    assert rows["charioteer-sarathi"]["same_tokens_as_sarathi"] == 1.0
    assert "sarathi_verdict" not in rows["charioteer-sarathi"]
    assert rows["hf-static"]["sarathi_verdict"] in ("faster", "slower", "not distinguishable")
    assert rows["hf-static"]["sarathi_speedup"] > 0
    assert rows["vllm-cpu"]["status"].startswith("skipped")


@pytest.fixture
def canned_b(monkeypatch, tmp_path):
    """Workload B (4 requests) over the tiny model's config, with no model files written or loaded:
    for tests that hand run_peers canned engine results."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peers, "model_files", lambda cache_dir, keys: {k: {"hf_dir": "unused"} for k in keys})

    class Small:
        config = load_model("synthetic:tiny").config
        tokenizer = None

    monkeypatch.setattr("charioteer.model.loader.load_hf_dir", lambda path: Small)
    return peers.workload_b(Small.config.vocab_size, num_requests=4)


def test_rows_from_repeated_runs_with_mfu_held_to_the_peak(monkeypatch, canned_b):
    """Rows, verdicts and MFU from canned engine results: no process, no timing. A run faster than the
    stored peak makes the roofline re-measure it, and no MFU comes out above 1."""
    from charioteer.bench import roofline as rl

    w = canned_b
    # The fresh measurement: a little below the fastest run's rate, which then becomes the peak.
    observed, observe = [], rl.observe
    monkeypatch.setattr(rl, "observe", lambda roof, rate: observed.append(rate) or observe(roof, rate))
    monkeypatch.setattr(rl, "measure_peak_matmul_flops", lambda *a, **k: observed[-1] / 1.2)
    elapsed = {"charioteer-sarathi": iter([1.0, 1.1, 0.9]), "hf-static": iter([3.0, 3.3, 2.9])}

    def fake_run(python, engine, model, workloads, threads, timeout_s, dtype="float32"):
        return {"process_s": 5.0, "results": [{"elapsed_s": next(elapsed[engine]), "prompt_tokens": 100,
                                               "generated_tokens": 40, "outputs": [[1] * n for n in w.max_tokens]}]}

    monkeypatch.setattr(peers, "run_engine", fake_run)
    roof = {"peak_matmul_gflops": 1e-6, "memory_bandwidth_gbs": 1.0, "device": "cpu", "dtype": "float32"}
    result = peers.run_peers(["B"], ["charioteer-sarathi", "hf-static"], quick=True, roofline=roof, repeats=3)
    rows = {r["engine"]: r for r in result["rows"]}
    s, h = rows["charioteer-sarathi"], rows["hf-static"]
    assert s["tokens_per_s"] == 40.0 and s["tokens_per_s_spread"] == [36.4, 44.4]
    assert h["sarathi_speedup"] == pytest.approx(3.0, abs=0.01) and h["sarathi_verdict"] == "faster"
    assert roof["peak_matmul_gflops"] > 1e-6  # raised by the observed rate
    assert all(v <= 1 for r in (s, h) for v in [r["mfu"], *r["mfu_spread"]])
    assert s["mfu_spread"][1] >= 0.99  # the fastest run is the peak now (rounded up to 0.1 GFLOP/s)


def _canned_runs(monkeypatch, w, seconds: dict) -> list:
    """Replace the engine processes by canned results: `seconds[engine, dtype]` per run. Returns the
    (engine, dtype) of every run made."""
    ran = []

    def fake_run(python, engine, model, workloads, threads, timeout_s, dtype="float32"):
        ran.append((engine, dtype))
        return {"process_s": 1.0, "results": [{"elapsed_s": seconds[engine, dtype], "prompt_tokens": 100,
                                               "generated_tokens": 40, "outputs": [[1] * n for n in w.max_tokens]}]}

    monkeypatch.setattr(peers, "run_engine", fake_run)
    return ran


def test_each_dtype_is_compared_with_charioteer_in_the_same_dtype(monkeypatch, canned_b):
    """--dtypes float32,bfloat16: every engine but llama.cpp runs once per dtype (the dtype reaches its
    process), and each row's speedup is against charioteer-sarathi at the same precision."""
    w = canned_b
    seconds = {("charioteer-sarathi", "float32"): 1.0, ("hf-static", "float32"): 2.0,
               ("charioteer-sarathi", "bfloat16"): 4.0, ("hf-static", "bfloat16"): 2.0}
    ran = _canned_runs(monkeypatch, w, seconds)
    result = peers.run_peers(["B"], ["charioteer-sarathi", "hf-static"], quick=True, repeats=2,
                             dtypes=("float32", "bfloat16"))
    assert sorted(set(ran)) == sorted(seconds)
    rows = {(r["engine"], r["precision"]): r for r in result["rows"]}
    # ours says "bf16 weights and KV, fp32 activations" where bf16 runs widened (no bf16 arithmetic),
    # and that its GEMMs run in bf16 where the CPU has bf16 arithmetic (AMX)
    ours_bf16 = peers.precision_label("charioteer-sarathi", "bfloat16")
    assert ours_bf16 in ("bf16", peers.WIDENED_BF16, peers.NATIVE_GEMM_BF16)
    assert set(rows) == {("charioteer-sarathi", "fp32"), ("hf-static", "fp32"), ("charioteer-sarathi", ours_bf16),
                         ("hf-static", "bf16")}
    assert rows["hf-static", "fp32"]["sarathi_speedup"] == pytest.approx(2.0, abs=0.01)
    assert rows["hf-static", "bf16"]["sarathi_speedup"] == pytest.approx(0.5, abs=0.01)


def test_workload_c_rows_of_our_schedulers_carry_the_roofline_ceiling(monkeypatch, canned_b):
    """C's Charioteer rows get `mfu_ceiling`, the simulator's plans of their scheduler at the roofline, above the
    run's own MFU; HF, whose batches our scheduler does not plan, gets none."""
    w = peers.workload_c(1000, 16)
    _canned_runs(monkeypatch, w, {("charioteer-sarathi", "bfloat16"): 60.0, ("charioteer-orca", "bfloat16"): 60.0,
                                  ("hf-static", "bfloat16"): 90.0})
    roof = {"peak_matmul_gflops": 2000.0, "memory_bandwidth_gbs": 25.0, "device": "cpu", "dtype": "bfloat16"}
    result = peers.run_peers(["C"], ["charioteer-sarathi", "charioteer-orca", "hf-static"], quick=True, repeats=1,
                             dtypes=("bfloat16",), rooflines={"bfloat16": roof})
    rows = {r["engine"]: r for r in result["rows"]}
    sarathi, orca = rows["charioteer-sarathi"], rows["charioteer-orca"]
    assert sarathi["mfu"] < sarathi["mfu_ceiling"] < 1
    assert orca["mfu"] < orca["mfu_ceiling"] < 1 and orca["mfu_ceiling"] != sarathi["mfu_ceiling"]  # its own batches
    assert "mfu_ceiling" not in rows["hf-static"]


def test_int8_compares_charioteer_int8_with_llama_cpp_q8_0(monkeypatch, canned_b):
    """--dtypes float32,int8: llama.cpp runs its shipped GGUF under float32 and a Q8_0 copy under int8,
    each against charioteer-sarathi in that dtype; HF has no int8 here and says so."""
    assert peers.engine_dtypes("llama.cpp", ("float32", "int8")) == ["float32", "int8"]
    assert peers.engine_dtypes("llama.cpp", ("int8",)) == ["int8"]
    assert peers.engine_dtypes("hf-static", ("float32", "int8")) == ["float32", "int8"]
    w = canned_b
    seconds = {("charioteer-sarathi", "float32"): 2.0, ("llama.cpp", "float32"): 1.0, ("hf-static", "float32"): 4.0,
               ("charioteer-sarathi", "int8"): 1.0, ("llama.cpp", "int8"): 3.0}
    ran = _canned_runs(monkeypatch, w, seconds)
    monkeypatch.setattr(peers, "availability", lambda engine, vllm_python: (sys.executable, None))
    result = peers.run_peers(["B"], ["charioteer-sarathi", "llama.cpp", "hf-static"], quick=True, repeats=2,
                             dtypes=("float32", "int8"))
    assert sorted(set(ran)) == sorted(seconds)
    rows = {(r["engine"], r["precision"]): r for r in result["rows"]}
    assert rows["llama.cpp", "Q4_1 weights, f16 KV"]["sarathi_speedup"] == pytest.approx(0.5, abs=0.01)
    assert rows["llama.cpp", "Q8_0 weights, f16 KV"]["sarathi_speedup"] == pytest.approx(3.0, abs=0.01)
    assert rows["hf-static", "int8 weights, fp32 activations"]["status"].startswith("skipped: no weight-only int8")


def test_a_runs_file_keeps_each_finished_run_and_a_rerun_resumes_from_it(monkeypatch, canned_b, tmp_path):
    """--runs-file: every engine run is written as it ends; a rerun with the same settings takes the
    saved runs and runs only the rest, skipping a line cut off mid-write; other settings run afresh."""
    w = canned_b
    seconds = {("charioteer-sarathi", "float32"): 1.0, ("hf-static", "float32"): 2.0}
    ran = _canned_runs(monkeypatch, w, seconds)
    runs_file = tmp_path / "runs.jsonl"
    first = peers.run_peers(["B"], ["charioteer-sarathi", "hf-static"], quick=True, repeats=2,
                            runs_file=str(runs_file))
    assert len(ran) == 4 and len(runs_file.read_text().splitlines()) == 4
    with open(runs_file, "a") as f:
        f.write('{"settings": {"processor"')  # a write cut off by a kill
    ran.clear()
    again = peers.run_peers(["B"], ["charioteer-sarathi", "hf-static"], quick=True, repeats=3,
                            runs_file=str(runs_file))
    assert [engine for engine, _ in ran] == ["charioteer-sarathi", "hf-static"]  # the third round only
    rows = {r["engine"]: r for r in again["rows"]}
    assert rows["charioteer-sarathi"]["repeats"] == 3 and rows["hf-static"]["sarathi_speedup"] == pytest.approx(2.0)
    assert {r["engine"]: r["repeats"] for r in first["rows"]} == {"charioteer-sarathi": 2, "hf-static": 2}
    ran.clear()
    peers.run_peers(["B"], ["charioteer-sarathi", "hf-static"], quick=True, repeats=3, runs_file=str(runs_file))
    assert ran == []  # the runs written after the cut-off line are whole
    ran.clear()
    peers.run_peers(["B"], ["charioteer-sarathi"], quick=True, repeats=1, threads=1, runs_file=str(runs_file))
    assert len(ran) == 1  # another thread count: nothing taken from the file


def test_the_command_names_charioteers_kernels_beside_the_roofline(monkeypatch, capsys):
    """The roofline line names torch's own dispatch; the command also says which of Charioteer's kernel builds
    ran (CHARIOTEER_AVX512=0 puts the engines on the AVX2 one), in the table's header and in --json."""
    from charioteer.bench import roofline as rl
    from charioteer.cli import main
    from charioteer.model import cpu_kernels

    roof = {"peak_matmul_gflops": 100.0, "memory_bandwidth_gbs": 10.0, "ridge_flops_per_byte": 10.0,
            "device": "cpu", "dtype": "float32"}
    monkeypatch.setattr(rl, "roofline", lambda *a, **k: roof)
    monkeypatch.setattr(peers, "run_peers", lambda *a, **k: {"rows": []})
    assert main(["bench", "peers", "--workloads", "A", "--engines", "charioteer-sarathi", "--repeats", "2"]) == 0
    assert f"charioteer's CPU kernels: {cpu_kernels.status()}" in capsys.readouterr().out
    main(["bench", "peers", "--workloads", "A", "--engines", "charioteer-sarathi", "--repeats", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["charioteer_kernels"] == cpu_kernels.status()


def test_the_gguf_label_says_what_the_activations_are(monkeypatch):
    """Charioteer's gguf column names the Q4_1 layers' activation width, as the switch sets it in the worker too,
    or the dequantized fp32 weights where the GGUF kernel does not run."""
    from charioteer.model import cpu_kernels

    monkeypatch.setenv("CHARIOTEER_GGUF_KERNEL", "0")
    assert peers.precision_label("charioteer-sarathi", "gguf") == "the GGUF's Q4_1 weights dequantized, fp32"
    monkeypatch.delenv("CHARIOTEER_GGUF_KERNEL")
    if cpu_kernels.gguf_unavailable_reason() is not None:
        pytest.skip(f"GGUF kernel: {cpu_kernels.gguf_unavailable_reason()}")
    monkeypatch.delenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", raising=False)
    assert "on int8 activations" in peers.precision_label("charioteer-orca", "gguf")
    monkeypatch.setenv("CHARIOTEER_GGUF_INT8_ACTIVATIONS", "0")
    assert "on int16 activations" in peers.precision_label("charioteer-sarathi", "gguf")
    assert peers.precision_label("llama.cpp", "gguf") == "Q4_1 weights, f16 KV"
