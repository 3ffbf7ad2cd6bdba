"""Chunk-size selection: the throughput model on synthetic timing tables, adaptive C, `charioteer tune`."""
import json
import math

import pytest

from charioteer.bench.experiments import find_steps
from charioteer.cli import main
from charioteer.scheduling.adaptive_chunk import AdaptiveChunkSize
from charioteer.scheduling.chunk_size import TimingTable, predict_throughput, recommend_chunk_size


def table(fn, max_rows=200, decode_only_ms=40.0, batch_size=16, attention_ms=0.2) -> TimingTable:
    times = [fn(n) for n in range(1, max_rows + 1)]
    steps = [s["tokens"] for s in find_steps(list(range(1, max_rows + 1)), times)]
    return TimingTable(times, decode_only_ms, attention_ms, batch_size, steps)


def tiled(n):  # a GPU-like device: time goes up a whole tile of 64 rows at a time
    return 40.0 * math.ceil(n / 64) + 0.01 * n


def smooth(n):  # no steps: a fixed cost (reading the weights) plus a cost per row
    return 20.0 + 0.5 * n


def test_sharp_tile_step_is_found_and_chunks_fill_the_tile():
    t = table(tiled)
    assert t.tile_size == 64 and t.steps[:2] == [65, 129]
    # P:D 196:60 with B = 16: the balanced C is 49, and 49 + 15 fills one tile exactly.
    rec = recommend_chunk_size(t, 196, 60)
    assert rec.chunk_size == 49 and rec.chunk_size + 15 == 64
    assert rec.balanced_chunk_size == pytest.approx(49, abs=0.1)
    # One token more spills into a second tile and costs nearly twice as much per chunk.
    assert predict_throughput(t, 50, 196, 60) < 0.6 * predict_throughput(t, 49, 196, 60)
    # Prefill-heavy, P:D 240:8: 4 chunks of 60 carry the 2 decodes each that exist; 60 + 2 rows
    # still fit one tile, and fewer chunks would need a second tile per chunk.
    heavy = recommend_chunk_size(t, 240, 8)
    assert heavy.chunk_size == 60


def test_no_step_found_and_c_grows_with_pd():
    t = table(smooth)
    assert t.tile_size is None and t.steps == []
    chunks = [recommend_chunk_size(t, p, 256 - p, 8, 200).chunk_size for p in (128, 192, 232, 250)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]
    assert all(8 <= c <= 200 for c in chunks)


def test_predicted_time_counts_riding_and_leftover_decodes():
    t = TimingTable([10.0] * 100, decode_only_ms=8.0, decode_attention_ms=1.0, batch_size=5)
    # P = 100, D = 10, C = 50: 2 chunks carry min(4, 5) = 4 decodes each; 2 decodes are left for
    # decode-only batches of 5. Time: 2 * (10 + 4 * 1) + 2 / 5 * 8 = 31.2 ms for 110 tokens.
    assert predict_throughput(t, 50, 100, 10) == pytest.approx(110 / 31.2 * 1e3)
    with pytest.raises(ValueError, match="chunk_size"):
        predict_throughput(t, 0, 100, 10)


def _observe(a: AdaptiveChunkSize, prompt_len: int, output_len: int) -> None:
    a.observe(prompt_len, output_len)
    a.update()


def test_adaptive_chunk_size_follows_pd():
    a = AdaptiveChunkSize(batch_size=9, min_chunk=16, max_chunk=512)
    a.update([(200, 3)])
    assert a.chunk_size == 512  # before anything finished
    for _ in range(4):
        _observe(a, 200, 20)
    assert a.chunk_size == 80  # (200 / 20) * (9 - 1)
    for _ in range(10):  # the window (8) forgets the old requests
        _observe(a, 50, 50)
    assert a.chunk_size == 16  # (1 * 8) clamped to the minimum
    tiled_a = AdaptiveChunkSize(batch_size=9, min_chunk=16, max_chunk=512, tile_size=32)
    _observe(tiled_a, 200, 20)
    assert tiled_a.chunk_size == 88  # 80 + 8 rows = 88 -> 96 rows, a multiple of 32
    with_table = AdaptiveChunkSize(batch_size=16, min_chunk=8, max_chunk=200, table=table(tiled))
    _observe(with_table, 196, 60)
    assert with_table.chunk_size == 49
    with pytest.raises(ValueError, match="measured at batch size 16"):
        AdaptiveChunkSize(batch_size=8, min_chunk=8, max_chunk=200, table=table(tiled))


def test_adaptive_follows_running_requests_before_they_finish():
    a = AdaptiveChunkSize(batch_size=9, min_chunk=16, max_chunk=512)
    for _ in range(8):
        _observe(a, 240, 6)
    assert a.chunk_size == 320  # P:D 40
    # New requests with shorter prompts that have produced fewer tokens than the mean so far: only
    # their prompt lengths count, their outputs are taken as the mean (6).
    a.update([(120, 2)] * 8)
    assert a.chunk_size == 240  # P 180, D 6
    # Once they pass the finished mean, their outputs so far are lower bounds that raise D.
    a.update([(120, 30)] * 8)
    assert a.chunk_size == 80  # P 180, D (8*6 + 8*30)/16 = 18


def test_auto_chunk_size_keeps_outputs_exact(default_model):
    from charioteer import LLM, SamplingParams
    from texts import PASSAGE

    words = PASSAGE.split()
    prompts = [" ".join(words[: 20 + 30 * i]) for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0)
    fixed = LLM(default_model, chunk_size=7, max_num_seqs=3).generate(prompts, params)
    llm = LLM(default_model, chunk_size="auto", min_chunk_size=4, max_chunk_size=64, max_num_seqs=3)
    auto = llm.generate(prompts, params)
    assert llm.engine.scheduler.adaptive.history  # C did change during the run
    assert [o.outputs[0].token_ids for o in auto] == [o.outputs[0].token_ids for o in fixed]


def test_auto_chunk_size_is_sarathi_only():
    from charioteer.config import SchedulerConfig

    with pytest.raises(ValueError, match="sarathi"):
        SchedulerConfig(policy="orca", chunk_size="auto")
    with pytest.raises(ValueError, match="'auto'"):
        SchedulerConfig(chunk_size="big")


def test_tune_cli_json_and_saved_table(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    saved = tmp_path / "table.json"
    rc = main(["tune", "--model", "synthetic:tiny", "--pd-ratio", "10", "--max-seq-len", "64", "--max-num-seqs", "4",
               "--max-rows", "24", "--repeats", "1", "--json", "--save-table", str(saved)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"recommended_chunk_size", "batch_capacity", "tile_size", "curve"} <= set(out)
    assert out["batch_capacity"] == 4 and 8 <= out["recommended_chunk_size"] <= 24
    assert (out["prompt_len"], out["decode_len"]) == (58, 6)
    trace = tmp_path / "trace.csv"
    trace.write_text("prompt_len,decode_len\n50,5\n70,15\n")
    rc = main(["tune", "--model", "synthetic:tiny", "--trace", str(trace), "--max-num-seqs", "4", "--max-rows", "24",
               "--table", str(saved), "--json"])
    assert rc == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["prompt_len"], again["decode_len"]) == (60, 10)
    assert main(["tune", "--model", "synthetic:tiny", "--max-rows", "8"]) == 2  # neither --pd-ratio nor --trace
    assert "exactly one" in capsys.readouterr().err


def test_bench_adaptive_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rc = main(["bench", "adaptive", "--model", "synthetic:tiny", "--pd-ratios", "8,1", "--chunk-sizes", "8,32",
               "--max-num-seqs", "4", "--seq-len", "48", "--num-requests", "8", "--tile-size", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["chunk_size"] for r in out["runs"]] == ["auto", 8, 32]
    auto = out["runs"][0]["phases"]
    assert [p["prompt_len"] for p in auto] == [43, 24]
    assert auto[0]["chunk_size_last"] != auto[1]["chunk_size_last"]  # C moved with the P:D shift
    assert [c["phase"] for c in out["phase_checks"]] == [0, 1] and out["auto_over_worst"] > 0


def test_tile_is_the_largest_step_not_the_first():
    def kernel_blocks(n):  # small steps at 3 and 5 rows, a big one past 64
        return 10.0 + (1.5 if n > 2 else 0) + (1.5 if n > 4 else 0) + (12.0 if n > 64 else 0) + 0.01 * n
    t = table(kernel_blocks, max_rows=100)
    assert t.steps == [3, 5, 65] and t.tile_size == 64
