"""The simulator's step cost table (with its measured spread), `serve --trace-steps`, and `bench search-check`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from charioteer.cli import main
from charioteer.sim.validate import FEATURES, SPREAD_CLASSES, StepCostModel

TRUTH = {"batch": 2e-3, "prefill_step": 1e-3, "prefill_entries": 1e-4, "prefill_tokens": 3e-5, "decodes": 5e-5,
         "large_batch_tokens": 2e-5, "large_batch": 3e-3, "widen_pass": 5e-4, "prefill_attention": 1e-8, "decode_context": 2e-7,
         "after_large": 4e-3}
TRUTH_DECAY = 0.8


def _noisy_records(noise: float, n: int = 400, seed: int = 0):
    """n batches in the order they ran, priced with the history term (decay TRUTH_DECAY), times noise."""
    rng = np.random.default_rng(seed)
    exact = StepCostModel(TRUTH, 64, 4, decay=TRUTH_DECAY)
    plans = []
    for _ in range(n):
        plan = [(int(rng.integers(1, 200)), int(rng.integers(0, 500)), True) for _ in range(int(rng.integers(0, 3)))]
        plan += [(1, int(rng.integers(10, 900)), False) for _ in range(int(rng.integers(1, 12)))]
        plans.append(plan)
    times = exact.predict_sequence(plans) * rng.uniform(1 - noise, 1 + noise, n)
    return list(zip(plans, times.tolist()))


def test_a_fitted_table_carries_its_spread_and_the_simulator_draws_from_it():
    fitted = StepCostModel.fit(_noisy_records(0.2), 64, 4)
    assert set(fitted.spread) == set(SPREAD_CLASSES)
    for q in fitted.spread.values():
        assert q == sorted(q) and 0.7 < q[0] < 0.9 and 1.1 < q[-1] < 1.35  # the +-20 % it was given, about
    again = StepCostModel.from_json(fitted.to_json())
    assert again.spread == fitted.spread and again.coefs == fitted.coefs
    plan = [(60, 0, True), (1, 300, False), (1, 120, False)]  # R rows or fewer: no history term
    draws = [again.batch_cost(plan)[0][0] for _ in range(400)]
    replay = StepCostModel.from_json(fitted.to_json())
    assert draws == [replay.batch_cost(plan)[0][0] for _ in range(400)]  # seeded
    assert min(draws) < fitted.predict(plan) < max(draws)
    assert np.median(draws) == pytest.approx(fitted.predict(plan), rel=0.05)
    assert fitted.without_spread().batch_cost(plan)[0][0] == pytest.approx(fitted.predict(plan))
    # Without noise the fit is exact, and so is every draw.
    exact = StepCostModel.fit(_noisy_records(0.0), 64, 4)
    assert all(q == pytest.approx([1.0] * len(q), abs=1e-3) for q in exact.spread.values())
    for k in FEATURES:
        assert exact.coefs[k] == pytest.approx(TRUTH[k], rel=1e-3)
    assert exact.decay == TRUTH_DECAY and StepCostModel.from_json(exact.to_json()).decay == TRUTH_DECAY


def test_the_history_term_prices_steps_after_a_large_batch_per_replica():
    """A batch above R rows pushes the other weight copy out of cache: the steps after it cost
    after_large * decay ** s more. batch_cost keeps that history per model, as predict_sequence does for
    one run, and each replica's copy (for_replica) keeps its own."""
    model = StepCostModel(TRUTH, 64, 4, decay=TRUTH_DECAY)
    large, small = [(100, 0, True)], [(1, 50, False)] * 4
    plans = [small, large, small, small, small]
    by_batch_cost = [model.batch_cost(p)[0][0] for p in plans]
    assert by_batch_cost == pytest.approx(model.predict_sequence(plans).tolist())
    base = model.predict(small)
    assert by_batch_cost[0] == pytest.approx(base)  # no large batch yet
    for s, t in enumerate(by_batch_cost[2:], start=1):
        assert t == pytest.approx(base + TRUTH["after_large"] * TRUTH_DECAY ** s)
    fresh, other = model.for_replica(), model.for_replica()
    fresh.batch_cost(large)
    assert other.batch_cost(small)[0][0] == pytest.approx(base)  # the other replica ran no large batch
    assert fresh.batch_cost(small)[0][0] == pytest.approx(base + TRUTH["after_large"] * TRUTH_DECAY)
    with pytest.raises(ValueError, match="decay"):
        StepCostModel(TRUTH, 64, 4, decay=1.0)


def test_a_bad_spread_is_refused():
    with pytest.raises(ValueError, match="spread"):
        StepCostModel(TRUTH, 64, 4, spread={"prompt": [1.0, 1.1]})


def test_the_search_prices_batches_from_a_step_cost_table(tmp_path, capsys):
    table = tmp_path / "steps.json"
    table.write_text(StepCostModel.fit(_noisy_records(0.1), 64, 4).to_json())
    argv = ["simulate", "--search", "--model", "layers=4,hidden=128,ffn=352,heads=4,vocab=512", "--cost-table", str(table),
            "--devices", "2", "--search-tp", "1,2", "--search-pp", "1", "--search-policies", "sarathi,orca",
            "--search-chunk-sizes", "32", "--search-batch-caps", "8", "--num-requests", "40", "--min-len", "32",
            "--max-len", "160", "--slo-ttft", "1", "--slo-tbt", "0.05", "--workers", "1", "--json", "--no-progress"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(c["tp"], c["policy"]) for c in out["configs"]} == {(1, "sarathi"), (1, "orca")}
    assert any("tp2" in s and "per device" in s for s in out["skipped"])
    assert out["best"]["capacity_qps"] > 0


def test_serve_writes_each_step_record_as_it_happens(tmp_path):
    import asyncio

    from charioteer.bench.serve import BenchRequest, ServerProcess, run_requests, served_model
    from charioteer.engine.trace import load_trace

    trace = tmp_path / "steps.jsonl"
    with ServerProcess(["--model", "synthetic:tiny", "--scheduler", "sarathi", "--chunk-size", "16",
                        "--trace-steps", str(trace)]) as server:
        requests = [BenchRequest(list(range(start, start + n)), n, 4) for start, n in ((100, 40), (200, 10), (300, 25))]
        results, _ = asyncio.run(run_requests(server.url, served_model(server.url, None), requests,
                                              offsets=np.zeros(3), ignore_eos=True, progress=False))
        assert all(r.success and r.output_tokens == 4 for r in results)
        steps = load_trace(str(trace))  # read while the server runs: a line per step, flushed
    assert sum(s.num_prefill_tokens for s in steps) == 75 and sum(s.num_decode_tokens for s in steps) == 9
    assert max(s.num_prefill_tokens for s in steps) <= 16 and all(s.duration_s > 0 for s in steps)


def test_run_requests_refuses_offsets_of_another_length():
    import asyncio

    from charioteer.bench.serve import BenchRequest, run_requests

    with pytest.raises(ValueError, match="2 arrival offsets for 1 requests"):
        asyncio.run(run_requests("http://127.0.0.1:9", "m", [BenchRequest([1], 1, 1)], offsets=np.zeros(2)))


def test_search_check_runs_calibration_search_and_the_real_server(tmp_path, capsys):
    rc = main(["bench", "search-check", "--model", "synthetic:tiny", "--policies", "sarathi,orca", "--chunk-sizes", "16",
               "--batch-caps", "4", "--num-requests", "12", "--min-len", "16", "--max-len", "64", "--repeats", "1",
               "--slo-ttft", "5", "--slo-tbt", "1", "--out", str(tmp_path), "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    (search,) = r["searches"]
    assert {c["policy"] for c in search["configs"]} == {"sarathi", "orca"} and search["best"] in search["configs"]
    assert [x["rate_factor"] for x in r["rounds"]] == [1.0, 1.3]
    assert r["rounds"][1]["rate_qps"] == pytest.approx(1.3 * search["best"]["capacity_qps"], rel=1e-3)
    assert all(x["failed"] == 0 and x["p99_ttft_ms"] > 0 for x in r["rounds"])  # (the tiny model streams no text)
    assert r["confirmed"] == (r["at_capacity"]["slos_hold"] and not r["above"]["slos_hold"])
    table = StepCostModel.from_json((tmp_path / "r1-cost_table.json").read_text())
    assert table.spread is not None and table.coefs == search["cost_table"]
    assert json.loads((tmp_path / "search_check.json").read_text())["rounds"] == r["rounds"]


@pytest.mark.parametrize("argv, message", [
    (["--slo-tbt", "0"], "--slo-tbt must be > 0"),
    (["--over", "1"], "--over > 1"),
    (["--policies", "sarathi,fifo"], "--policies: unknown fifo"),
])
def test_search_check_bad_flags_fail_fast(argv, message, capsys):
    assert main(["bench", "search-check", "--model", "synthetic:tiny", *argv]) == 2
    assert message in capsys.readouterr().err
