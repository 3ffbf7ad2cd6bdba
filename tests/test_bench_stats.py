"""Measurements that survive noise: the statistics helpers (on synthetic samples, no timing) and the
roofline's rules (monkeypatched measurements, so no test waits on a real matmul)."""
import json

import pytest

from charioteer.bench import roofline as rl
from charioteer.bench.stats import (FASTER, SAME, SLOWER, Summary, cell, compare, interleaved, median, put, spread,
                                    verdict)

# ---- statistics ------------------------------------------------------------------------------


def test_median_and_spread():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert spread([3.0, 1.0, 2.0]) == (1.0, 3.0)
    s = Summary.of([5.0, 4.0, 6.0, 5.5])
    assert (s.median, s.lo, s.hi, s.n) == (5.25, 4.0, 6.0, 4)
    with pytest.raises(ValueError):
        median([])


def test_interleaved_runs_a_b_a_b_and_keeps_rounds_aligned():
    calls = []

    def run(name):
        def fn():
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"
        return fn

    out = interleaved([("a", run("a")), ("b", run("b")), ("c", run("c"))], repeats=3, warmup=1)
    assert calls == ["a", "b", "c"] * 4  # one warm-up round, then three kept rounds, never a a a
    assert out == {"a": ["a2", "a3", "a4"], "b": ["b2", "b3", "b4"], "c": ["c2", "c3", "c4"]}
    ticks = []
    interleaved({"x": lambda: 1, "y": lambda: 2}, repeats=2, after_each=lambda: ticks.append(1))
    assert len(ticks) == 4
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"x": lambda: 1}, repeats=0)


def test_verdict_needs_spreads_apart():
    fast, slow = [110.0, 112.0, 115.0], [100.0, 104.0, 108.0]
    v = verdict(fast, slow)
    assert v["verdict"] == FASTER and v["ratio"] == round(112 / 104, 3)
    assert v["ratio_spread"] == [round(110 / 108, 3), round(115 / 100, 3)] and v["ratio_spread"][0] > 1
    assert verdict(slow, fast)["verdict"] == SLOWER
    # A higher median is not a win when the spreads overlap.
    overlap = verdict([105.0, 112.0, 120.0], [100.0, 104.0, 108.0])
    assert overlap["ratio"] > 1 and overlap["verdict"] == SAME and overlap["ratio_spread"][0] < 1
    # One sample on a side has no spread: never distinguishable.
    assert verdict([200.0], [100.0])["verdict"] == SAME


def test_verdict_on_times_lower_is_better():
    v = verdict([2.0, 2.1, 2.2], [9.0, 9.5, 10.0], higher_is_better=False)  # A takes less time
    assert v["verdict"] == FASTER and v["ratio"] == round(9.5 / 2.1, 3)
    assert verdict([9.0, 9.5, 10.0], [2.0, 2.1, 2.2], higher_is_better=False)["verdict"] == SLOWER
    # A time whose spread reaches 0 or below (a noisy difference) leaves the ratio's top end open.
    noisy = verdict([-0.5, 1.0, 3.0], [9.0, 9.5, 10.0], higher_is_better=False)
    assert noisy["verdict"] == FASTER and noisy["ratio_spread"][1] is None


def test_put_compare_and_cell():
    row = {}
    put(row, "ms", [0.0101, 0.0123, 0.0099], scale=1e3)
    assert row == {"ms": 10.1, "ms_spread": [9.9, 12.3]}
    assert cell(row, "ms") == "10.1 [9.9, 12.3]"
    compare(row, "gain", [3.0, 3.1], [1.0, 1.1], verdict_name="vs_base")
    assert row["gain"] == round(3.05 / 1.05, 3) and row["vs_base"] == FASTER and "gain_spread" in row
    assert cell({"x": 2}, "x") == "2" and cell({}, "x") == "-"
    assert cell({"x": 4.0, "x_spread": [1.0, None]}, "x") == "4 [1, inf]"


# ---- the roofline ------------------------------------------------------------------------------


@pytest.fixture
def fake_machine(monkeypatch, tmp_path):
    """A roofline whose measurements are counted fakes (peak 100 GFLOP/s, 10 GB/s) and whose cache is private."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    machine = {"peak": 100e9, "bandwidth": 10e9, "peak_calls": 0, "bandwidth_calls": 0,
               "features": ["avx", "avx2", "fma"], "torch": "2.13.0"}

    def peak(device, dtype="float32", trials=rl.TRIALS):
        machine["peak_calls"] += 1
        return machine["peak"] * (0.5 if dtype == "bfloat16" else 1.0)

    def bandwidth(device, dtype="float32", trials=rl.TRIALS):
        machine["bandwidth_calls"] += 1
        return machine["bandwidth"]

    monkeypatch.setattr(rl, "measure_peak_matmul_flops", peak)
    monkeypatch.setattr(rl, "measure_memory_bandwidth", bandwidth)
    monkeypatch.setattr(rl, "cpu_features", lambda: list(machine["features"]))
    monkeypatch.setattr(rl, "torch_version", lambda: machine["torch"])
    return machine


def test_roofline_is_cached_with_what_it_depends_on(fake_machine, tmp_path):
    first = rl.roofline("cpu")
    assert fake_machine["peak_calls"] == 1 and not first["cached"]
    assert first["peak_matmul_gflops"] == 100.0 and first["ridge_flops_per_byte"] == 10.0
    ident = first["identity"]
    assert ident["features"] == ["avx", "avx2", "fma"] and ident["torch"] == "2.13.0" and ident["dtype"] == "float32"
    assert ident["threads"] >= 1 and ident["processor"]
    again = rl.roofline("cpu")
    assert again["cached"] and fake_machine["peak_calls"] == 1
    stored = json.loads((tmp_path / "charioteer" / "roofline.json").read_text())
    assert list(stored.values())[0]["identity"] == ident


def test_an_entry_stored_under_older_peak_rules_is_measured_again(fake_machine, monkeypatch):
    """A cache written before bf16 rates were kept from raising an fp32 peak may hold such a peak."""
    rl.roofline("cpu")
    monkeypatch.setattr(rl, "PEAK_RULES", rl.PEAK_RULES + 1)
    again = rl.roofline("cpu")
    assert fake_machine["peak_calls"] == 2 and not again["cached"]


def test_a_changed_cpu_feature_set_or_torch_version_is_measured_again(fake_machine, capsys):
    rl.roofline("cpu")
    fake_machine["features"] = ["avx", "avx2", "avx512f", "amx_tile", "fma"]  # the same name on a new machine
    fake_machine["peak"] = 300e9
    new = rl.roofline("cpu")
    assert fake_machine["peak_calls"] == 2 and new["peak_matmul_gflops"] == 300.0 and not new["cached"]
    assert "features" in capsys.readouterr().err  # says what changed
    fake_machine["torch"] = "2.14.0"
    rl.roofline("cpu")
    assert fake_machine["peak_calls"] == 3
    assert "torch 2.13.0 -> 2.14.0" in capsys.readouterr().err
    fake_machine["features"] = ["avx", "avx2", "fma"]
    fake_machine["torch"] = "2.13.0"
    assert rl.roofline("cpu")["cached"]  # the first machine's entry is still there
    assert fake_machine["peak_calls"] == 3


def test_a_tampered_entry_is_not_trusted(fake_machine, tmp_path):
    rl.roofline("cpu")
    path = tmp_path / "charioteer" / "roofline.json"
    cache = json.loads(path.read_text())
    for entry in cache.values():
        entry["identity"]["features"] = ["sse4_2"]  # the key says one thing, the entry another
    path.write_text(json.dumps(cache))
    assert not rl.roofline("cpu")["cached"] and fake_machine["peak_calls"] == 2


def test_each_dtype_has_its_own_entry(fake_machine):
    fp32 = rl.roofline("cpu")
    bf16 = rl.roofline("cpu", dtype="bfloat16")
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert bf16["peak_matmul_gflops"] == 50.0 and fake_machine["peak_calls"] == 2
    assert rl.roofline("cpu", dtype="bfloat16")["cached"] and rl.roofline("cpu")["cached"]
    with pytest.raises(ValueError, match="dtype"):
        rl.roofline("cpu", dtype="int3")


def test_bf16_entries_say_how_bf16_computes(fake_machine, monkeypatch):
    """Widened bf16 (fp32 matmuls on bf16 weights) and torch's bf16 ops have different peaks: a forced
    change of path is measured again."""
    from charioteer.model import cpu_kernels

    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "torch")
    assert rl.roofline("cpu", dtype="bfloat16")["identity"]["bf16_compute"] == "torch"
    monkeypatch.setenv("CHARIOTEER_BF16_COMPUTE", "widened")
    widened = rl.roofline("cpu", dtype="bfloat16")
    assert widened["identity"]["bf16_compute"] == ("widened" if cpu_kernels.available() else "torch")
    assert widened["cached"] == (not cpu_kernels.available())
    assert "bf16_compute" not in rl.roofline("cpu")["identity"]


def test_a_rate_above_the_peak_remeasures_and_mfu_stays_at_most_1(fake_machine, capsys):
    roof = rl.roofline("cpu")  # peak 100 GFLOP/s
    assert rl.mfu(roof, [(50e9, 1.0), (25e9, 1.0)]) == [0.5, 0.25] and fake_machine["peak_calls"] == 1
    # A run did 120 GFLOP in a second; a fresh measurement finds 150: that is the new peak.
    fake_machine["peak"] = 150e9
    values = rl.mfu(roof, [(120e9, 1.0), (30e9, 1.0)])
    assert fake_machine["peak_calls"] == 2 and roof["peak_matmul_gflops"] == 150.0
    assert values == [pytest.approx(0.8), pytest.approx(0.2)]
    assert "measuring the peak again" in capsys.readouterr().err
    stored = rl.roofline("cpu")
    assert stored["peak_matmul_gflops"] == 150.0 and stored["cached"]  # stored for the next command,
    assert "peak_raised_from_gflops" not in stored  # which did not raise it
    # A rate that beats even the fresh measurement becomes the peak itself.
    fake_machine["peak"] = 140e9
    values = rl.mfu(roof, [(180e9, 1.0), (90e9, 1.0)])
    assert fake_machine["peak_calls"] == 3 and roof["peak_matmul_gflops"] == 180.0
    assert max(values) <= 1 and values[0] == pytest.approx(1.0)
    assert roof["peak_raised_from_gflops"] == 150.0 and roof["ridge_flops_per_byte"] == 18.0  # raised from the re-measured 150
    assert "becomes the peak" in capsys.readouterr().err
    assert rl.mfu(None, [(1.0, 1.0)]) == [None]


def test_a_rate_far_above_a_fresh_peak_is_not_that_dtypes_and_gets_no_mfu(fake_machine, capsys):
    """A rate 1.7x a fresh measurement is another precision's work (or miscounted FLOPs): it must not
    become the peak, where it would make every later MFU of that dtype too low."""
    roof = rl.roofline("cpu")  # peak 100 GFLOP/s
    fake_machine["peak"] = 102e9
    values = rl.mfu(roof, [(170e9, 1.0), (51e9, 1.0)])
    assert fake_machine["peak_calls"] == 2 and roof["peak_matmul_gflops"] == 102.0
    assert values == [None, pytest.approx(0.5)]
    assert "not a float32 matmul rate" in capsys.readouterr().err
    stored = rl.roofline("cpu")
    assert stored["peak_matmul_gflops"] == 102.0 and "peak_raised_from_gflops" not in stored
    # within the factor, a rate above the fresh peak still becomes the peak
    fake_machine["peak"] = 100e9
    assert rl.mfu(roof, [(140e9, 1.0)]) == [pytest.approx(1.0)] and roof["peak_matmul_gflops"] == 140.0


def test_a_read_rate_above_the_bandwidth_remeasures_it_and_may_become_it(fake_machine, capsys):
    """The read bandwidth is held to observed read rates as the peak is to matmul rates (single-stream's
    fraction of its read limit never exceeds 1)."""
    roof = rl.roofline("cpu")  # 10 GB/s
    assert not rl.observe_bandwidth(roof, 9e9) and fake_machine["bandwidth_calls"] == 1
    fake_machine["bandwidth"] = 11e9
    assert rl.observe_bandwidth(roof, 12e9) and fake_machine["bandwidth_calls"] == 2
    assert roof["memory_bandwidth_gbs"] == 12.0 and roof["bandwidth_raised_from_gbs"] == 10.0
    assert roof["ridge_flops_per_byte"] == pytest.approx(100 / 12, abs=0.1)
    assert "becomes the read bandwidth" in capsys.readouterr().err
    stored = rl.roofline("cpu")
    assert stored["memory_bandwidth_gbs"] == 12.0 and "bandwidth_raised_from_gbs" not in stored
    assert stored["peak_matmul_gflops"] == 100.0  # the peak is not touched
    # 1.5x a fresh measurement or more is not a read rate of this machine's memory: the bandwidth stays measured
    assert rl.observe_bandwidth(roof, 30e9) and roof["memory_bandwidth_gbs"] == 12.0
    assert "not a float32 read rate" in capsys.readouterr().err


def test_the_last_level_cache_is_the_largest_size_linux_reports(tmp_path):
    """Sizes as sysfs writes them (K, M, G or bytes); a folder without them, or an unreadable size: 0."""
    for index, size in (("index0", "48K"), ("index2", "2048K\n"), ("index3", "491520K"), ("index4", "oops")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size)
    (tmp_path / "index5").mkdir()  # no size file
    assert rl.last_level_cache_bytes(str(tmp_path)) == 491520 * 1024
    assert rl.last_level_cache_bytes(str(tmp_path / "none")) == 0


def test_an_observed_rate_is_rounded_up_into_the_peak(fake_machine):
    roof = rl.roofline("cpu")
    fake_machine["peak"] = 90e9
    rate = 123.456789e9
    assert rl.mfu(roof, [(rate, 1.0)])[0] <= 1.0 and roof["peak_matmul_gflops"] * 1e9 >= rate
