"""Property tests: every scheduling policy keeps its invariants on random workloads.

Schedulers are pure logic, so the tests drive them with a tiny executor: for every batch entry
whose `samples` is set it returns a token that is a deterministic function of the request and the
request's length at that point (sometimes the request's EOS). Because the token only depends on
(request, position), the outputs a request ends up with are known in advance whatever the
schedule, preemptions and recomputes were; the tests check them exactly.

Workloads: 1-30 requests arriving at random steps, random aborts (before a plan, or while its
batch runs), the four policies, paged and reserve KV, pools from generous to barely fitting the
largest request, SARATHI strict / tiled / token-budget mode, and one batch in flight at a time
or (test_invariants_pipelined) two or three, as pipeline micro-batches would be.

Checked after every plan and every returned batch (`_check_plan`, `_check_blocks`,
`_check_queues`): batch shape (one prompt chunk at most under strict SARATHI, decode-maximal,
batch cap, token budget, chunk size), entry positions, KV block ownership and coverage,
in-flight rules, progress (no empty batch while work is pending, no long stretch without a
sampled token). At the end (`check_final`): every request finished exactly once with exactly
the expected outputs and finish reason, and every block is free again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request, RequestStatus, SamplingParams
from charioteer.scheduling import SCHEDULER_CLASSES, Batch, make_scheduler

POLICIES = sorted(SCHEDULER_CLASSES)
EOS = 0
PHASES = ("before", "mid")  # abort before planning the step, or while its batch "runs"


# ---- workload description ------------------------------------------------------------------


@dataclass
class ReqSpec:
    prompt_len: int
    max_tokens: int
    arrival: int  # step at which add_request is called
    eos: bool  # whether the request has eos_token_id == EOS (else None)
    ignore_eos: bool = False
    priority: int = 0


@dataclass
class Workload:
    policy: str
    kv_policy: str
    block_size: int
    num_blocks: int
    chunk_size: int
    max_num_seqs: int
    budget: int | None
    tile_size: int | None
    token_budget_mode: bool
    requests: list[ReqSpec]
    aborts: list[tuple[int, int, str]] = field(default_factory=list)  # (step, request index, phase)
    eos_mod: int = 50
    seed: int = 0
    pipeline_depth: int = 1  # batches in flight at once (pipeline micro-batches)
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "fcfs"
    micro_batch_cap: int | None = None  # schedule(max_requests): the pipeline's per-micro-batch cap
    num_scheduler_steps: int = 1  # a decode-only plan's steps (with one batch in flight, as the engine allows)

    def config(self) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            chunk_size=self.chunk_size,
            max_num_batched_tokens=self.budget,
            tile_size=self.tile_size,
            token_budget_mode=self.token_budget_mode,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            num_scheduler_steps=self.num_scheduler_steps,
        )


def token_for(w: Workload, index: int, position: int) -> int:
    """The executor's 'model': the token sampled when request `index` has `position` tokens."""
    h = ((index + 1) * 1_000_003 + position * 7_919 + w.seed * 104_729) * 2_654_435_761 % (1 << 32)
    return EOS if h % w.eos_mod == 0 else 1 + (h >> 8) % 997


def expected_outputs(w: Workload, index: int) -> tuple[list[int], str]:
    spec = w.requests[index]
    out: list[int] = []
    while True:
        tok = token_for(w, index, spec.prompt_len + len(out))
        out.append(tok)
        if spec.eos and not spec.ignore_eos and tok == EOS:
            return out, "stop"
        if len(out) >= spec.max_tokens:
            return out, "length"


def make_request(w: Workload, index: int) -> Request:
    spec = w.requests[index]
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[(index * 31 + j) % 997 + 1 for j in range(spec.prompt_len)],
        params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos, priority=spec.priority),
        eos_token_id=EOS if spec.eos else None,
    )


def rejected_reason(w: Workload, spec: ReqSpec) -> str | None:
    """Why add_request must raise ValueError for this request, or None if it must be accepted."""
    total = spec.prompt_len + spec.max_tokens
    if cdiv(total, w.block_size) > w.num_blocks:
        return "does not fit the whole KV cache"
    # Whole prompts must fit the budget; under paged KV so must a recompute (prompt + outputs).
    need = spec.prompt_len if w.kv_policy == "reserve" else total
    if w.policy != "sarathi" and w.budget is not None and need > w.budget:
        return "whole-prompt policy with a token budget below the prompt (or prompt + max_tokens)"
    return None


# ---- the driver ------------------------------------------------------------------------------


@dataclass
class Run:
    requests: dict[int, Request]  # accepted requests by index
    rejected: set[int]
    finished_by_batch: list[str]
    aborted: list[str]
    steps: int
    num_preemptions: int
    scheduler: object


def _ready(sched) -> list[Request]:
    return [r for r in sched.running if not r.in_flight]


def _prefill_pending(sched) -> bool:
    """Strict SARATHI's 'prompt work is pending': a ready running prompt, or an admissible slot."""
    return any(r.in_prefill for r in _ready(sched)) or (
        bool(sched.waiting) and len(sched.running) < sched.config.max_num_seqs
    )


def _check_blocks(sched, inflight: list[Batch], steps_left: int = 0) -> None:
    """KV ownership: disjoint tables, held by running (or aborted in-flight) requests, covering
    their computed tokens plus what in-flight batches will write (a multi-step plan: `steps_left`
    more decode tokens after the batch in flight, whose blocks its plan took)."""
    bm: BlockManager = sched.blocks
    assert 0 <= bm.num_used_blocks <= bm.num_blocks
    free = bm._free
    assert len(set(free)) == len(free), "a block is free twice"
    owner: dict[int, str] = {}
    for rid, table in bm._tables.items():
        for b in table:
            assert 0 <= b < bm.num_blocks
            assert b not in owner, f"block {b} owned by {owner[b]} and {rid}"
            owner[b] = rid
    assert not set(owner) & set(free), "a block is both owned and free"
    assert len(owner) + len(free) == bm.num_blocks, "a block leaked"

    scheduled: dict[str, int] = {}
    flying: set[str] = set()
    for b in inflight:
        for e in b.entries:
            rid = e.request.request_id
            assert rid not in scheduled, f"{rid} is in two in-flight batches"
            assert e.request.in_flight
            scheduled[rid] = e.num_tokens + steps_left
            flying.add(rid)
    for r in [*sched.running, *sched.waiting]:
        assert r.in_flight == (r.request_id in flying)
    running_ids = {r.request_id for r in sched.running}
    aborted_flying = {e.request.request_id for b in inflight for e in b.entries if e.request.is_finished}
    assert set(bm._tables) == running_ids | aborted_flying, "only running (or in-flight) requests hold blocks"
    for r in sched.running:
        need = r.num_computed_tokens + scheduled.get(r.request_id, 0)
        table = bm._tables[r.request_id]
        assert len(table) * bm.block_size >= need, f"{r.request_id}: table does not cover {need} tokens"
        if bm.policy == "reserve":
            assert len(table) == cdiv(r.max_num_tokens, bm.block_size)
        else:  # paged: blocks are taken on demand, never ahead of need
            assert len(table) == cdiv(need, bm.block_size), f"{r.request_id}: {len(table)} blocks for {need}"


def _check_queues(sched) -> None:
    cap = sched.config.max_num_seqs
    assert len(sched.running) <= cap
    ids = [r.request_id for r in [*sched.running, *sched.waiting]]
    assert len(ids) == len(set(ids)), "a request is queued twice"
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert 0 <= r.num_computed_tokens <= r.num_tokens
    for r in sched.waiting:
        assert r.status is RequestStatus.WAITING
        assert r.num_computed_tokens == 0, "a waiting request keeps no KV"
        assert not r.in_flight
    if sched.by_priority:
        for queue in (list(sched.running), list(sched.waiting)):
            keys = [r.priority_key for r in queue]
            assert keys == sorted(keys), "priority scheduling keeps both queues in priority order"


def spec_chunk_len(cfg: SchedulerConfig, num_decodes: int) -> int:
    """Strict SARATHI's chunk, from the spec: C, shrunk so that C + decodes is a multiple of the
    tile when that leaves at least one token, then capped by what the token budget leaves."""
    chunk = cfg.chunk_size
    if cfg.tile_size:
        aligned = (chunk + num_decodes) // cfg.tile_size * cfg.tile_size - num_decodes
        if aligned >= 1:
            chunk = aligned
    if cfg.max_num_batched_tokens is not None:
        chunk = min(chunk, cfg.max_num_batched_tokens - num_decodes)
    return chunk


def _check_plan(w: Workload, sched, batch: Batch, before: dict, inflight: list[Batch]) -> None:
    cfg = sched.config
    budget = cfg.max_num_batched_tokens
    assert len(batch) <= cfg.max_num_seqs
    if budget is not None:
        assert batch.num_tokens <= budget, f"{batch.num_tokens} tokens over the budget {budget}"
    ids = [e.request.request_id for e in batch.entries]
    assert len(ids) == len(set(ids)), "a request appears twice in one batch"
    preempted = {r.request_id for r in batch.preempted}
    for e in batch.entries:
        r = e.request
        rid = r.request_id
        assert r.status is RequestStatus.RUNNING and r in sched.running
        assert rid not in before["flying"], "a request already in flight was planned again"
        assert e.num_tokens >= 1
        assert e.start == r.num_computed_tokens
        if rid in preempted:
            assert e.start == 0, "a preempted request restarts from scratch"
        else:
            assert e.start == before["computed"].get(rid, 0)
        assert e.end <= r.num_tokens
        assert e.samples == (e.end == r.num_tokens)
        assert e.is_prefill == (r.num_output_tokens == 0 or r.num_tokens - e.start > 1)
        if not e.is_prefill:
            assert e.num_tokens == 1 and e.samples
    assert not preempted & before["flying"], "an in-flight request was preempted"
    # Every entry's KV slots are reserved, and ownership is consistent.
    _check_blocks(sched, [*inflight, batch], batch.num_steps - 1)
    _check_queues(sched)
    if w.kv_policy == "reserve":
        assert not batch.preempted

    threshold = cfg.long_prefill_token_threshold
    if threshold is not None:
        assert all(p.num_tokens <= threshold for p in batch.prefills), "a long prompt took over its threshold"
    if w.policy == "sarathi" and cfg.token_budget_mode:
        partial = [p for p in batch.prefills if not p.samples and p.request.request_id not in before["ready"]]
        assert len(partial) <= cfg.max_num_partial_prefills, "token-budget mode started too many partial prefills"
    if w.policy == "sarathi" and not cfg.token_budget_mode and cfg.fair_prefills:
        prefills = batch.prefills
        assert len(prefills) <= cfg.max_num_partial_prefills, "strict SARATHI: at most N prompts per batch"
        assert sum(p.num_tokens for p in prefills) <= spec_chunk_len(cfg, len(batch.decodes))
        if not batch.preempted and not before["flying"] and w.micro_batch_cap is None:
            limit = cfg.max_num_seqs - 1 if before["prefill_pending"] else cfg.max_num_seqs
            if budget is not None:
                limit = min(limit, budget)
            assert len(batch.decodes) == min(before["num_decodes"], limit)
    elif w.policy == "sarathi" and not cfg.token_budget_mode:
        prefills = batch.prefills
        assert len(prefills) <= 1, "strict SARATHI: at most one prompt chunk per batch"
        n_dec = len(batch.decodes)
        if prefills:
            p = prefills[0]
            assert p.num_tokens <= cfg.chunk_size
            chunk = spec_chunk_len(cfg, n_dec)
            assert sched.chunk_len(n_dec) == chunk
            assert p.num_tokens <= chunk
            assert p.num_tokens == chunk or p.samples, "a chunk is full-size unless it ends the prompt"
        # Completeness checks hold when nothing else is in flight: with batches in flight, a
        # request that cannot grow may wait for them to return (no preemption, not planned).
        complete = not batch.preempted and not before["flying"] and w.micro_batch_cap is None
        if complete:
            # Decode-maximal: every ready decode the cap allows is in the batch.
            limit = cfg.max_num_seqs - 1 if before["prefill_pending"] else cfg.max_num_seqs
            if budget is not None:
                limit = min(limit, budget)
            assert n_dec == min(before["num_decodes"], limit)
            if budget is None and not prefills and not sched.by_priority:
                # No chunk although prompt work is pending: only if it was not admissible.
                assert not any(r.in_prefill for r in _ready(sched))
                if sched.waiting and len(sched.running) < cfg.max_num_seqs:
                    head = sched.waiting[0]
                    first = min(head.num_remaining_tokens, spec_chunk_len(cfg, n_dec))
                    assert not sched.blocks.can_admit(head, first)
    elif w.policy == "sarathi":
        if not batch.preempted and not before["flying"] and w.micro_batch_cap is None:
            assert len(batch.decodes) == min(before["num_decodes"], cfg.max_num_seqs, budget)
    else:
        # Whole prompts: every entry runs to the request's end and samples.
        assert all(e.samples for e in batch.entries)
        in_batch = {e.request.request_id for e in batch.entries}
        if w.policy == "orca" and not batch.preempted and not before["flying"]:
            assert before["ready"] <= in_batch, "orca runs every ready request each iteration"
        if w.policy == "vllm":
            assert not (batch.prefills and batch.decodes), "vllm never mixes prefills and decodes"
            if batch.decodes and not batch.preempted and sched.waiting:
                head = sched.waiting[0]
                n = head.num_remaining_tokens
                assert (
                    len(sched.running) >= cfg.max_num_seqs
                    or not sched.blocks.can_admit(head, n)
                    or (budget is not None and n > budget)
                ), "vllm runs decodes while a prompt could be admitted"
        if w.policy == "request-level" and before["running"]:
            assert in_batch <= before["running"], "request-level admits only when the batch drained"


def run_workload(w: Workload, check: bool = True) -> Run:
    """Drive the scheduler like an engine would, with up to `w.pipeline_depth` batches in flight
    (1: plan, run, return; more: pipeline micro-batches returning in order)."""
    sched = make_scheduler(w.config(), BlockManager(w.num_blocks, w.block_size, w.kv_policy))
    by_step: dict[int, list[int]] = {}
    for i, spec in enumerate(w.requests):
        by_step.setdefault(spec.arrival, []).append(i)
    aborts_at: dict[tuple[int, str], list[int]] = {}
    for step, idx, phase in w.aborts:
        aborts_at.setdefault((step, phase), []).append(idx)
    last_event = max([s.arrival for s in w.requests] + [a[0] for a in w.aborts] + [0])

    requests: dict[int, Request] = {}
    rejected: set[int] = set()
    finished_by_batch: list[str] = []
    aborted: list[str] = []
    done: set[str] = set()
    inflight: deque[Batch] = deque()
    steps_left = 0  # steps of the multi-step plan in flight after its batch in flight
    # Progress bounds, generous: healthy runs take under 3 steps per token of work per batch in
    # flight, and never go more steps than the longest request without sampling a token.
    total_work = sum(s.prompt_len + s.max_tokens for s in w.requests)
    longest = max(s.prompt_len + s.max_tokens for s in w.requests)
    step_limit = last_event + 100 + 6 * w.pipeline_depth * total_work
    stall_limit = 50 + 8 * w.pipeline_depth * longest
    last_progress = 0

    def do_aborts(step: int, phase: str) -> None:
        for idx in aborts_at.get((step, phase), []):
            rid = f"r{idx}"
            req = sched.abort(rid)
            if idx not in requests or rid in done:
                assert req is None, f"abort of {rid} (not pending) returned a request"
                continue
            assert req is requests[idx]
            assert req.is_finished and req.finish_reason == "abort"
            assert req not in sched.running and req not in sched.waiting
            # Blocks go back at once, unless a batch in flight still writes them.
            assert (rid in sched.blocks._tables) == req.in_flight
            done.add(rid)
            aborted.append(rid)

    step = 0
    while True:
        for idx in by_step.get(step, []):
            req = make_request(w, idx)
            reason = rejected_reason(w, w.requests[idx])
            if reason is not None:
                with pytest.raises(ValueError):
                    sched.add_request(req)
                assert req not in sched.waiting
                rejected.add(idx)
            else:
                sched.add_request(req)
                requests[idx] = req
        do_aborts(step, "before")
        if step > last_event and not sched.has_unfinished() and not inflight:
            break
        assert step < step_limit, f"not done after {step} steps (livelock?)"
        if not sched.has_unfinished():
            last_progress = step
        assert step - last_progress <= stall_limit, f"no token sampled for {step - last_progress} steps (livelock?)"

        batch = Batch()
        if len(inflight) < w.pipeline_depth:
            pending = sched.has_unfinished()
            ready = _ready(sched)
            before = {
                "computed": {r.request_id: r.num_computed_tokens for r in ready},
                "ready": {r.request_id for r in ready},
                "running": {r.request_id for r in sched.running},
                "flying": {e.request.request_id for b in inflight for e in b.entries},
                "num_decodes": sum(1 for r in ready if not r.in_prefill),
                "prefill_pending": _prefill_pending(sched),
            }
            batch = sched.schedule(w.micro_batch_cap)
            assert batch.num_steps == 1 or (batch.num_steps <= w.num_scheduler_steps and not sched.waiting
                                            and not any(e.is_prefill for e in batch.entries))
            steps_left = batch.num_steps - 1
            if pending and not inflight:
                assert batch, f"empty batch while {sched.num_requests} requests are pending"
            if not pending:
                assert not batch
            if check:
                _check_plan(w, sched, batch, before, list(inflight))
            if batch:
                inflight.append(batch)

        do_aborts(step, "mid")
        if inflight and (len(inflight) >= w.pipeline_depth or not batch):
            # The executor: a token for every entry that reaches its request's last token.
            oldest = inflight.popleft()
            sampled = {
                e.request.request_id: token_for(w, int(e.request.request_id[1:]), e.end)
                for e in oldest.entries
                if e.samples
            }
            if sampled:
                last_progress = step
            finished = sched.on_batch_done(oldest, sampled)
            for r in finished:
                assert r.request_id not in done, f"{r.request_id} finished twice"
                assert r.is_finished and r.finish_reason in ("stop", "length")
                assert r.request_id not in sched.blocks._tables
                done.add(r.request_id)
                finished_by_batch.append(r.request_id)
            for e in oldest.entries:
                assert not e.request.in_flight
                if e.request.is_finished:
                    assert e.request.request_id not in sched.blocks._tables
            if steps_left:  # the plan's next step runs before anything is planned
                steps_left -= 1
                following = sched.next_step(oldest)
                if following:
                    inflight.appendleft(following)
                else:
                    steps_left = 0
        if check:
            _check_blocks(sched, list(inflight), steps_left)
            _check_queues(sched)
        step += 1

    return Run(requests, rejected, finished_by_batch, aborted, step, sched.num_preemptions, sched)


def check_final(w: Workload, run: Run) -> None:
    sched = run.scheduler
    bm = sched.blocks
    assert bm.num_free_blocks == bm.num_blocks and not bm._tables
    assert not sched.running and not sched.waiting
    ended = run.finished_by_batch + run.aborted
    assert len(ended) == len(set(ended)), "a request finished twice"
    assert set(ended) == {r.request_id for r in run.requests.values()}, "every request finishes once"
    assert sum(r.num_preemptions for r in run.requests.values()) == run.num_preemptions
    if w.kv_policy == "reserve":
        assert run.num_preemptions == 0
    aborted = set(run.aborted)
    for idx, r in run.requests.items():
        assert r.is_finished
        assert r.finish_reason in ("stop", "length", "abort")
        want, reason = expected_outputs(w, idx)
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
            assert r.output_token_ids == want[: r.num_output_tokens]
            assert r.num_output_tokens < len(want), "an aborted request had already finished"
        else:
            assert r.output_token_ids == want
            assert r.finish_reason == reason
            assert r.num_output_tokens == r.params.max_tokens or (
                r.finish_reason == "stop" and r.output_token_ids[-1] == EOS
            )


# ---- strategies -----------------------------------------------------------------------------


@st.composite
def workloads(draw, policies=tuple(POLICIES), kv_policies=("paged", "reserve"), depths=(1,)) -> Workload:
    policy = draw(st.sampled_from(policies))
    kv_policy = draw(st.sampled_from(kv_policies))
    n = draw(st.integers(1, 30))
    max_prompt = draw(st.sampled_from([3, 8, 40, 300]))  # mostly small prompts keep examples fast
    max_out = draw(st.sampled_from([3, 40]))
    last_arrival = draw(st.sampled_from([0, 5, 40]))
    specs = [
        ReqSpec(
            prompt_len=draw(st.integers(1, max_prompt)),
            max_tokens=draw(st.integers(1, max_out)),
            arrival=draw(st.integers(0, last_arrival)),
            eos=draw(st.booleans()),
            ignore_eos=draw(st.booleans()) and draw(st.booleans()),
        )
        for _ in range(n)
    ]
    block_size = draw(st.integers(1, 32))
    need = [cdiv(s.prompt_len + s.max_tokens, block_size) for s in specs]
    pool = draw(st.sampled_from(["tight", "medium", "generous"]))
    if pool == "tight":
        num_blocks = max(need) + draw(st.integers(0, 3))
    elif pool == "medium":
        num_blocks = max(need) + draw(st.integers(0, sum(need)))
    else:
        num_blocks = sum(need) + draw(st.integers(0, 8))
    if draw(st.integers(0, 9)) == 0:  # now and then, some requests that cannot fit at all
        num_blocks = max(1, num_blocks - draw(st.integers(1, max(1, max(need) // 2))))

    chunk_size = draw(st.one_of(st.integers(1, 300), st.integers(1, 16)))
    max_num_seqs = draw(st.integers(1, 16))
    tile_size = None
    token_budget_mode = False
    budget = None
    longest = max(s.prompt_len + s.max_tokens for s in specs)
    if policy == "sarathi":
        mode = draw(st.sampled_from(["strict", "strict", "tile", "budget", "budget-mode", "budget-mode-default"]))
        if mode == "tile":
            tile_size = draw(st.integers(1, 64))
        elif mode == "budget":
            budget = draw(st.integers(1, 400))
        elif mode == "budget-mode":
            token_budget_mode = True
            budget = draw(st.integers(1, 400))
        elif mode == "budget-mode-default":
            token_budget_mode = True  # the budget defaults to chunk_size
    else:
        budget = draw(
            st.one_of(
                st.none(),
                st.integers(longest, longest + 200),
                st.integers(longest, max(longest, 16)),  # often below the batch cap
                st.integers(1, longest + 200),  # may reject some requests
            )
        )
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 60), st.integers(0, n - 1), st.sampled_from(PHASES)),
            max_size=draw(st.sampled_from([0, 3, 10])),
        )
    )
    return Workload(
        policy=policy,
        kv_policy=kv_policy,
        block_size=block_size,
        num_blocks=num_blocks,
        chunk_size=chunk_size,
        max_num_seqs=max_num_seqs,
        budget=budget,
        tile_size=tile_size,
        token_budget_mode=token_budget_mode,
        requests=specs,
        aborts=aborts,
        eos_mod=draw(st.sampled_from([3, 10, 50, 1000])),
        seed=draw(st.integers(0, 1000)),
        pipeline_depth=draw(st.sampled_from(depths)),
        num_scheduler_steps=draw(st.sampled_from([1, 1, 2, 5])) if depths == (1,) else 1,
    )


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def fair_workloads(draw, depths=(1,)) -> Workload:
    """SARATHI with partial prefills (several prompts share a batch's prompt tokens), priorities, or both."""
    w = draw(workloads(policies=("sarathi",), depths=depths))
    if draw(st.booleans()):
        w.max_num_partial_prefills = draw(st.integers(1, 4))
        w.max_long_partial_prefills = draw(st.integers(1, w.max_num_partial_prefills))
        w.long_prefill_token_threshold = draw(st.one_of(st.none(), st.integers(1, 64)))
    if w.pipeline_depth > 1:
        w.micro_batch_cap = draw(st.one_of(st.none(), st.integers(1, 4)))
    if draw(st.booleans()):
        w.scheduling_policy = "priority"
        for spec in w.requests:
            spec.priority = draw(st.integers(-2, 2))
    return w


# ---- property tests -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_invariants_random_workloads(policy: str, data) -> None:
    w = data.draw(workloads(policies=(policy,)))
    check_final(w, run_workload(w))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_invariants_tight_paged_pool(policy: str, data) -> None:
    """Paged KV with barely more blocks than the largest request: preemption happens a lot."""
    w = data.draw(workloads(policies=(policy,), kv_policies=("paged",)))
    w.num_blocks = max(cdiv(s.prompt_len + s.max_tokens, w.block_size) for s in w.requests)
    w.num_blocks += data.draw(st.integers(0, 2))
    check_final(w, run_workload(w))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_token_budget_below_batch_cap(policy: str, data) -> None:
    """Tiny requests, a token budget smaller than the batch cap: no batch may exceed the budget."""
    n = data.draw(st.integers(1, 30))
    specs = [
        ReqSpec(
            prompt_len=data.draw(st.integers(1, 4)),
            max_tokens=data.draw(st.integers(1, 6)),
            arrival=data.draw(st.integers(0, 3)),
            eos=data.draw(st.booleans()),
        )
        for _ in range(n)
    ]
    longest = max(s.prompt_len + s.max_tokens for s in specs)
    mode = data.draw(st.sampled_from(["strict", "budget-mode"])) if policy == "sarathi" else "whole"
    w = Workload(
        policy=policy,
        kv_policy=data.draw(st.sampled_from(["paged", "reserve"])),
        block_size=data.draw(st.integers(1, 8)),
        num_blocks=1000,
        chunk_size=data.draw(st.integers(1, 16)),
        max_num_seqs=data.draw(st.integers(2, 16)),
        budget=data.draw(st.integers(1 if policy == "sarathi" else longest, 16)) if longest <= 16 else longest,
        tile_size=None,
        token_budget_mode=mode == "budget-mode",
        requests=specs,
        eos_mod=data.draw(st.sampled_from([3, 1000])),
    )
    check_final(w, run_workload(w))


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_invariants_pipelined(policy: str, data) -> None:
    """Two or three batches in flight at once (pipeline micro-batches): a request in flight is
    never planned again nor preempted, keeps its blocks until its batch returns (even when
    aborted meanwhile), and everything still finishes."""
    w = data.draw(workloads(policies=(policy,), depths=(2, 3)))
    check_final(w, run_workload(w))


@settings(max_examples=300, **SETTINGS)
@given(w=fair_workloads(depths=(1, 1, 2, 3)))
def test_invariants_partial_prefills_and_priorities(w: Workload) -> None:
    """Every invariant above holds with partial prefills and priorities too: nothing is lost, nobody
    livelocks, outputs are exact, blocks all come back."""
    check_final(w, run_workload(w))


@settings(max_examples=60, **SETTINGS)
@given(workloads(kv_policies=("reserve",), depths=(1, 2, 3)))
def test_reserve_policy_never_preempts(w: Workload) -> None:
    run = run_workload(w)
    check_final(w, run)
    assert run.num_preemptions == 0


@settings(max_examples=100, **SETTINGS)
@given(
    policy=st.sampled_from(POLICIES),
    kv_policy=st.sampled_from(["paged", "reserve"]),
    block_size=st.integers(1, 32),
    num_blocks=st.integers(1, 40),
    prompt_len=st.integers(1, 300),
    max_tokens=st.integers(1, 40),
    budget=st.one_of(st.none(), st.integers(1, 400)),
)
def test_add_request_rejects_what_can_never_run(policy, kv_policy, block_size, num_blocks, prompt_len, max_tokens, budget):
    cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=budget)
    sched = make_scheduler(cfg, BlockManager(num_blocks, block_size, kv_policy))
    req = Request("r0", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    total = prompt_len + max_tokens
    too_big_for_cache = cdiv(total, block_size) > num_blocks
    assert sched.blocks.fits_ever(req) == (not too_big_for_cache)
    need = prompt_len if kv_policy == "reserve" else total  # reserved KV never recomputes
    too_big_for_batch = policy != "sarathi" and budget is not None and need > budget
    if too_big_for_cache or too_big_for_batch:
        with pytest.raises(ValueError):
            sched.add_request(req)
        assert not sched.has_unfinished()
        assert req.status is RequestStatus.WAITING and req.request_id not in sched.blocks._tables
    else:
        sched.add_request(req)
        assert list(sched.waiting) == [req]
        # A lone accepted request always runs to completion.
        steps = 0
        while sched.has_unfinished():
            batch = sched.schedule()
            assert batch
            sched.on_batch_done(batch, {e.request.request_id: 7 for e in batch.entries if e.samples})
            steps += 1
            assert steps <= total + 5
        assert req.finish_reason == "length" and req.num_output_tokens == max_tokens
        assert sched.blocks.num_free_blocks == num_blocks


# ---- deterministic checks -------------------------------------------------------------------


def _many_long_requests(policy: str, num_blocks: int, **cfg) -> Workload:
    specs = [ReqSpec(prompt_len=20 + 7 * (i % 5), max_tokens=30 + (i % 3) * 5, arrival=i % 3, eos=False) for i in range(12)]
    return Workload(
        policy=policy,
        kv_policy="paged",
        block_size=4,
        num_blocks=num_blocks,
        chunk_size=cfg.pop("chunk_size", 16),
        max_num_seqs=cfg.pop("max_num_seqs", 8),
        budget=cfg.pop("budget", None),
        tile_size=cfg.pop("tile_size", None),
        token_budget_mode=cfg.pop("token_budget_mode", False),
        requests=specs,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_tight_paged_pool_preempts_and_still_finishes(policy: str) -> None:
    # The largest request needs cdiv(48 + 40, 4) = 22 blocks; 24 blocks cannot hold 8 of them.
    tight = _many_long_requests(policy, num_blocks=24)
    roomy = _many_long_requests(policy, num_blocks=10_000)
    tight_run = run_workload(tight)
    roomy_run = run_workload(roomy)
    check_final(tight, tight_run)
    check_final(roomy, roomy_run)
    assert tight_run.num_preemptions > 0, "a tight paged pool must preempt"
    assert roomy_run.num_preemptions == 0
    assert any(r.num_preemptions for r in tight_run.requests.values())
    for idx, r in tight_run.requests.items():
        other = roomy_run.requests[idx]
        assert r.num_output_tokens == other.num_output_tokens == r.params.max_tokens
        assert r.output_token_ids == other.output_token_ids
        assert r.finish_reason == other.finish_reason == "length"


@pytest.mark.parametrize("policy", POLICIES)
def test_reserve_pool_of_same_size_never_preempts(policy: str) -> None:
    w = _many_long_requests(policy, num_blocks=24)
    w.kv_policy = "reserve"
    run = run_workload(w)
    check_final(w, run)
    assert run.num_preemptions == 0


def test_vllm_decode_batch_respects_token_budget() -> None:
    """Two prefill batches of 5 one-token prompts each fill the budget of 5; the decode batch
    that follows must not run all 10 running requests at once (10 tokens > budget 5)."""
    w = Workload(
        policy="vllm", kv_policy="paged", block_size=4, num_blocks=100, chunk_size=16,
        max_num_seqs=16, budget=5, tile_size=None, token_budget_mode=False,
        requests=[ReqSpec(prompt_len=1, max_tokens=4, arrival=0, eos=False) for _ in range(10)],
    )
    check_final(w, run_workload(w))


def test_sarathi_pipelined_tight_pool_makes_progress() -> None:
    """Two requests (1 prompt token, 3 to generate) in a 4-block paged pool, two batches in
    flight. Each fits the pool alone, so they must finish; a request that cannot grow because
    the other one is in flight must wait for that batch rather than preempt itself (it is then
    re-admitted at once, refills the pool, and the other one does the same: forever)."""
    w = Workload(
        policy="sarathi", kv_policy="paged", block_size=1, num_blocks=4, chunk_size=2,
        max_num_seqs=2, budget=None, tile_size=None, token_budget_mode=False,
        requests=[ReqSpec(prompt_len=1, max_tokens=3, arrival=0, eos=False) for _ in range(2)],
        pipeline_depth=2,
    )
    check_final(w, run_workload(w))


def test_sarathi_token_budget_skips_prefill_preempted_in_same_plan() -> None:
    """Token-budget mode, two batches in flight: r0 and r1 both hold 2 of their 3 prompt tokens
    and the 4-block pool is full. Planning r0's last chunk preempts r1; the plan must then skip
    r1 (now waiting, without a block table) instead of growing it."""
    w = Workload(
        policy="sarathi", kv_policy="paged", block_size=1, num_blocks=4, chunk_size=2,
        max_num_seqs=2, budget=2, tile_size=None, token_budget_mode=True,
        requests=[ReqSpec(prompt_len=3, max_tokens=1, arrival=0, eos=False) for _ in range(2)],
        pipeline_depth=2,
    )
    check_final(w, run_workload(w))


def test_sarathi_strict_one_full_chunk_per_batch_while_prompts_pend() -> None:
    """Deterministic shape check: C-token chunks, one per batch, decodes piggybacked."""
    w = Workload(
        policy="sarathi", kv_policy="paged", block_size=8, num_blocks=1000, chunk_size=10,
        max_num_seqs=4, budget=None, tile_size=None, token_budget_mode=False,
        requests=[ReqSpec(prompt_len=25, max_tokens=20, arrival=0, eos=False) for _ in range(3)],
    )
    sched = make_scheduler(w.config(), BlockManager(w.num_blocks, w.block_size, w.kv_policy))
    reqs = [make_request(w, i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    shapes = []
    while sched.has_unfinished():
        batch = sched.schedule()
        shapes.append(([(e.request.request_id, e.num_tokens) for e in batch.prefills], len(batch.decodes)))
        sched.on_batch_done(batch, {e.request.request_id: 5 for e in batch.entries if e.samples})
    # r0: 10+10+5, then r1 chunks with r0 decoding alongside, then r2 with r0/r1 decoding.
    assert shapes[:9] == [
        ([("r0", 10)], 0), ([("r0", 10)], 0), ([("r0", 5)], 0),
        ([("r1", 10)], 1), ([("r1", 10)], 1), ([("r1", 5)], 1),
        ([("r2", 10)], 2), ([("r2", 10)], 2), ([("r2", 5)], 2),
    ]
    assert all(len(p) == 0 for p, _ in shapes[9:])
    assert all(r.num_output_tokens == 20 for r in reqs)
