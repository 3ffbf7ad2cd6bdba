"""Workloads and the `charioteer simulate` command."""
import json

import numpy as np
import pytest

from charioteer.cli import main
from charioteer.sim.workload import WorkloadSpec, make_workload, zipf_lengths


def test_zipf_lengths_and_pd_ratio():
    wl = make_workload(WorkloadSpec(num_requests=5000, min_len=1024, max_len=4096, theta=0.4, pd_ratio=10, seed=1))
    total = wl.prompt_len + wl.decode_len
    assert total.min() >= 1024 and total.max() <= 4096
    assert abs(wl.prompt_len.sum() / wl.decode_len.sum() - 10) < 0.1
    assert np.median(total) < (1024 + 4096) / 2  # zipf favours short requests
    assert (wl.arrival_s == 0).all()
    again = make_workload(WorkloadSpec(num_requests=5000, min_len=1024, max_len=4096, theta=0.4, pd_ratio=10, seed=1))
    assert (again.prompt_len == wl.prompt_len).all()
    flat = zipf_lengths(np.random.default_rng(0), 20000, 10, 19, 0.0)
    assert abs(np.bincount(flat - 10).std() / 2000) < 0.1  # theta 0 is uniform


def test_other_workloads(tmp_path):
    u = make_workload(WorkloadSpec(num_requests=100, lengths="uniform", min_len=10, max_len=20, pd_ratio=1, seed=0))
    assert ((u.prompt_len + u.decode_len) >= 10).all()
    f = make_workload(WorkloadSpec(num_requests=4, lengths="fixed", prompt_len=7, decode_len=3))
    assert list(f.prompt_len) == [7] * 4 and list(f.decode_len) == [3] * 4
    p = make_workload(WorkloadSpec(num_requests=200, arrivals="poisson", rate=10, seed=0))
    assert (np.diff(p.arrival_s) >= 0).all() and 10 < p.arrival_s[-1] < 30
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_len,decode_len,arrival_s\n5,2,1.0\n8,1,0.5\n")
    t = make_workload(WorkloadSpec(lengths="trace", arrivals="trace", trace=str(trace)))
    assert list(t.arrival_s) == [0.5, 1.0] and list(t.prompt_len) == [8, 5]
    with pytest.raises(ValueError, match="trace"):
        WorkloadSpec(lengths="trace")
    with pytest.raises(ValueError, match="min_len"):
        WorkloadSpec(min_len=10, max_len=5)


def test_simulate_cli_json(capsys, tmp_path):
    rc = main(["simulate", "--model", "llama-13b", "--hardware", "a6000", "--scheduler", "sarathi", "--scheduler", "orca",
               "--num-requests", "60", "--min-len", "256", "--max-len", "1024", "--tp", "2", "--pp", "2",
               "--json", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["scheduler"] for r in out["runs"]] == ["sarathi", "orca"]
    for r in out["runs"]:
        assert r["tp"] == 2 and r["pp"] == 2 and r["completion_time_s"] > 0 and 0 < r["mfu"] < 1
        assert len(r["stage_busy_pct"]) == 2
    assert (tmp_path / "report.md").exists() and (tmp_path / "summary.json").exists()


def test_paper_fig12_preset_small(capsys, tmp_path):
    rc = main(["simulate", "--preset", "paper-fig12", "--num-requests", "300", "--json", "--no-progress",
               "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["name"]: r for r in out["runs"]}
    assert set(runs) == {"orca-tp-pp", "tp-only", "sarathi-tp-pp"}
    assert runs["orca-tp-pp"]["batch_cap"] == 27 and runs["tp-only"]["batch_cap"] == 11
    assert runs["tp-only"]["replicas"] == 8 and runs["sarathi-tp-pp"]["pp"] == 8
    for key in ("completion_time_s", "median_bubble_s"):
        assert all(key in r for r in out["runs"])
    assert runs["sarathi-tp-pp"]["median_bubble_s"] < runs["orca-tp-pp"]["median_bubble_s"]
    assert "comparison" in out and "acceptance" in out["comparison"]
    assert (tmp_path / "report.md").read_text().startswith("# Charioteer simulation report")


def test_paper_fig12_sensitivity_moves_one_factor_at_a_time(capsys):
    from charioteer.sim.runner import FIG12_SENSITIVITY

    rc = main(["simulate", "--preset", "paper-fig12", "--sensitivity", "--num-requests", "60", "--json",
               "--no-progress"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["sensitivity"]
    assert [r["variant"] for r in rows] == [v.label for v in FIG12_SENSITIVITY]
    base, slow_hbm = rows[0]["completion_time_s"], rows[2]["completion_time_s"]
    # Halving HBM efficiency slows every deployment; decode-heavy TP-only the most.
    assert all(slow_hbm[k] > base[k] for k in base)
    assert slow_hbm["tp-only"] / base["tp-only"] > slow_hbm["sarathi-tp-pp"] / base["sarathi-tp-pp"]
    assert main(["simulate", "--sensitivity", "--no-progress"]) == 2
