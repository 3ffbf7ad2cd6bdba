"""The paper-experiment benchmarks: their arithmetic, their runs on a tiny model, and their CLI contracts."""
import json
import re

import pytest

from charioteer.bench.batch_timer import BatchShape, BatchTimer
from charioteer.bench.e2e import POLICIES, Workload, balanced_pd, pd_grid, run_e2e
from charioteer.bench.experiments import find_steps
from charioteer.cli import main
from charioteer.model.config import ModelConfig
from charioteer.model.llama import LlamaModel


@pytest.fixture(scope="module", autouse=True)
def roofline_cache(tmp_path_factory):
    """Measure the roofline once for this module, in a cache outside the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def test_find_steps_sees_a_tile_step_and_ignores_noise():
    tokens = list(range(1, 129))
    smooth = [1.0 + 0.01 * n for n in tokens]
    assert find_steps(tokens, smooth) == []
    stepped = [t + (0.5 if n > 64 else 0.0) for n, t in zip(tokens, smooth)]
    assert [s["tokens"] for s in find_steps(tokens, stepped)] == [65]
    spiky = list(smooth)
    spiky[40] *= 1.5  # one slow sample is not a step
    assert find_steps(tokens, spiky) == []


def test_batch_flops_count_linear_attention_and_lm_head():
    c = ModelConfig("t", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=2)
    linear = c.linear_flops_per_token()
    shape = BatchShape(prefills=((4, 2),), decodes=(10, 3))
    per_key = 4 * c.q_size * c.num_layers
    expected = linear * 6 + 2 * 8 * 100 * 3 + per_key * (4 * (2 + 2.5) + 13)
    assert shape.flops(c) == pytest.approx(expected)
    assert BatchShape(prefills=((4, 0),), prefills_sample=False).flops(c) == pytest.approx(linear * 4 + per_key * 10)


def test_workload_split_and_balanced_point():
    w = Workload(256, balanced_pd(64, 8), 4)
    assert (w.prompt_len, w.decode_len) == (231, 25)
    assert Workload(10, 1000, 1).decode_len == 1 and Workload(10, 0.001, 1).prompt_len == 1
    assert pd_grid([32, 64], 8, [1, 8]) == [1, 4.57, 8, 9.14]
    assert pd_grid([49], 16, [3.2667]) == [3.27]  # not a second point that prints as the same
    with pytest.raises(ValueError, match="pd_ratio"):
        Workload(256, 0, 4)


def test_batch_timer_times_every_op_and_frees_its_blocks(tiny_model):
    model = LlamaModel(tiny_model.config, tiny_model.state_dict)
    timer = BatchTimer(model, 1024)
    free = timer.blocks.num_free_blocks
    t = timer.time(BatchShape(prefills=((20, 12),), decodes=(30, 7)), repeats=2)
    assert t.total_s > 0 and set(t.ops_s) == {"preproj", "attention", "postproj", "ffn", "other"}
    assert all(v >= 0 for v in t.ops_s.values()) and sum(t.ops_s.values()) == pytest.approx(t.total_s)
    assert timer.blocks.num_free_blocks == free


def test_batch_timer_interleaves_batches_and_keeps_every_sample(tiny_model, monkeypatch):
    model = LlamaModel(tiny_model.config, tiny_model.state_dict)
    timer = BatchTimer(model, 64)  # too small to hold all three batches at once: each is planned per run
    order = []
    run_once = timer.run_once
    monkeypatch.setattr(timer, "run_once", lambda batch: order.append(len(batch.entries)) or run_once(batch))
    shapes = {"one": BatchShape(decodes=(40,)), "two": BatchShape(decodes=(40, 40)),
              "three": BatchShape(decodes=(40, 40, 40))}
    t = timer.time_interleaved(shapes, repeats=3, warmup=1)
    assert order == [1, 2, 3] * 4  # a warm-up round, then A B C A B C A B C
    assert all(len(t[k].samples_s) == 3 and len(t[k].op_samples("ffn")) == 3 for k in shapes)
    assert t["two"].total_s == sorted(t["two"].samples_s)[1]
    assert timer.blocks.num_free_blocks == timer.blocks.num_blocks


def test_e2e_policies_shape_their_batches(tiny_model):
    w = Workload(48, 4, 6)  # P = 38, D = 10
    rows = {p: run_e2e(tiny_model, p, 8, 3, w) for p in POLICIES}
    for row in rows.values():
        assert row["throughput_tok_s"] > 0 and row["prompt_len"] == 38 and row["decode_len"] == 10
    assert rows["request-level"]["hybrid_batches"] == 0
    assert rows["orca-worst"]["hybrid_batches"] == 0  # all of a wave's prompts run together
    assert rows["orca-best"]["hybrid_batches"] > 0 and rows["orca-best"]["prefill_only_batches"] >= 1
    # One prompt per batch, whole: 6 prompts take 6 batches that hold a prefill.
    assert rows["orca-best"]["hybrid_batches"] + rows["orca-best"]["prefill_only_batches"] == 6
    # SARATHI: one 8-token chunk per batch; 38 tokens -> 5 chunks per request.
    s = rows["sarathi"]
    assert s["hybrid_batches"] + s["prefill_only_batches"] == 6 * 5
    assert s["piggybacked_decode_fraction"] > rows["orca-best"]["piggybacked_decode_fraction"]


VERDICTS = {"faster", "slower", "not distinguishable"}


def test_e2e_and_decode_speedup_json_contracts(capsys):
    rc = main(["bench", "e2e", "--model", "synthetic:tiny", "--json", "--chunk-sizes", "16", "--pd-ratios", "2",
               "--max-num-seqs", "4", "--seq-len", "64", "--num-requests", "6", "--repeats", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["roofline"]["peak_matmul_gflops"] > 0 and out["repeats"] == 2
    policies = {r["policy"] for r in out["rows"]}
    assert policies == set(POLICIES)
    for r in out["rows"]:
        assert {"policy", "chunk_size", "pd_ratio", "batch_size", "throughput_tok_s", "gain_vs_request_level"} <= set(r)
        assert len(r["throughput_tok_s_samples"]) == 2
        lo, hi = r["throughput_tok_s_spread"]
        assert lo <= r["throughput_tok_s"] <= hi and r["vs_request_level"] in VERDICTS
        assert 0 <= r["mfu_spread"][0] <= r["mfu"] <= r["mfu_spread"][1] <= 1
        assert (r["policy"] == "sarathi") == ("vs_orca_best" in r)
        assert 0 < r["mfu_ceiling"] <= 1 and r["roofline_gain"] > 0  # the same batches at the roofline alone
    assert all(p["roofline_peak_pd"] in (2.0, 5.33) for p in out["peaks"]) and out["peaks"]
    # request-level against itself: ratio 1 and never a win
    assert all(r["gain_vs_request_level"] == 1.0 and r["vs_request_level"] == "not distinguishable"
               and r["roofline_gain"] == 1.0 for r in out["rows"] if r["policy"] == "request-level")
    assert {r["pd_ratio"] for r in out["rows"]} == {2.0, 5.33}  # the grid point and C/(B-1)

    rc = main(["bench", "decode-speedup", "--model", "synthetic:tiny", "--json", "--seq-lens", "64",
               "--batch-sizes", "2,4", "--chunk-size", "16", "--repeats", "3"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["seq_len"], r["batch_size"]) for r in rows] == [(64, 2), (64, 4)]
    for r in rows:
        assert "decode_speedup" in r and r["verdict"] in VERDICTS
        for name in ("baseline_decode_ms_per_token", "hybrid_decode_ms_per_token", "baseline_mfu", "hybrid_mfu"):
            lo, hi = r[name + "_spread"]
            assert lo <= r[name] <= hi
        assert r["hybrid_mfu_spread"][1] <= 1 and r["baseline_mfu_spread"][1] <= 1


def test_peaks_name_the_roofline_peak_only_where_rows_are_priced():
    """Each chunk size's measured peak beside the roofline's; a run the simulator does not price (GGUF blocks)
    names no roofline peak rather than a row's P:D picked by default."""
    from charioteer.bench.experiments import _peaks

    def row(pd, gain, roofline=None):
        r = {"policy": "sarathi", "chunk_size": 16, "pd_ratio": pd, "gain_vs_request_level": gain,
             "gain_vs_request_level_spread": [gain, gain], "vs_request_level": "not distinguishable"}
        return r if roofline is None else {**r, "roofline_gain": roofline}

    priced = _peaks([row(1.0, 0.9, 1.1), row(2.0, 1.0, 1.3), row(4.0, 0.8, 1.2)], [16], batch_size=9)[0]
    assert (priced["peak_pd"], priced["roofline_peak_pd"], priced["balanced_pd"]) == (2.0, 2.0, 2.0)
    assert priced["peak_within_30pct"]
    unpriced = _peaks([row(1.0, 0.9), row(4.0, 1.1)], [16], batch_size=9)[0]
    assert unpriced["peak_pd"] == 4.0 and unpriced["roofline_peak_pd"] is None


def test_e2e_prints_its_table_without_request_level(capsys):
    # no gains without the baseline, so no peaks either: the table still prints, and says why
    rc = main(["bench", "e2e", "--model", "synthetic:tiny", "--chunk-sizes", "16", "--pd-ratios", "2",
               "--max-num-seqs", "4", "--seq-len", "64", "--num-requests", "6", "--repeats", "2", "--policies", "sarathi"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sarathi" in out and "none: the gains are against request-level, which --policies left out" in out


def test_profile_json(capsys):
    rc = main(["profile", "--model", "synthetic:tiny", "--json", "--seq-len", "32", "--repeats", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    kinds = [r["batch"] for r in out["table2"]]
    assert kinds[:3] == ["prefill-only", "decode-only", "hybrid"]
    assert [r["batch_size"] for r in out["figure3"]] == [1, 2, 16]
    for r in out["table2"]:
        assert r["total_ms_spread"][0] <= r["total_ms"] <= r["total_ms_spread"][1] and r["mfu_spread"][1] <= 1
    assert out["decode_speedup_in_hybrid_verdict"] in VERDICTS and "decode_ms_per_token_alone_spread" in out
    assert all("decode_ms_per_token_spread" in r for r in out["figure3"])


def test_bad_benchmark_arguments_fail_with_a_message(capsys):
    assert main(["bench", "decode-speedup", "--model", "synthetic:tiny", "--batch-sizes", "1,2"]) == 2
    assert "batch sizes >= 2" in capsys.readouterr().err
    assert main(["bench", "e2e", "--model", "synthetic:tiny", "--policies", "fifo"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["bench", "tile", "--model", "synthetic:tiny", "--repeats", "1"]) == 2
    assert "one sample has no spread" in capsys.readouterr().err


def test_paper_quick_writes_report_plots_and_json(capsys, tmp_path):
    rc = main(["bench", "paper", "--quick", "--repeats", "2", "--model", "synthetic:tiny", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"profile", "decode_speedup", "e2e", "chunk_ablation", "tile", "summary"} <= set(results)
    assert all(args["repeats"] == 2 for args in results["plan"].values())
    assert 0 <= results["summary"]["max_mfu"] <= 1
    report = (tmp_path / "report.md").read_text()
    for heading in ("Table 2", "Figure 3", "Figure 8", "Figures 9 and 11", "Figure 10", "Figure 13", "Figure 7"):
        assert heading in report
    assert "interleaved" in report and "not distinguishable" in report  # the method, and request-level vs itself
    assert re.search(r"\| [0-9.]+ \[[0-9.]+, [0-9.]+\] \|", report)  # medians with their spreads
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 6
    assert "), fp32, cpu" in report and "peak fp32 matmul" in report and "--dtype" not in report
    # The report names the precision the run had (a bf16 run was once reported as fp32).
    from charioteer.bench.report import write_report

    results["roofline"]["dtype"] = "bfloat16"
    (tmp_path / "bf16").mkdir()
    write_report(results, str(tmp_path / "bf16"))
    bf16 = (tmp_path / "bf16" / "report.md").read_text()
    assert "--dtype bfloat16" in bf16 and "), bf16, cpu" in bf16 and "peak bf16 matmul" in bf16
    assert "fp32" not in bf16.split("## Table 2")[0]


def test_paper_plan_repeats_and_steps():
    from charioteer.bench.experiments import paper_plan, paper_steps, shared_e2e

    full, quick = paper_plan(False), paper_plan(True)
    assert all(args["repeats"] >= 2 for plan in (full, quick) for args in plan.values())
    assert all(args["repeats"] == 4 for args in paper_plan(True, 4).values())
    assert paper_steps(quick) < paper_steps(full)
    assert shared_e2e(full)  # Figure 13c reuses the e2e runs at the balanced points


def test_chunk_ablation_reuses_e2e_runs_at_the_same_point(tiny_model, monkeypatch):
    """Given e2e rows at a chunk size's balanced P:D, the ablation takes their samples instead of running
    the engine again (run_e2e would fail here); other chunk sizes still run (counted, faked)."""
    from charioteer.bench import experiments as ex

    model = LlamaModel(tiny_model.config, tiny_model.state_dict)
    setup = ex.Setup(tiny_model, model, BatchTimer(model, 1024), "cpu", {"peak_matmul_gflops": 1e6})
    ran = []

    def fake_run_e2e(loaded, policy, c, batch_size, workload, device="cpu", op_breakdown=False, tile_size=None, precision=None):
        ran.append((policy, c))
        return {"policy": policy, "chunk_size": c, "pd_ratio": round(workload.pd_ratio, 3), "batch_size": batch_size,
                "seq_len": workload.seq_len, "prompt_len": workload.prompt_len, "decode_len": workload.decode_len,
                "num_requests": workload.num_requests, "elapsed_s": 1.0, "throughput_tok_s": 100.0, "batches": 1,
                "prefill_only_batches": 0, "decode_only_batches": 0, "hybrid_batches": 1,
                "piggybacked_decode_fraction": 1.0}

    monkeypatch.setattr(ex, "run_e2e", fake_run_e2e)
    pd = round(balanced_pd(8, 3), 3)
    known = {"seq_len": 32, "batch_size": 3, "num_requests": 4, "rows": [
        {"policy": "request-level", "chunk_size": None, "pd_ratio": pd, "throughput_tok_s": 10.0,
         "throughput_tok_s_spread": [9.0, 11.0], "throughput_tok_s_samples": [9.0, 10.0, 11.0]},
        {"policy": "sarathi", "chunk_size": 8, "pd_ratio": pd, "throughput_tok_s": 20.0,
         "throughput_tok_s_spread": [19.0, 21.0], "throughput_tok_s_samples": [19.0, 20.0, 21.0]}]}
    out = ex.chunk_ablation(setup, seq_len=32, chunk_sizes=(8, 16), batch_size=3, num_requests=4, repeats=2,
                            e2e_result=known)
    rows = {r["chunk_size"]: r for r in out["rows"]}
    assert rows[8]["e2e_runs_from"] == "e2e" and rows[8]["e2e_speedup"] == 2.0 and rows[8]["e2e_verdict"] == "faster"
    assert "e2e_runs_from" not in rows[16] and rows[16]["e2e_verdict"] == "not distinguishable"
    assert ran.count(("request-level", 16)) == ran.count(("sarathi", 16)) == 2  # C = 16 runs, interleaved
    assert ("request-level", 8) not in ran  # C = 8 did not (the warm-up is one sarathi run)


def test_matmul_sweep_reports_plain_and_packed_gemm():
    from charioteer.bench.roofline import matmul_sweep
    from charioteer.model.llama import packed_gemm_available

    from charioteer.model import cpu_kernels

    rows = matmul_sweep("cpu", rows=(1, 8, cpu_kernels.max_rows() + 1), shape=(64, 32), repeats=1)
    assert [r["rows"] for r in rows] == [1, 8, cpu_kernels.max_rows() + 1] and all(r["linear_gflops"] >= 0 for r in rows)
    assert all("packed_gflops" in r for r in rows) == packed_gemm_available(__import__("torch").device("cpu"))
    assert all(("panel_gflops" in r) == cpu_kernels.available() for r in rows)
    # the engine's GEMM: the panel kernel up to its rows, then MKL's
    panel = [r["engine_gemm"] == "panel" for r in rows]
    assert panel == [cpu_kernels.available()] * 2 + [False]
    assert all(r["engine_gemm"] in ("panel", "packed", "plain") for r in rows)


def test_prefill_attention_sweep_times_every_backend_on_every_shape():
    from charioteer.bench.roofline import ATTENTION_SHAPES, prefill_attention_sweep
    from charioteer.model import cpu_kernels

    rows = prefill_attention_sweep("float32", repeats=2)
    backends = (["sdpa"] + [f"vector ({cpu_kernels.chosen_isa()})"] * cpu_kernels.available()
                + ["amx tiles"] * cpu_kernels.amx_available())
    shapes = [(model, n, start) for model, _, _, _, chunks in ATTENTION_SHAPES for n, start in chunks]
    expected = [shape + (backend,) for shape in shapes for backend in backends]
    assert [(r["model"], r["tokens"], r["start"], r["backend"]) for r in rows] == expected
    assert all(r["ms_spread"][0] <= r["ms"] <= r["ms_spread"][1] and r["gflops"] > 0 for r in rows)
    assert all(r["sdpa_over"] == 1 for r in rows if r["backend"] == "sdpa")


def test_decode_gemm_stream_times_each_backend_on_the_same_weights():
    from charioteer.bench.roofline import decode_gemm_stream

    from charioteer.model import cpu_kernels

    rows = decode_gemm_stream("cpu", rows=4, layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=300,
                              repeats=2)
    assert rows[0]["backend"] == "F.linear" and len({r["backend"] for r in rows}) == len(rows)
    assert all(r["ms_spread"][0] <= r["ms"] <= r["ms_spread"][1] and r["rows"] == 4 for r in rows)
    assert any(r["backend"].startswith("panel") for r in rows) == cpu_kernels.available()
    assert all(r["lm_head_ms"] > 0 for r in rows)
    # 2 layers of QKV (128 x 64), O (64 x 64), gate/up (192 x 64) and down (64 x 96): 4 bytes a weight, or
    # the panel kernel's bf16 and int8 weights' 2 and 1
    weights = 2 * (128 * 64 + 64 * 64 + 192 * 64 + 64 * 96)
    for r in rows:
        element_bytes = 2 if "bf16" in r["backend"] else 1 if "int8" in r["backend"] else 4
        assert r["weight_mb"] == round(weights * element_bytes / 1e6, 1) and r["ms"] > 0 and r["gflops"] > 0
    assert {"bf16" in r["backend"] for r in rows} == ({True, False} if cpu_kernels.available() else {False})
    # Only the backends that multiply in bf16 may raise the bf16 roofline, and only the rest the fp32 one
    # (an AMX tile rate once raised a 2-core Xeon's fp32 peak to 1.7x what it measures).
    for r in rows:
        multiplies_bf16 = r["backend"] in ("onednn packed bf16", "amx tiles bf16", "avx512-bf16 bf16")
        assert r["compute"] == ("bfloat16" if multiplies_bf16 else "float32"), r["backend"]


def test_decode_attention_stream_times_every_shape_against_the_read_bandwidth():
    from charioteer.bench.roofline import decode_attention_stream
    from charioteer.model import cpu_kernels

    shapes = (("tiny", 4, 2, 64, ((1, 16), (3, 40))),)
    rows = decode_attention_stream("float32", repeats=2, cache_mb=1, shapes=shapes)
    if not cpu_kernels.available():
        assert rows == []
        return
    assert [(r["model"], r["decodes"], r["context"]) for r in rows] == [("tiny", 1, 16), ("tiny", 3, 40)]
    for r in rows:
        low, high = r["us_per_call_spread"]
        assert low <= r["us_per_call"] <= high and r["kv_gbs"] > 0 and r["read_gbs"] > 0
        assert abs(r["of_read"] - r["kv_gbs"] / r["read_gbs"]) <= 0.01 + 0.01 * r["of_read"]  # rounded apart
