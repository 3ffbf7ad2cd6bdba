"""A cost model profiled on the real engine, and `charioteer simulate --validate`.

`StepCostModel` prices a batch as a sum of per-operation terms whose coefficients come from
timing the real engine (this CPU), like the paper's simulator (profile, then fit a regression):

    t = c_batch                                   fixed per step: scheduling, sampling, Python
      + c_prefill_step * (1 if any prefill)       the op-by-op layer loop a step with a prompt chunk
                                                  runs; decode-only steps run every layer in one
                                                  C++ call with the CPU kernels, without it
      + c_prefill_entry * prefill entries         per chunk: its attention call, its LM head row
      + c_prefill_token * prefill tokens          linear layers (QKV, O, MLP) per prompt token
      + c_decode_row * decodes                    per decode: its GEMM rows (weights already
                                                  streaming), LM head row, sampling
      + c_small   * min(tokens, 64)               extra per token in batches of up to 64 rows, which
                                                  run on the panel GEMM or MKL's packed GEMM, with a
                                                  different per-row cost from plain GEMM above 64
      + c_prefill * sum over prefill entries of c * (k + (c + 1) / 2)   causal attention work
      + c_decode  * sum over decodes of context   decode attention (K/V reads)

The coefficients are fitted by non-negative least squares on *calibration* runs (a different
workload and seed from the validation run) and can be saved as a JSON table.

`validate()` then runs a validation workload through the real engine three times, alternating with
the calibration runs (timing every step and recording its plan; a batch's time is its median over
the runs), runs the simulator with the profiled model on the same workload, and reports
the per-batch mean absolute percentage error and the whole run's completion-time error.
"""
from __future__ import annotations

import json
import time

import numpy as np

from charioteer.sim.cost import CostModel

FEATURES = ("batch", "prefill_step", "prefill_entries", "prefill_tokens", "decodes", "small_batch_tokens",
            "prefill_attention", "decode_context")
STEP_COST_KIND = "charioteer-profiled-cost"  # the JSON tables' "kind": a step cost table, not a `tune` one
SPREAD_CLASSES = ("prompt", "decode")  # steps that run a prompt chunk; decode-only steps
SPREAD_QUANTILES = 41
SMALL_BATCH_ROWS = 64  # charioteer.model.llama.PACKED_GEMM_MAX_ROWS (not imported: the simulator stays torch-free)


def plan_features(plan) -> list[float]:
    prefill_entries = prefill_tokens = decodes = dec = 0
    pre = 0.0
    for num, start, is_prefill in plan:
        if is_prefill:
            prefill_entries += 1
            prefill_tokens += num
            pre += num * (start + (num + 1) / 2)
        else:
            decodes += num
            dec += start + num
    tokens = prefill_tokens + decodes
    return [1.0, float(prefill_entries > 0), float(prefill_entries), float(prefill_tokens), float(decodes),
            float(min(tokens, SMALL_BATCH_ROWS)), pre, float(dec)]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping negative coefficients and refitting (few features)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active = [i for i, v in zip(active, sol) if v > 0] if (sol > 0).any() else []
    return x


class StepCostModel(CostModel):
    """Prices a batch by the fitted step cost (the formula above).

    With `spread` (what `fit` measured: quantiles of measured / fitted time, for steps with a prompt chunk
    and for decode-only steps), `batch_cost` multiplies each batch by a ratio drawn from those (seeded), so
    the simulated p99s carry the step-to-step variation the real engine has; `predict` stays the fit.
    """

    def __init__(self, coefs: dict[str, float], num_stages: int = 1, source: str = "",
                 spread: dict[str, list[float]] | None = None, seed: int = 0) -> None:
        missing = set(FEATURES) - coefs.keys()
        if missing:
            raise ValueError(f"profiled cost table lacks {', '.join(sorted(missing))}")
        self.coefs = {k: float(coefs[k]) for k in FEATURES}
        self._c = [self.coefs[k] for k in FEATURES]
        self.num_stages = num_stages
        self.source = source
        self.spread = spread
        if spread is not None:
            if set(spread) != set(SPREAD_CLASSES) or any(len(q) < 2 for q in spread.values()):
                raise ValueError(f"a step cost table's spread needs quantile lists for {', '.join(SPREAD_CLASSES)}")
            self._spread = [np.asarray(spread[k], dtype=float) for k in SPREAD_CLASSES]
            self._rng = np.random.default_rng(seed)

    @classmethod
    def fit(cls, records: list[tuple[list, float]], num_stages: int = 1) -> "StepCostModel":
        if len(records) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} timed batches to fit, got {len(records)}")
        a = np.array([plan_features(p) for p, _ in records])
        b = np.array([t for _, t in records])
        # Relative error matters (batches span 100x in time): weight rows by 1 / t.
        w = 1.0 / np.maximum(b, 1e-6)
        x = nnls(a * w[:, None], b * w)
        ratio = b / np.maximum(a @ x, 1e-9)
        with_prompt = a[:, 1] > 0
        spread = {}
        for name, rows in zip(SPREAD_CLASSES, (with_prompt, ~with_prompt)):
            values = ratio[rows] if rows.any() else np.ones(1)
            spread[name] = np.quantile(values, np.linspace(0, 1, SPREAD_QUANTILES)).round(4).tolist()
        return cls(dict(zip(FEATURES, x)), num_stages, source="fit", spread=spread)

    def without_spread(self) -> "StepCostModel":
        return StepCostModel(self.coefs, self.num_stages, self.source)

    def predict(self, plan) -> float:
        return float(np.dot(self._c, plan_features(plan)))

    def batch_cost(self, plan):
        f = plan_features(plan)
        t = sum(c * v for c, v in zip(self._c, f))
        if self.spread is not None:
            q = self._spread[0 if f[1] else 1]
            t *= float(np.interp(self._rng.random(), np.linspace(0, 1, len(q)), q))
        return [t / self.num_stages] * self.num_stages, 0.0, 0.0

    def to_json(self) -> str:
        return json.dumps({"kind": STEP_COST_KIND, "features": list(FEATURES), "coefs": self.coefs,
                           "spread": self.spread}, indent=2)

    @classmethod
    def from_json(cls, text: str, num_stages: int = 1) -> "StepCostModel":
        return cls.from_dict(json.loads(text), num_stages)

    @classmethod
    def from_dict(cls, data: dict, num_stages: int = 1) -> "StepCostModel":
        if data.get("kind") != STEP_COST_KIND:
            raise ValueError(f"not a step cost table (kind {data.get('kind')!r}, expected {STEP_COST_KIND!r})")
        return cls(data["coefs"], num_stages, source="table", spread=data.get("spread"))


# ---- driving the real engine ---------------------------------------------------------------------

VALIDATION_MODEL = "synthetic:vocab=1024,hidden=512,intermediate=1376,layers=4,heads=8,context=2048"


def run_engine(workload, policy: str, batch_cap: int, chunk_size: int, model: str = VALIDATION_MODEL, seed: int = 0):
    """Run `workload` through the real engine on this CPU; return ([(plan, step seconds)], total seconds).

    Seconds are CPU seconds of the calling thread (see below)."""
    import torch

    from charioteer.config import EngineArgs
    from charioteer.engine.llm_engine import LLMEngine
    from charioteer.memory.block_manager import cdiv
    from charioteer.request import SamplingParams

    torch.set_num_threads(1)  # steadier timings on a shared machine
    max_len = int((workload.prompt_len + workload.decode_len).max())
    engine = LLMEngine(EngineArgs(model=model, scheduler=policy, max_num_seqs=batch_cap, chunk_size=chunk_size,
                                  kv_policy="reserve", num_kv_blocks=batch_cap * cdiv(max_len, 16), seed=seed))
    steps = []
    engine.subscribe(steps.append)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    # Warm-up on this engine: touch every KV block once (first-touch page faults would otherwise land
    # in the measured batches) and let the allocator settle.
    for i in range(batch_cap):
        engine.add_request(rng.integers(0, vocab, max_len - 2).tolist(),
                           SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), request_id=f"warm{i}")
    while engine.has_unfinished_requests():
        engine.step()
    steps.clear()
    for i in range(len(workload)):
        ids = rng.integers(0, vocab, int(workload.prompt_len[i])).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=int(workload.decode_len[i]), ignore_eos=True,
                                               temperature=0.0), request_id=str(i))
    # Times are this thread's CPU time (torch runs single-threaded here, in this thread): on an idle
    # machine that is the wall time, and on a shared one it leaves out time spent descheduled.
    t0 = time.thread_time()
    while engine.has_unfinished_requests():
        engine.step()
    return [(step.plan(), step.cpu_s) for step in steps], time.thread_time() - t0


def validate(policy: str = "sarathi", batch_cap: int = 8, chunk_size: int = 64, num_requests: int = 24,
             seed: int = 1, repeats: int = 3) -> dict:
    from charioteer.sim.simulator import ReplicaSetup, Simulator
    from charioteer.sim.specs import ClusterConfig
    from charioteer.sim.workload import WorkloadSpec, make_workload

    def wl(n, s, lo, hi):
        return make_workload(WorkloadSpec(num_requests=n, lengths="zipf", min_len=lo, max_len=hi, theta=0.4,
                                          pd_ratio=10.0, seed=s))

    workload = wl(num_requests, seed, 64, 512)
    # This machine's speed drifts by tens of percent over tens of seconds, so calibration and validation
    # runs alternate (drift reaches both alike), and the validation workload, whose batch sequence is
    # deterministic, runs `repeats` times: each batch's time is its median over the runs.
    calibration_workloads = [(pol, wl(num_requests // 2, s, 32, 640))
                             for pol, s in (("request-level", seed + 100), ("sarathi", seed + 200), ("orca", seed + 300))]
    calibration = []
    runs = []
    for _ in range(repeats):
        for pol, cal in calibration_workloads:
            calibration += run_engine(cal, pol, batch_cap, chunk_size)[0]
        runs.append(run_engine(workload, policy, batch_cap, chunk_size))
    model = StepCostModel.fit(calibration)
    plans = [p for p, _ in runs[0][0]]
    if any([p for p, _ in r] != plans for r, _ in runs[1:]):
        raise RuntimeError("the engine issued different batch sequences for the same workload")
    step_times = np.median(np.array([[t for _, t in r] for r, _ in runs]), axis=0)
    records = list(zip(plans, step_times.tolist()))
    measured_total = float(np.median([total for _, total in runs]))
    errors = [abs(model.predict(p) - t) / t for p, t in records]
    max_len = int((workload.prompt_len + workload.decode_len).max())
    sim = Simulator(ReplicaSetup(policy, batch_cap, max_len, chunk_size=chunk_size), ClusterConfig(), model.without_spread(),
                    trace_batches=True)
    result = sim.run(workload)
    same_batches = [[(n, s) for n, s, _ in p] for p, _ in records] == [[(n, s) for _, s, n in b] for _, b in result.batches]
    return {
        "policy": policy,
        "batch_cap": batch_cap,
        "chunk_size": chunk_size,
        "num_requests": num_requests,
        "calibration_batches": len(calibration),
        "validation_batches": len(records),
        "validation_runs": repeats,
        "coefs": model.coefs,
        "per_batch_mape": float(np.mean(errors)),
        "measured_completion_s": measured_total,
        "simulated_completion_s": result.makespan_s,
        "completion_error": abs(result.makespan_s - measured_total) / measured_total,
        "same_batch_sequence": same_batches,
    }
