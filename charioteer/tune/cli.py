"""`charioteer tune`: measure this device and recommend SARATHI's chunk size for a workload."""
from __future__ import annotations

import json

from charioteer.bench.common import add_setup_args, model_dtype, prepare_device, progress_bar
from charioteer.config import CacheConfig, add_setting_args
from charioteer.scheduling.chunk_size import TimingTable, recommend_chunk_size, split_for_pd


def measure_table(setup, max_rows: int, seq_len: int, batch_size: int, repeats: int, progress=None) -> TimingTable:
    """Batch time for 1..max_rows prompt rows, and a decode-only batch of B at the workload's length."""
    from charioteer.bench.batch_timer import BatchShape
    from charioteer.bench.experiments import tile_sweep

    sweep = tile_sweep(setup, 1, max_rows, repeats, progress=progress)
    rows_ms = [p["ms"] for p in sweep["points"]]
    steps = [s["tokens"] for s in sweep["steps"]]
    decode = setup.timer.time(BatchShape(decodes=(seq_len,) * batch_size), repeats=repeats)
    c = setup.model.config
    return TimingTable(rows_ms, decode.total_s * 1e3, decode.ops_s["attention"] * 1e3 / batch_size, batch_size, steps,
                       num_layers=c.num_layers, hidden_size=c.hidden_size, context_len=seq_len)


def read_trace(path: str) -> tuple[float, float]:
    """Mean prompt and output length of a trace file (any format `charioteer.sim.traces` reads)."""
    from charioteer.sim.traces import read_trace as read_trace_file

    trace = read_trace_file(path)
    return float(trace.prompt_len.mean()), float(trace.decode_len.mean())


def check_args(args) -> None:
    """Refuse a bad command line before anything is measured."""
    if (args.pd_ratio is None) == (args.trace is None):
        raise ValueError("give exactly one of --pd-ratio R or --trace FILE")
    for flag, value in (("--max-rows", args.max_rows), ("--repeats", args.repeats), ("--max-seq-len", args.max_seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    largest = args.max_chunk_size or args.max_rows
    if not 1 <= args.min_chunk_size <= largest:
        raise ValueError(f"need 1 <= --min-chunk-size <= --max-chunk-size (or --max-rows), got {args.min_chunk_size}, "
                         f"{largest}")


def workload_lengths(args) -> tuple[float, float, int]:
    """Mean prompt and output length, and the sequence length L, from --trace or --pd-ratio with --max-seq-len."""
    if args.trace:
        prompt_len, decode_len = read_trace(args.trace)
        return prompt_len, decode_len, round(prompt_len + decode_len)
    prompt_len, decode_len = split_for_pd(args.max_seq_len, args.pd_ratio)
    return prompt_len, decode_len, args.max_seq_len


def timing_table(args, setup, seq_len: int, b: int) -> TimingTable:
    """--table as saved, or measured here at batch size b; saved to --save-table if given."""
    if args.table:
        with open(args.table) as f:
            table = TimingTable(**json.load(f))
    else:
        with progress_bar(args.max_rows, "measuring") as bar:
            table = measure_table(setup, args.max_rows, seq_len, b, args.repeats, bar)
    if table.batch_size != b:
        raise ValueError(f"the table was measured at B = {table.batch_size} and B here is {b}: pass --max-num-seqs "
                         f"{table.batch_size} (and enough --kv-cache-memory-gb)")
    if args.save_table:
        with open(args.save_table, "w") as f:
            json.dump(table.__dict__, f)
    return table


def cmd_tune(args) -> int:
    from charioteer.bench import experiments as ex
    from charioteer.memory.block_manager import batch_capacity, kv_bytes_per_token

    check_args(args)
    prompt_len, decode_len, seq_len = workload_lengths(args)
    roof = prepare_device(args)
    setup = ex.make_setup(args.model, args.device, roof, args.num_layers,
                          max_cached_tokens=seq_len * args.max_num_seqs + args.max_rows, quantization=args.quantization,
                          dtype=model_dtype(args))
    c = setup.model.config
    kv_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, setup.model.dtype.itemsize)
    weights = setup.model.weight_bytes
    kv_memory = CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb).memory_bytes
    from_memory = batch_capacity(kv_memory + weights, weights, seq_len, kv_token)
    b = max(1, min(from_memory, args.max_num_seqs))
    table = timing_table(args, setup, seq_len, b)
    rec = recommend_chunk_size(table, prompt_len, decode_len, args.min_chunk_size, args.max_chunk_size or args.max_rows)
    result = {
        "recommended_chunk_size": rec.chunk_size, "batch_capacity": b, "batch_capacity_from_memory": from_memory,
        "tile_size": table.tile_size, "steps": table.steps, "pd_ratio": round(prompt_len / decode_len, 3),
        "prompt_len": prompt_len, "decode_len": decode_len, "seq_len": seq_len,
        "balanced_chunk_size": round(rec.balanced_chunk_size, 1), "predicted_tok_s": rec.predicted_tok_s,
        "curve": rec.curve, "model": c.name, "device": args.device, "roofline": roof,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_recommendation(result, rec, table, c.name, from_memory)
    return 0


def print_recommendation(result: dict, rec, table: TimingTable, model: str, from_memory: int) -> None:
    prompt_len, decode_len, b = result["prompt_len"], result["decode_len"], result["batch_capacity"]
    best = rec.predicted_tok_s
    print(f"model {model}; P = {prompt_len:g}, D = {decode_len:g} (P:D {prompt_len / decode_len:.2f}); batch capacity "
          f"B = {b} (memory allows {from_memory}); tile: {table.tile_size or 'no step found'}")
    print(f"balanced C = (P/D)(B-1) = {rec.balanced_chunk_size:.1f}; recommended C = {rec.chunk_size} "
          f"(C + B - 1 = {rec.chunk_size + b - 1} rows), predicted {best:.1f} tokens/s")
    every = max(1, len(rec.curve) // 40)
    for point in rec.curve:
        if point["chunk_size"] % every and point["chunk_size"] != rec.chunk_size:
            continue
        bar = "#" * round(40 * point["predicted_tok_s"] / best)
        mark = "  <- recommended" if point["chunk_size"] == rec.chunk_size else ""
        print(f"C={point['chunk_size']:4d} {point['predicted_tok_s']:9.1f} tok/s {bar}{mark}")


def add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure the device and recommend SARATHI's chunk size for a workload",
                       description="Measure batch time for every row count up to --max-rows (finding any tile "
                                   "step), the batch capacity B from memory, and recommend the chunk size C with the "
                                   "best predicted throughput for the workload's P:D.")
    add_setup_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--pd-ratio", type=float, default=None, help="prompt tokens per output token")
    w.add_argument("--trace", default=None, help="a trace file (as `simulate --trace` reads: Azure or Vidur CSV, JSONL, "
                   "ShareGPT JSON) whose mean prompt and output lengths set the workload (instead of --pd-ratio)")
    w.add_argument("--max-seq-len", type=int, default=256, help="sequence length L with --pd-ratio (default: 256)")
    m = p.add_argument_group("capacity and search")
    add_setting_args(m, ["max_num_seqs", "kv_cache_memory_gb", "min_chunk_size", "max_chunk_size"], overrides={
        "max_num_seqs": dict(help="the batch cap B; B is the smaller of this and what --kv-cache-memory-gb holds "
                                  "at length L"),
        "kv_cache_memory_gb": dict(help="KV cache memory, GiB, that bounds B"),
        "min_chunk_size": dict(default=8, help="smallest C considered (default: 8)"),
        "max_chunk_size": dict(default=None, help="largest C considered (default: --max-rows)"),
    })
    m.add_argument("--max-rows", type=int, default=160, help="measure batches of 1..N rows (default: 160)")
    m.add_argument("--repeats", type=int, default=3, help="timed runs per point (default: 3)")
    m.add_argument("--table", default=None, help="use a table saved by --save-table instead of measuring")
    m.add_argument("--save-table", default=None, help="save the measured table as JSON")
    p.set_defaults(func=cmd_tune)
