"""`charioteer bench serve` / `bench capacity`: arrivals, datasets, and a real run on loopback."""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import pytest

from charioteer.bench.cli import add_bench_parser
from charioteer.bench.serve import arrival_offsets, load_sharegpt, synthetic_requests


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="charioteer")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie is gone too (it no longer runs); Popen.wait() reaps it, so this is just belt and braces
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ---- arrivals -----------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_mean_gap_is_one_over_rate(burstiness):
    rate = 5.0
    t = arrival_offsets(20001, rate, burstiness, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / rate) < 0.03 / rate
    # gamma with shape k: coefficient of variation 1/sqrt(k) (1 = exponential, Poisson arrivals)
    assert abs(gaps.std() / gaps.mean() - 1 / math.sqrt(burstiness)) < 0.05


def test_arrivals_reproducible_and_inf():
    a, b = arrival_offsets(100, 3.0, 1.0, seed=7), arrival_offsets(100, 3.0, 1.0, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrival_offsets(100, 3.0, 1.0, seed=8))
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))
    for bad in [dict(rate=0.0), dict(rate=-1.0), dict(rate=1.0, burstiness=0.0)]:
        with pytest.raises(ValueError):
            arrival_offsets(3, **bad)


def test_synthetic_lengths():
    reqs = synthetic_requests(200, input_len=64, output_len=8, input_dist="uniform", seed=3)
    assert all(32 <= r.prompt_len <= 96 and len(r.prompt) == r.prompt_len and r.output_len == 8 for r in reqs)
    z = synthetic_requests(500, input_len=64, input_dist="zipf", input_min=10, input_max=200, seed=3)
    lens = np.array([r.prompt_len for r in z])
    assert lens.min() >= 10 and lens.max() <= 200 and np.median(lens) < lens.mean()  # heavy right tail
    assert [r.prompt for r in synthetic_requests(5, seed=1)] == [r.prompt for r in synthetic_requests(5, seed=1)]


def test_sharegpt_parse(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "Tell me a story about a cat."},
                           {"from": "gpt", "value": "Once upon a time there was a cat who liked milk a lot."}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model: skipped"},
                           {"from": "human", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "no reply: skipped"}]},
        {"id": "no conversations"},
        {"conversations": [{"from": "human", "value": "Name three colors."}, {"from": "gpt", "value": "Red."}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = load_sharegpt(str(path), shuffle=False)
    assert [r.prompt for r in reqs] == ["Tell me a story about a cat.", "Name three colors."]
    assert reqs[0].output_len > reqs[1].output_len >= 1
    assert [r.output_len for r in load_sharegpt(str(path), output_len=5)] == [5, 5]
    assert len(load_sharegpt(str(path), n=5)) == 5  # cycles through the file
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError):
        load_sharegpt(str(bad))


# ---- a real server ------------------------------------------------------------------------


def test_bench_serve_starts_and_stops_a_server(capsys, tmp_path):
    t0 = time.monotonic()
    rc = bench(["bench", "serve", "--num-prompts", "8", "--input-len", "32", "--output-len", "8",
                "--ignore-eos", "--request-rate", "20", "--max-concurrency", "6", "--json", "--no-progress",
                "--out", str(tmp_path / "out")])
    assert rc == 0
    m = json.loads(capsys.readouterr().out)
    assert m["successful_requests"] == 8 and m["failed_requests"] == 0
    assert m["total_output_tokens"] == 64  # ignore_eos: every request generates max_tokens
    assert 0 < m["duration_s"] < time.monotonic() - t0
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (m[f"{k}_{name}_ms"] for k in ("mean", "median", "p99"))
        assert 0 < median <= p99 and 0 < mean <= p99 + 1e-9, name
    assert m["p99_ttft_ms"] <= m["p99_e2el_ms"]
    assert m["mean_ttft_ms"] < m["mean_e2el_ms"]
    assert _gone(m["server_pid"])
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved["requests"]) == 8 and saved["successful_requests"] == 8
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert (tmp_path / "out" / f"cdf_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_capacity_reuses_one_server(capsys):
    rc = bench(["bench", "capacity", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                "--slo-tbt-ms", "60000", "--start-rate", "4", "--max-rate", "8", "--json", "--no-progress"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["capacity_rps"] == 8 and r["upper_bound_rps"] is None  # a loose SLO: the max rate passes
    assert [p["rate"] for p in r["probes"]] == [4, 8] and all(p["passed"] for p in r["probes"])
    assert _gone(r["server_pid"])


def test_bench_serve_kills_the_server_on_error(monkeypatch):
    import charioteer.bench.serve as serve

    pids = []
    real_start = serve.ServerProcess.start

    def start(self):
        out = real_start(self)
        pids.append(self.pid)
        return out

    def boom(*a, **k):
        raise RuntimeError("client blew up")

    monkeypatch.setattr(serve.ServerProcess, "start", start)
    monkeypatch.setattr(serve, "run_requests", boom)
    with pytest.raises(RuntimeError, match="client blew up"):
        bench(["bench", "serve", "--num-prompts", "2", "--output-len", "2", "--no-progress"])
    assert pids and _gone(pids[0])
