"""What the measuring commands share (`profile`, `tune`, `bench decode-speedup|e2e|...|adaptive|peers`):
setup flags, device and roofline, the model to measure, progress bars and tables."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from charioteer.bench import experiments as ex
from charioteer.bench.stats import cell
from charioteer.config import add_setting_args, check_settings


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """argparse type: comma-separated positive numbers."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def choices(text: str, allowed, flag: str) -> list[str]:
    """A comma-separated subset of `allowed`; ValueError naming `flag` for an unknown or empty one."""
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in chosen if v not in allowed]
    if bad or not chosen:
        raise ValueError(f"{flag}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(allowed)}")
    return chosen


# A benchmark's precision names and the engine settings each means: int8 is weight-only, with fp32
# activations and KV; gguf runs the GGUF file's own blocks, with fp32 activations and KV
# (`bench single-stream --formats`, `bench peers --dtypes`).
PRECISION_SETTINGS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
                      "int8": {"dtype": "float32", "quantization": "int8"},
                      "gguf": {"dtype": "float32", "quantization": "gguf"}}


def peak_dtype(dtype: str, quantization: str | None = None, device: str = "cpu") -> str:
    """The dtype whose measured matmul peak bounds a model's GEMMs (the roofline MFU is taken against):
    int8 weights multiply in fp32 on the panel kernel, but at bf16's rate where they run on a tile kernel
    (AMX's int8 tiles, two products per k-step of int16 activations; AVX512-BF16)."""
    from charioteer.model import cpu_kernels

    if device == "cpu" and quantization == "int8" and dtype == "float32" and cpu_kernels.int8_tile_kernel():
        return "bfloat16"
    return dtype


def add_setup_args(p: argparse.ArgumentParser) -> None:
    """--model, --num-layers, --device, --dtype, --quantization (engine settings), --threads, --refresh-roofline,
    --json."""
    g = p.add_argument_group("setup")
    add_setting_args(g, ["model", "num_layers", "device", "dtype", "quantization"], overrides={"model": dict(
        help=f"model to measure (default: {ex.DEFAULT_BENCH_MODEL}, one LLaMA-7B layer); any --model of "
             "`charioteer generate`, e.g. smollm2-135m")})
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    g.add_argument("--refresh-roofline", action="store_true", help="measure the roofline again instead of the cached one")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_engine_bench_args(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """The setup flags of a bench that runs whole engines: --model, --num-layers, --device, --dtype and
    --quantization (unless the bench sets the precision itself), --threads, --json."""
    g = p.add_argument_group("setup")
    add_setting_args(g, ["model", "num_layers", "device"] + (["dtype", "quantization"] if precision else []))
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def load_engine_bench(args):
    """Check the settings and --repeats, apply --threads and load --model (shared by every engine
    the bench builds)."""
    check_settings(args)
    check_repeats(args.repeats)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from charioteer.model.loader import load_model

    return load_model(args.model, num_layers=args.num_layers)


def prepare_device(args) -> dict:
    """Check the settings, apply --threads, check --device, and return the device's roofline in --dtype (auto
    resolved for this device; printed on stderr)."""
    check_settings(args)
    import torch

    from charioteer.bench.roofline import describe, roofline

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda given but torch sees no CUDA device here; use --device cpu")
    dtype = model_dtype(args)
    roof = roofline(args.device, refresh=args.refresh_roofline, dtype=peak_dtype(dtype, args.quantization, args.device))
    print(describe(roof), file=sys.stderr)
    return roof


def model_dtype(args) -> str:
    """--dtype, with auto resolved for --device."""
    import torch

    from charioteer.model.precision import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(args.dtype, torch.device(args.device)))


def load_setup(args, roof: dict, max_cached_tokens: int = 32768) -> ex.Setup:
    """The model to measure (--model, --num-layers, --device), described on stderr."""
    dtype = model_dtype(args)
    setup = ex.make_setup(args.model, args.device, roof, args.num_layers, max_cached_tokens,
                          quantization=args.quantization, dtype=dtype)
    c = setup.model.config
    print(f"model: {c.name}, {c.num_layers} layers, hidden {c.hidden_size}, ffn {c.intermediate_size}, "
          f"vocab {c.vocab_size}, {args.device}, {dtype}{' int8' * bool(args.quantization)}, "
          f"{ex.threads()} threads", file=sys.stderr)
    return setup


@contextlib.contextmanager
def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def run_meta(args, setup: ex.Setup, roof: dict) -> dict:
    c = setup.model.config
    return {"model": c.name, "layers": c.num_layers, "hidden_size": c.hidden_size, "device": args.device,
            "threads": ex.threads(), "roofline": roof}


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table; a column with a spread (`x_spread` in the row) prints as "median [min, max]"."""
    cells = [[cell(r, col) for col in columns] for r in rows]
    widths = [max([len(col)] + [len(row[i]) for row in cells]) for i, col in enumerate(columns)]
    lines = ["  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def check_repeats(repeats: int | None, flag: str = "--repeats") -> None:
    """Refuse fewer than two repetitions: one sample has no spread, and every number here has one."""
    if repeats is not None and repeats < 2:
        raise ValueError(f"{flag} must be >= 2 (one sample has no spread), got {repeats}")


def emit(args, result: dict, text: str) -> None:
    """The result as one JSON object with --json, else the text."""
    print(json.dumps(result) if args.json else text)
