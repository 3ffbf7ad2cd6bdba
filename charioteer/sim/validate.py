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
      + c_large * max(tokens - R, 0)              extra per row past R: up to R rows (the engine's
                                                  Kernels.small_batch_rows) the linear layers run the
                                                  panel or packed GEMM, above it one plain GEMM, which
                                                  costs more per row here (on AVX2 15-35 % more per
                                                  prompt token on VALIDATION_MODEL)
      + c_large_step * (1 if tokens > R)          ... and a fixed cost more: MKL's plain GEMM packs
                                                  each weight on every call (17 ms a step for the fp32
                                                  validation model on AVX-512, where R is 64 and
                                                  SARATHI's C = 64 batches of 64-71 rows straddle it)
      + c_widen * (1 if tokens > W)               bf16 or int8 weights: a batch of more than one
                                                  row block (W, the engine's Kernels.widen_rows)
                                                  widens each weight slice once into L1 first
      + c_prefill * sum over prefill entries of c * (k + (c + 1) / 2)   causal attention work
      + c_decode  * sum over decodes of context   decode attention (K/V reads)
      + c_after   * d ** s                        s steps after a batch of more than R rows (1: the
                                                  next one; 0 before any): that batch ran the other
                                                  copy of the weights (MKL's or oneDNN's), which pushed
                                                  this path's copy out of the last-level cache, and
                                                  the next steps read it from memory until it is back.
                                                  On the Xeon here 8-row decode steps after a prefill
                                                  ran 18, 17, 16, ... ms against 15 (bf16 validation
                                                  model); d comes from DECAYS, whichever fits best

The coefficients are fitted by non-negative least squares on *calibration* runs (other workloads
and seeds than the validation run) and can be saved as a JSON table, with R, W and d. The history
term makes the price depend on the batches before: the simulator keeps one per replica
(`for_replica`), and `predict_sequence` prices a run's batches in order.

`validate()` then runs a validation workload through the real engine under each policy, `repeats`
times, interleaved with the calibration runs (timing every step and recording its plan; a batch's
time is its median over the runs), runs the simulator with the profiled model on the same workload,
and reports per policy the per-batch mean absolute percentage error and the completion-time error.
"""
from __future__ import annotations

import json
import time

import numpy as np

from charioteer.engine.least_squares import nnls
from charioteer.sim.cost import CostModel

FEATURES = ("batch", "prefill_step", "prefill_entries", "prefill_tokens", "decodes", "large_batch_tokens",
            "large_batch", "widen_pass", "prefill_attention", "decode_context", "after_large")
DECAYS = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9)  # the after_large term's decay per step, tried in the fit (0: no term)
STEP_COST_KIND = "charioteer-profiled-cost"  # the JSON tables' "kind": a step cost table, not a `tune` one
SPREAD_CLASSES = ("prompt", "decode")  # steps that run a prompt chunk; decode-only steps
SPREAD_QUANTILES = 41


def plan_tokens(plan) -> int:
    return sum(num for num, _, _ in plan)


def plan_features(plan, small_batch_rows: int, widen_rows: int = 0, after_large: float = 0.0) -> list[float]:
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
            float(max(tokens - small_batch_rows, 0)), float(tokens > small_batch_rows), float(0 < widen_rows < tokens),
            pre, float(dec), after_large]


def _after_large(since: int | None, decay: float) -> float:
    """The after_large feature s steps (`since`) after a batch above R (None: none yet)."""
    return decay ** since if since is not None and decay > 0 else 0.0


def _steps_after(plan, since: int | None, small_batch_rows: int) -> int | None:
    """`since` for the batch after `plan`."""
    return 1 if plan_tokens(plan) > small_batch_rows else (since + 1 if since is not None else None)


def after_large_values(plans, small_batch_rows: int, decay: float, run_starts=(0,)) -> list[float]:
    """The after_large feature of each batch of a sequence (see the module docstring): decay ** s, s the
    steps since the last batch of more than small_batch_rows rows; 0 before any and from each run start."""
    values, since = [], None
    for i, plan in enumerate(plans):
        if i in run_starts:
            since = None
        values.append(_after_large(since, decay))
        since = _steps_after(plan, since, small_batch_rows)
    return values


class StepCostModel(CostModel):
    """Prices a batch by the fitted step cost (the formula above).

    With `spread` (what `fit` measured: quantiles of measured / fitted time, for steps with a prompt chunk
    and for decode-only steps), `batch_cost` multiplies each batch by a ratio drawn from those (seeded), so
    the simulated p99s carry the step-to-step variation the real engine has; `predict` stays the fit.
    `batch_cost` also keeps the after_large history of the batches it priced.
    """

    def __init__(self, coefs: dict[str, float], small_batch_rows: int, widen_rows: int = 0, num_stages: int = 1,
                 source: str = "", spread: dict[str, list[float]] | None = None, seed: int = 0,
                 decay: float = 0.0) -> None:
        missing = set(FEATURES) - coefs.keys()
        if missing:
            raise ValueError(f"profiled cost table lacks {', '.join(sorted(missing))} (a table from before they "
                             f"existed: measure it again)")
        for name, rows in (("small_batch_rows", small_batch_rows), ("widen_rows", widen_rows)):
            if not (isinstance(rows, int) and rows >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {rows!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.coefs = {k: float(coefs[k]) for k in FEATURES}
        self._c = [self.coefs[k] for k in FEATURES]
        self.small_batch_rows, self.widen_rows, self.decay = small_batch_rows, widen_rows, float(decay)
        self.num_stages = num_stages
        self.source = source
        self.spread = spread
        self._since_large = None  # steps since the last batch priced by batch_cost was above small_batch_rows
        if spread is not None:
            if set(spread) != set(SPREAD_CLASSES) or any(len(q) < 2 for q in spread.values()):
                raise ValueError(f"a step cost table's spread needs quantile lists for {', '.join(SPREAD_CLASSES)}")
            self._spread = [np.asarray(spread[k], dtype=float) for k in SPREAD_CLASSES]
            self._rng = np.random.default_rng(seed)

    @classmethod
    def fit(cls, records: list[tuple[list, float]], small_batch_rows: int, widen_rows: int = 0,
            num_stages: int = 1, run_starts=(0,)) -> "StepCostModel":
        """Fit on timed batches in the order they ran; `run_starts`: the indices where a new run begins."""
        if len(records) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} timed batches to fit, got {len(records)}")
        plans, b = [p for p, _ in records], np.array([t for _, t in records])
        # Batches span 100x in time: weighting rows by 1 / t would fit relative errors, by 1 absolute ones.
        # 1 / sqrt(t) keeps the few long prompt batches, most of request-level's time, from being fitted
        # a few % short as a group (on saved bf16 runs: its completion error 4.0 -> 3.1 %, per batch the same).
        w = 1.0 / np.sqrt(np.maximum(b, 1e-6))
        best = None
        for decay in DECAYS:
            history = after_large_values(plans, small_batch_rows, decay, run_starts)
            a = np.array([plan_features(p, small_batch_rows, widen_rows, h) for p, h in zip(plans, history)])
            x = nnls(a * w[:, None], b * w)
            residual = float(np.linalg.norm((a @ x - b) * w))
            if best is None or residual < best[0]:
                best = (residual, decay, a, x)
        _, decay, a, x = best
        if (a @ x <= 0).any():
            raise ValueError(f"the fitted step cost prices some of the {len(records)} timed batches at 0 s "
                             f"(coefficients {dict(zip(FEATURES, x.round(9)))}): time more, and more varied, batches")
        ratio = b / (a @ x)
        with_prompt = a[:, 1] > 0
        spread = {}
        for name, rows in zip(SPREAD_CLASSES, (with_prompt, ~with_prompt)):
            values = ratio[rows] if rows.any() else np.ones(1)
            spread[name] = np.quantile(values, np.linspace(0, 1, SPREAD_QUANTILES)).round(4).tolist()
        return cls(dict(zip(FEATURES, x)), small_batch_rows, widen_rows, num_stages, source="fit", spread=spread,
                   decay=decay)

    def without_spread(self) -> "StepCostModel":
        return StepCostModel(self.coefs, self.small_batch_rows, self.widen_rows, self.num_stages, self.source,
                             decay=self.decay)

    def for_replica(self) -> "StepCostModel":
        """A copy with a history of its own (and, with a spread, draws of its own), for one replica."""
        seed = int(self._rng.integers(2**31)) if self.spread is not None else 0  # no spread: nothing drawn
        return StepCostModel(self.coefs, self.small_batch_rows, self.widen_rows, self.num_stages, self.source,
                             self.spread, seed, self.decay)

    def predict(self, plan, after_large: float = 0.0) -> float:
        return float(np.dot(self._c, plan_features(plan, self.small_batch_rows, self.widen_rows, after_large)))

    def predict_sequence(self, plans) -> np.ndarray:
        """The fitted time of each batch of one run, in order (the history term from the batches before)."""
        history = after_large_values(plans, self.small_batch_rows, self.decay)
        return np.array([self.predict(p, h) for p, h in zip(plans, history)])

    def batch_cost(self, plan):
        f = plan_features(plan, self.small_batch_rows, self.widen_rows, _after_large(self._since_large, self.decay))
        self._since_large = _steps_after(plan, self._since_large, self.small_batch_rows)
        t = sum(c * v for c, v in zip(self._c, f))
        if self.spread is not None:
            q = self._spread[0 if f[1] else 1]
            t *= float(np.interp(self._rng.random(), np.linspace(0, 1, len(q)), q))
        return [t / self.num_stages] * self.num_stages, 0.0, 0.0

    def to_json(self) -> str:
        return json.dumps({"kind": STEP_COST_KIND, "features": list(FEATURES), "coefs": self.coefs,
                           "small_batch_rows": self.small_batch_rows, "widen_rows": self.widen_rows,
                           "decay": self.decay, "spread": self.spread}, indent=2)

    @classmethod
    def from_json(cls, text: str, num_stages: int = 1) -> "StepCostModel":
        return cls.from_dict(json.loads(text), num_stages)

    @classmethod
    def from_dict(cls, data: dict, num_stages: int = 1) -> "StepCostModel":
        if data.get("kind") != STEP_COST_KIND:
            raise ValueError(f"not a step cost table (kind {data.get('kind')!r}, expected {STEP_COST_KIND!r})")
        missing = [k for k in ("small_batch_rows", "widen_rows", "decay") if k not in data]
        if missing:
            raise ValueError(f"step cost table lacks {', '.join(missing)} (a table from before they existed: "
                             f"measure it again)")
        return cls(data["coefs"], data["small_batch_rows"], data["widen_rows"], num_stages, source="table",
                   spread=data.get("spread"), decay=data["decay"])


# ---- driving the real engine ---------------------------------------------------------------------

# Weights of 155 MB in bf16 and 310 MB in fp32: more than the last-level cache a 2-core share gets
# here, so every step streams them from memory, as a deployed model's do. The 4-layer model of hidden
# 512 (SMALL_VALIDATION_MODEL: 50 MB in fp32) stays in a Xeon's L3 (a single thread there reads 64 MB
# at 28 GB/s, 128 MB at 12.5), and a decode step after a large prefill then finds them evicted and
# runs up to 2x slower for several steps (6-14 % per batch there, 2-5 % with this one, both before
# the after_large term, which prices this model's milder version of it; charioteer/sim/README.md).
VALIDATION_MODEL = "synthetic:vocab=1024,hidden=1024,intermediate=2816,layers=6,heads=8,context=2048"
SMALL_VALIDATION_MODEL = "synthetic:vocab=1024,hidden=512,intermediate=1376,layers=4,heads=8,context=2048"
POLICIES = ("sarathi", "orca", "request-level", "vllm")
CALIBRATION_POLICIES = ("request-level", "sarathi", "orca")


class EnginePool:
    """Real engines on this CPU, one per policy, warmed up once and reused for every run.

    KV is reserved per request and there is no prefix cache, so a finished run leaves nothing behind
    that changes the next one. Times are CPU seconds of the calling thread: torch runs single-threaded
    here, in this thread, so on an idle machine that is the wall time, and on a shared one it leaves
    out time spent descheduled."""

    def __init__(self, batch_cap: int, chunk_size: int, max_len: int, dtype: str = "float32",
                 model: str = VALIDATION_MODEL, seed: int = 0) -> None:
        import torch

        torch.set_num_threads(1)  # steadier timings on a shared machine
        self.batch_cap, self.chunk_size, self.max_len = batch_cap, chunk_size, max_len
        self.dtype, self.model, self.seed = dtype, model, seed
        self._engines = {}

    def engine(self, policy: str):
        if policy not in self._engines:
            self._engines[policy] = self._warm(self._new_engine(policy))
        return self._engines[policy]

    def _new_engine(self, policy: str):
        from charioteer.config import EngineArgs
        from charioteer.engine.llm_engine import LLMEngine
        from charioteer.memory.block_manager import cdiv

        return LLMEngine(EngineArgs(model=self.model, dtype=self.dtype, scheduler=policy, max_num_seqs=self.batch_cap,
                                    chunk_size=self.chunk_size, kv_policy="reserve",
                                    num_kv_blocks=self.batch_cap * cdiv(self.max_len, 16), seed=self.seed))

    def _warm(self, engine):
        """Touch every KV block once (first-touch page faults would otherwise land in measured batches)."""
        rng = np.random.default_rng(self.seed)
        for i in range(self.batch_cap):
            engine.add_request(rng.integers(0, engine.model_config.vocab_size, self.max_len - 2).tolist(),
                               self._params(2), request_id=f"warm{i}")
        while engine.has_unfinished_requests():
            engine.step()
        return engine

    @staticmethod
    def _params(max_tokens: int):
        from charioteer.request import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def run(self, workload, policy: str) -> tuple[list[tuple[list, float]], float]:
        """Run `workload` (random prompt ids, the same on every call); return ([(plan, step seconds)], total seconds)."""
        engine = self.engine(policy)
        steps = []
        unsubscribe = engine.subscribe(steps.append)
        rng = np.random.default_rng(self.seed)
        for i in range(len(workload)):
            ids = rng.integers(0, engine.model_config.vocab_size, int(workload.prompt_len[i])).tolist()
            engine.add_request(ids, self._params(int(workload.decode_len[i])), request_id=str(i))
        t0 = time.thread_time()
        while engine.has_unfinished_requests():
            engine.step()
        total = time.thread_time() - t0
        unsubscribe()
        return [(step.plan(), step.cpu_s) for step in steps], total


def _workload(num_requests: int, seed: int, min_len: int, max_len: int):
    from charioteer.sim.workload import WorkloadSpec, make_workload

    return make_workload(WorkloadSpec(num_requests=num_requests, lengths="zipf", min_len=min_len, max_len=max_len,
                                      theta=0.4, pd_ratio=10.0, seed=seed))


def validate(policies=("sarathi",), batch_cap: int = 8, chunk_size: int = 64, num_requests: int = 24,
             seed: int = 1, repeats: int = 9, dtype: str = "float32", model: str = VALIDATION_MODEL,
             progress=None) -> dict:
    """Fit the step cost model on calibration runs, then check it per policy against validation runs.

    This machine's speed swings by 10-50 % for a second or so at a time, so the runs interleave (the
    calibration runs and each policy's validation run, `repeats` times over, in an order rotated
    every time: swings and order effects reach all alike), and every batch's time, calibration and
    validation, is its median over the repeats (each run's batch sequence is deterministic).
    Calibration uses other workloads and seeds than validation, as many requests each, and is shared
    by every policy.
    `progress`: a tqdm-like bar, advanced once per run."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    workload = _workload(num_requests, seed, 64, 512)
    # As many requests per calibration run as validation has: with half as many, the level the fit set
    # carried 2-6 % of noise, and every policy's error leaned the same way by that much.
    calibration_workloads = [(pol, _workload(num_requests, seed + 100 * (i + 1), 32, 640))
                             for i, pol in enumerate(CALIBRATION_POLICIES)]
    max_len = max(int((w.prompt_len + w.decode_len).max()) for w in [workload] + [w for _, w in calibration_workloads])
    pool = EnginePool(batch_cap, chunk_size, max_len, dtype, model)
    jobs = [(i, policy, cal) for i, (policy, cal) in enumerate(calibration_workloads)]
    jobs += [(policy, policy, workload) for policy in policies]
    runs = {key: [] for key, _, _ in jobs}
    for r in range(repeats):
        for key, policy, job_workload in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            runs[key].append(pool.run(job_workload, policy))
            progress and progress.update()
    calibration, run_starts = [], []
    for i in range(len(calibration_workloads)):
        plans, times = _batch_times(runs[i], "calibration")
        run_starts.append(len(calibration))
        calibration += zip(plans, np.median(times, axis=0).tolist())
    engine_model = pool.engine(policies[0]).model
    cost = StepCostModel.fit(calibration, engine_model.small_batch_rows, engine_model.widen_rows,
                             run_starts=run_starts)
    return {"model": model, "batch_cap": batch_cap, "chunk_size": chunk_size, "dtype": dtype, "num_requests": num_requests,
            "validation_runs": repeats, "calibration_batches": len(calibration), "coefs": cost.coefs, "decay": cost.decay,
            "small_batch_rows": cost.small_batch_rows, "widen_rows": cost.widen_rows,
            "policies": [_policy_report(policy, runs[policy], cost, workload, batch_cap, chunk_size, max_len)
                         for policy in policies]}


def _batch_times(runs, what: str) -> tuple[list, np.ndarray]:
    """(plans, seconds [run, batch]) of runs that must have issued the same batch sequence."""
    plans = [p for p, _ in runs[0][0]]
    if any([p for p, _ in r] != plans for r, _ in runs[1:]):
        raise RuntimeError(f"the engine issued different batch sequences for the same {what} workload")
    return plans, np.array([[t for _, t in r] for r, _ in runs])


def _policy_report(policy: str, runs, model: StepCostModel, workload, batch_cap: int, chunk_size: int,
                   max_len: int) -> dict:
    from charioteer.sim.simulator import ReplicaSetup, Simulator
    from charioteer.sim.specs import ClusterConfig

    plans, times = _batch_times(runs, f"{policy} validation")
    step_times = np.median(times, axis=0)
    # A run's total moves with the machine's swings (about a second each; a run lasts a few), so the
    # measured completion is the typical run's: the sum of the batches' median times.
    measured_total = float(step_times.sum())
    errors = np.abs(model.predict_sequence(plans) - step_times) / step_times
    sim = Simulator(ReplicaSetup(policy, batch_cap, max_len, chunk_size=chunk_size), ClusterConfig(),
                    model.without_spread(), trace_batches=True)
    result = sim.run(workload)
    same_batches = [[(n, s) for n, s, _ in p] for p in plans] == [[(n, s) for _, s, n in b] for _, b in result.batches]
    return {
        "policy": policy,
        "validation_batches": len(plans),
        "per_batch_mape": float(np.mean(errors)),
        # how far one batch's repeats lie apart, (max - min) / median, the median over batches: the noise floor
        "repeat_spread": float(np.median((times.max(axis=0) - times.min(axis=0)) / step_times)) if len(runs) > 1 else 0.0,
        "measured_completion_s": measured_total,
        "run_totals_median_s": float(np.median([total for _, total in runs])),  # beside it: each run's own total
        "simulated_completion_s": result.makespan_s,
        "completion_error": abs(result.makespan_s - measured_total) / measured_total,
        "same_batch_sequence": same_batches,
    }
