"""`charioteer simulate --search`: bisection on the Poisson rate, the JSON it prints, and its errors."""
import json
from dataclasses import replace

import numpy as np
import pytest

from charioteer.cli import main
from charioteer.sim.search import (SLO, Candidate, SearchJob, SearchSpace, best_config, candidates, find_capacity,
                                   measure, next_rate, pareto_front, resolve_batch_cap, run_search,
                                   unit_poisson_arrivals)
from charioteer.sim.runner import run_one
from charioteer.sim.specs import ClusterConfig, hardware_spec, model_shape
from charioteer.sim.workload import Workload, WorkloadSpec, make_workload

TINY = "layers=4,hidden=256,ffn=512,heads=4"
TINY_WORKLOAD = ["--model", TINY, "--num-requests", "100", "--min-len", "32", "--max-len", "256"]


def tiny_job(slo: SLO, num_requests: int = 200) -> SearchJob:
    wl = make_workload(WorkloadSpec(num_requests=num_requests, lengths="zipf", min_len=32, max_len=256, seed=0))
    return SearchJob(model_shape(TINY), hardware_spec("a100-80gb"), ClusterConfig(), wl.prompt_len, wl.decode_len,
                     unit_poisson_arrivals(len(wl), 0), 256, slo)


@pytest.mark.parametrize("policy,chunk,slo", [
    ("sarathi", 64, SLO(ttft_p99_s=0.002, tbt_p99_s=1.0)),  # the TTFT SLO binds
    ("orca", None, SLO(ttft_p99_s=1.0, tbt_p99_s=0.00024)),  # the TBT SLO binds
])
def test_capacity_holds_the_slos_and_1_3x_does_not(policy, chunk, slo):
    job = tiny_job(slo)
    c = Candidate(tp=1, pp=1, replicas=1, policy=policy, chunk_size=chunk, batch_cap=16)
    found = find_capacity(job, c)
    assert found["limit"] == "slo" and found["capacity_qps"] > 0
    assert found["failing_qps"] <= found["capacity_qps"] * (1 + 2 * job.rel_tol)
    at = measure(job, c, found["capacity_qps"])
    assert at["holds"] and at["ttft_p99_s"] == found["ttft_p99_s"] and at["tbt_p99_s"] == found["tbt_p99_s"]
    over = 1.3 * found["capacity_qps"]
    assert not measure(job, c, over)["holds"]
    # The same verdict from a run that is not stopped once its TTFT SLO is lost.
    full = run_one(job.spec(c, stop_early=False), Workload(job.unit_arrivals / over, job.prompt_len, job.decode_len))
    assert not full.summary["stopped_early"]
    assert not slo.holds(full.summary["ttft_s"]["p99"], full.summary["tbt_s"]["p99"])


def test_miss_ratio_is_below_1_where_the_slos_hold_and_at_least_1_where_a_run_stopped():
    job = tiny_job(SLO(ttft_p99_s=0.002, tbt_p99_s=1.0))
    c = Candidate(1, 1, 1, "sarathi", 64, 16)
    found = find_capacity(job, c)
    held, lost = measure(job, c, found["capacity_qps"]), measure(job, c, 2 * found["failing_qps"])
    assert held["holds"] and 0 <= held["miss_ratio"] < 1
    assert lost["stopped_early"] and lost["miss_ratio"] >= 1


def test_next_rate_lands_on_the_root_of_a_power_law_and_aims_to_close_the_bracket():
    tol, root = 0.05, 3.0
    ratio = lambda r: (r / root) ** 1.7  # noqa: E731
    assert next_rate(1.0, ratio(1.0), 8.0, ratio(8.0), tol) == pytest.approx(root)
    # Before anything held: the power law through the two failing rates, never below hi / 4.
    assert next_rate(0.0, 0.0, 4.0, ratio(4.0), tol, above=(8.0, ratio(8.0))) == pytest.approx(root)
    assert next_rate(0.0, 0.0, 100.0, ratio(100.0), tol, above=(200.0, ratio(200.0))) == 25.0
    # A root this close to an end: the rate whose expected verdict leaves a bracket within the tolerance.
    assert next_rate(2.95, ratio(2.95), 8.0, ratio(8.0), tol) == pytest.approx(2.95 / (1 - 0.9 * tol))
    assert next_rate(1.0, ratio(1.0), 3.05, ratio(3.05), tol) == pytest.approx(3.05 * (1 - 0.9 * tol))
    assert next_rate(1.0, ratio(1.0), 8.0, ratio(8.0), tol, guess=5.0) == 5.0  # a guess inside comes first
    assert next_rate(1.0, 0.0, 4.0, 2.0, tol) == pytest.approx(2.0)  # nothing missed at lo: the geometric middle


def test_a_good_guess_closes_the_bracket_in_two_runs_without_the_saturation_run():
    job = tiny_job(SLO(ttft_p99_s=0.002, tbt_p99_s=1.0))
    c = Candidate(1, 1, 1, "sarathi", 64, 16)
    cold = find_capacity(job, c)
    warm = find_capacity(job, c, guess=cold["capacity_qps"])
    assert warm["simulations"] == 2 and warm["saturation_qps"] is None and warm["limit"] == "slo"
    assert warm["capacity_qps"] == cold["capacity_qps"]
    assert warm["failing_qps"] - warm["capacity_qps"] <= job.rel_tol * warm["failing_qps"]
    assert cold["simulations"] > 2 and cold["saturation_qps"] > cold["capacity_qps"]
    bad = find_capacity(job, c, guess=cold["saturation_qps"] * 0.9)  # a guess that fails still brackets it
    assert bad["failing_qps"] - bad["capacity_qps"] <= job.rel_tol * bad["failing_qps"] and bad["capacity_qps"] > 0


def test_a_run_no_batch_cap_bound_is_the_same_under_a_smaller_cap_and_is_reused():
    job = tiny_job(SLO(ttft_p99_s=1.0, tbt_p99_s=0.00024))
    big = Candidate(1, 1, 1, "orca", None, 16)
    rate = 0.1 * find_capacity(job, big)["capacity_qps"]
    point = measure(job, big, rate)
    small = replace(big, batch_cap=point["peak_held"] + 1)
    assert point["peak_held"] < small.batch_cap < big.batch_cap
    workload = Workload(job.unit_arrivals / rate, job.prompt_len, job.decode_len)
    runs = [run_one(job.spec(c), workload) for c in (big, small)]
    for field in ("first_token_s", "finish_s", "tbt_s", "batch_sizes", "batch_tokens", "stage_busy_s"):
        assert np.array_equal(getattr(runs[0].result, field), getattr(runs[1].result, field)), field
    assert measure(job, small, rate) == point
    # A search for the smaller cap that reaches this rate takes the run from `known` instead of repeating it.
    known = {rate: (big.batch_cap, point)}
    found = find_capacity(job, small, guess=rate, known=known)
    assert found["reused_runs"] == 1 and found["capacity_qps"] >= rate
    # Under a cap the run reached, it is run again.
    tight = replace(big, batch_cap=point["peak_held"])
    assert find_capacity(job, tight, guess=rate, known=dict(known))["reused_runs"] == 0


def test_search_results_do_not_depend_on_the_number_of_workers():
    job = tiny_job(SLO(ttft_p99_s=0.002, tbt_p99_s=1.0), num_requests=100)
    found, _ = candidates(job, SearchSpace(devices=2, tp=(1, 2), pp=(1,), policies=("sarathi", "orca"),
                                           chunk_sizes=(64,), batch_caps=(16, 8)))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert strip(run_search(job, found, workers=1)) == strip(run_search(job, found, workers=2))


def test_a_run_stops_once_its_ttft_slo_is_lost():
    job = tiny_job(SLO(ttft_p99_s=0.002, tbt_p99_s=1.0))
    c = Candidate(1, 1, 1, "sarathi", 64, 16)
    saturation = measure(job, c, None)  # every request at t = 0: run to the end
    assert not saturation["stopped_early"] and not saturation["holds"]
    stopped = measure(job, c, 200 / saturation["completion_time_s"] * 3)
    assert stopped["stopped_early"] and not stopped["holds"]
    assert stopped["completion_time_s"] < saturation["completion_time_s"]


def test_a_run_stops_once_its_tbt_slo_is_lost():
    """Enough slow gaps between tokens that the p99 must miss the TBT SLO end the run, with the verdict
    that the whole run gives."""
    slo = SLO(ttft_p99_s=100.0, tbt_p99_s=0.00024)
    job = tiny_job(slo)
    c = Candidate(1, 1, 1, "orca", None, 16)
    rate = 200 / measure(job, c, None)["completion_time_s"]
    stopped = measure(job, c, rate)
    full = run_one(job.spec(c, stop_early=False), Workload(job.unit_arrivals / rate, job.prompt_len, job.decode_len))
    assert stopped["stopped_early"] and not stopped["holds"]
    assert not full.summary["stopped_early"] and full.summary["tbt_s"]["p99"] > slo.tbt_p99_s
    assert stopped["completion_time_s"] < full.summary["completion_time_s"]


def test_slos_held_even_by_a_burst_give_the_saturation_throughput():
    job = tiny_job(SLO(ttft_p99_s=100.0, tbt_p99_s=100.0), num_requests=30)
    found = find_capacity(job, Candidate(1, 1, 1, "sarathi", 64, 16))
    assert found["limit"] == "throughput" and found["capacity_qps"] == found["saturation_qps"]


def test_candidates_cover_the_space_and_skip_what_does_not_fit():
    job = tiny_job(SLO())
    found, skipped = candidates(job, SearchSpace(devices=4, tp=(1, 2, 8), pp=(1, 2), policies=("sarathi", "orca"),
                                                 chunk_sizes=(64, 128), batch_caps=("max", 16, 10**9)))
    assert {(c.tp, c.pp) for c in found} == {(1, 1), (1, 2), (2, 1), (2, 2)}  # tp 8 > 4 devices
    assert all(c.devices == 4 or (c.tp, c.pp) == (1, 2) and c.replicas == 2 for c in found)
    assert {c.chunk_size for c in found if c.policy == "orca"} == {None}
    one_layout = [c for c in found if (c.tp, c.pp) == (1, 1)]
    assert len(one_layout) == 2 * 2 + 2  # sarathi: 2 chunk sizes x 2 caps ("max" and 10**9 lowered to it); orca: 2
    gpt3 = SearchJob(model_shape("gpt3-175b"), job.hardware, job.cluster, job.prompt_len, job.decode_len,
                     job.unit_arrivals, 4096, job.slo)
    found, skipped = candidates(gpt3, SearchSpace(devices=8, tp=(1, 8), pp=(1,), policies=("orca",)))
    assert [(c.tp, c.batch_cap) for c in found] == [(8, 11), (8, 5)]  # the paper's B = 11 for TP8, and max/2
    assert len(skipped) == 1 and "tp1 pp1" in skipped[0] and "raise tp or pp" in skipped[0]
    found, skipped = candidates(gpt3, SearchSpace(devices=8, tp=(8,), pp=(1,), policies=("orca",), min_batch_cap=6))
    assert [c.batch_cap for c in found] == [11] and skipped == ["tp8 pp1: batch cap 5 is below the minimum 6 "
                                                                "(memory allows 11)"]


def test_best_and_pareto_front():
    rows = [dict(capacity_qps=c, capacity_per_device=c, tbt_p99_s=t) for c, t in ((4, 0.1), (2, 0.05), (3, 0.2), (0, None))]
    assert best_config(rows)["capacity_per_device"] == 4
    assert [r["capacity_per_device"] for r in pareto_front(rows)] == [2, 4]
    assert best_config(rows[3:]) is None


def test_search_cli_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "pareto.png"
    rc = main(["simulate", "--search", *TINY_WORKLOAD, "--devices", "2", "--search-tp", "1,2", "--search-pp", "1",
               "--search-policies", "sarathi,orca", "--search-chunk-sizes", "64", "--search-batch-caps", "16",
               "--slo-ttft", "0.002", "--slo-tbt", "0.001", "--workers", "2", "--json", "--no-progress",
               "--plot", str(plot)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slo"] == {"ttft_p99_s": 0.002, "tbt_p99_s": 0.001} and out["devices"] == 2
    configs = out["configs"]
    assert {(c["tp"], c["replicas"], c["policy"]) for c in configs} == {(1, 2, "sarathi"), (1, 2, "orca"),
                                                                          (2, 1, "sarathi"), (2, 1, "orca")}
    for c in configs:
        assert {"tp", "pp", "replicas", "policy", "chunk_size", "batch_cap", "capacity_qps", "capacity_per_device"} <= c.keys()
        assert c["capacity_per_device"] == pytest.approx(c["capacity_qps"] / (c["tp"] * c["pp"] * c["replicas"]))
    assert out["best"] in configs
    assert out["best"]["capacity_per_device"] == max(c["capacity_per_device"] for c in configs)
    assert plot.stat().st_size > 0


def test_search_preset_is_gpt3_on_64_a100s(capsys):
    rc = main(["simulate", "--search", "--preset", "paper-fig12", "--num-requests", "30", "--search-tp", "8",
               "--search-pp", "8", "--search-policies", "sarathi", "--search-chunk-sizes", "256",
               "--search-batch-caps", "max", "--json", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"], out["hardware"], out["devices"]) == ("gpt3-175b", "a100-80gb", 64)
    [config] = out["configs"]
    assert (config["tp"], config["pp"], config["replicas"], config["batch_cap"]) == (8, 8, 1, 27)


@pytest.mark.parametrize("flag,value", [("--slo-tbt", "0"), ("--slo-ttft", "-1"), ("--slo-ttft", "nan")])
def test_bad_slo_is_one_clear_error(capsys, flag, value):
    assert main(["simulate", "--search", *TINY_WORKLOAD, flag, value, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("charioteer: error: SLO") and flag in err and "> 0" in err


def test_bad_search_space_errors():
    with pytest.raises(ValueError, match="max/N"):
        resolve_batch_cap("max/0", 8)
    with pytest.raises(ValueError, match="policies"):
        SearchSpace(policies=("fifo",))
    with pytest.raises(ValueError, match="devices"):
        SearchSpace(devices=0)


def test_hf_config_json_model_shape(tmp_path):
    llama = tmp_path / "smol" / "config.json"
    llama.parent.mkdir()
    llama.write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32", "vocab_size": 49152,
                                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                                 "max_position_embeddings": 8192, "hidden_act": "silu"}))
    shape = model_shape(str(llama.parent))
    assert (shape.name, shape.num_layers, shape.num_kv_heads, shape.mlp_matrices, shape.dtype_bytes) == ("smol", 30, 3, 3, 4)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}))
    shape = model_shape(str(gpt2))
    assert (shape.intermediate_size, shape.mlp_matrices, shape.max_position) == (3072, 2, 1024)
    gpt2.write_text(json.dumps({"n_embd": 768}))
    with pytest.raises(ValueError, match="lacks num_hidden_layers, num_attention_heads, vocab_size"):
        model_shape(str(gpt2))
