"""Event-driven cluster simulation driving the engine's own scheduler classes.

A replica is a pipeline of `pp` stages. Its scheduler(s) plan batches exactly as in the engine
(`schedule()` -> batch in flight -> `on_batch_done()`); a cost model prices each batch per stage.
Stages are FIFO and run one micro-batch at a time, so when a micro-batch is issued its whole trip
through the pipeline is fixed by the micro-batches issued before it: stage s starts it at
max(arrival at s, stage s free) and hands it to stage s+1 after the transfer time. At most `pp`
micro-batches are in flight per replica.

Bubble time (paper, section 5.3: the idle time of a request summed over its micro-batches and
iterations): for each micro-batch, the time it sits ready in front of a busy stage (stage 0 after
being planned, and every later stage after its transfer arrives). Every request in the micro-batch
is charged that time. Each wait is classified by what held the stage, i.e. the micro-batch that ran
on that stage just before, against the waiting one (paper Figure 5). If that holder had itself
queued there, the part of our wait that its queueing explains (up to its own wait) keeps the
holder's class, so a convoy is charged to the batch that started it:
  PB1: both hold prompt tokens (unequal prefill work);
  PB2: one holds prompt tokens and the other is decode-only;
  PB3: both are decode-only (unequal context lengths).
We also record the dual view, stage idle time: a stage that has run before and waits for the next
micro-batch; it is charged to the requests of the micro-batch it waited for (`stage_idle_s`).

Layout: `Simulator.run` drives a `_Run`, an event loop over arrivals and micro-batch returns:
`dispatch` places an arrival on a `_Replica`, `issue` plans micro-batches there (`_Replica.plan`:
late binding and `Scheduler.schedule`) and `launch` prices one with the cost model and runs it
through the replica's `_Pipeline`; `on_return` hands it back to its scheduler (`on_batch_done`).
`_Tally` records what the run measures. The simulator changes requests and schedulers only
through the schedulers' public methods (add_request, schedule, on_batch_done).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request, SamplingParams
from charioteer.scheduling import make_scheduler
from charioteer.scheduling.base import Batch, PlanRow
from charioteer.sim.cost import CostModel
from charioteer.sim.specs import ClusterConfig
from charioteer.sim.workload import Workload

_ARRIVAL, _RETURN = 0, 1


@dataclass
class ReplicaSetup:
    """How each replica's schedulers are built."""

    policy: str
    batch_cap: int
    max_seq_len: int
    chunk_size: int = 256
    tile_size: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16


@dataclass
class SimResult:
    num_requests: int
    makespan_s: float
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    bubble_s: np.ndarray  # per request: waits in front of busy stages
    bubble_pb_s: np.ndarray  # per request, [PB1, PB2, PB3] columns
    stage_idle_s: np.ndarray  # per request: stage idle time charged to it
    tbt_s: np.ndarray  # every gap between consecutive tokens of a request
    batch_sizes: np.ndarray
    batch_tokens: np.ndarray
    batch_prefill_tokens: np.ndarray
    stage_busy_s: np.ndarray  # [replica, stage]
    flops: float
    num_preemptions: int
    batches: list = field(default_factory=list)  # per batch (replica, [(request_id, start, num_tokens)]) when traced
    stopped_early: bool = False  # the run hit its `ttft_limit` or `tbt_limit` and stopped with requests unfinished
    # The most requests one scheduler held at once (waiting and running). A run with another batch cap B
    # plans the same batches if this stayed below both caps: no cap, KV reservation or admission check
    # ever bound.
    peak_held: int = 0


class Simulator:
    def __init__(self, setup: ReplicaSetup, cluster: ClusterConfig, cost: CostModel, trace_batches: bool = False,
                 ttft_limit: tuple[float, int] | None = None, tbt_limit: tuple[float, int] | None = None) -> None:
        """`ttft_limit` (seconds, count): stop the run once `count` requests have waited longer than
        `seconds` for their first token (a deployment search has then lost its TTFT SLO);
        `tbt_limit` (seconds, count): once `count` gaps between tokens were longer than `seconds`."""
        if cost.num_stages != cluster.pp:
            raise ValueError(f"cost model has {cost.num_stages} stages but the cluster has pp={cluster.pp}")
        self.setup, self.cluster, self.cost = setup, cluster, cost
        self.trace_batches = trace_batches
        self.ttft_limit = ttft_limit
        self.tbt_limit = tbt_limit

    def run(self, workload: Workload, progress=None) -> SimResult:
        """Simulate `workload` to its end; `progress` (a tqdm bar or None) advances per finished request."""
        if workload.max_seq_len > self.setup.max_seq_len:
            raise ValueError(f"workload has a {workload.max_seq_len}-token request but max_seq_len is "
                             f"{self.setup.max_seq_len}")
        return _Run(self, workload, progress).run()


# ---- a replica: its schedulers and its pipeline ---------------------------------------------------


class _SchedulerSlot:
    """One scheduler feeding a replica's pipeline, with at most `max_in_flight` of its batches in flight.

    `max_held`: late binding (virtual engines): the scheduler is handed dispatched requests only
    while it holds fewer than that. `batch_cap`: each planned batch holds at most that many requests
    (`Scheduler.schedule(max_requests=...)`).
    """

    __slots__ = ("sched", "max_in_flight", "in_flight", "max_held", "batch_cap")

    def __init__(self, setup: ReplicaSetup, max_num_seqs: int, max_in_flight: int, max_held: int | None = None,
                 batch_cap: int | None = None) -> None:
        config = SchedulerConfig(policy=setup.policy, max_num_seqs=max_num_seqs, chunk_size=setup.chunk_size,
                                 tile_size=setup.tile_size, max_num_batched_tokens=setup.max_num_batched_tokens)
        blocks = BlockManager(max_num_seqs * cdiv(setup.max_seq_len, setup.block_size), setup.block_size, "reserve")
        self.sched = make_scheduler(config, blocks)
        self.max_in_flight, self.in_flight = max_in_flight, 0
        self.max_held, self.batch_cap = max_held, batch_cap

    def has_room(self) -> bool:
        """Whether the scheduler should be handed one more dispatched request now."""
        if self.max_held is not None:
            return self.sched.num_requests < self.max_held
        if self.batch_cap is not None:
            # A capped plan looks at no more than batch_cap waiting requests, the queue's head, so keeping
            # that many queued plans the same batches as queueing them all, without copying a long queue.
            return len(self.sched.waiting) < self.batch_cap
        return True


class _Pipeline:
    """A replica's FIFO stages: when each is free again, and what its last micro-batch was."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.free = [0.0] * num_stages
        self.used = [False] * num_stages
        self.busy = [0.0] * num_stages
        self.last_prefill = [False] * num_stages  # whether the last micro-batch held prompt tokens
        self.last_cause = [0] * num_stages  # main PB class of the last micro-batch's wait there
        self.last_wait = [0.0] * num_stages  # how long that micro-batch waited there

    def advance(self, ready: float, times: list[float], hop: float, last_hop: float,
                has_prefill: bool) -> tuple[float, float, list[float], float]:
        """Run a micro-batch, ready at `ready`, through the stages: `times[s]` on stage s, `hop` from one
        stage to the next and `last_hop` from the last back to the scheduler.

        Returns (when it is back, its wait in front of busy stages, that wait per [PB1, PB2, PB3],
        the idle time of the stages that waited for it).
        """
        free, used, busy, last_pre = self.free, self.used, self.busy, self.last_prefill
        last_cause, last_wait = self.last_cause, self.last_wait
        last = self.num_stages - 1
        arrive = ready
        wait = idle = 0.0
        by_class = [0.0, 0.0, 0.0]
        for s in range(self.num_stages):
            f = free[s]
            if f > arrive:  # queued behind the stage's last micro-batch, the holder
                d = f - arrive
                wait += d
                lp = last_pre[s]
                own = 0 if (lp and has_prefill) else (2 if not (lp or has_prefill) else 1)  # PB1, PB3, PB2
                inherited = min(d, last_wait[s])  # the holder's own queueing, passed on in its class
                if inherited > 0:
                    by_class[last_cause[s]] += inherited
                if d > inherited:
                    by_class[own] += d - inherited
                last_cause[s] = last_cause[s] if inherited * 2 >= d else own
                last_wait[s] = d
                start = f
            else:
                if used[s]:
                    idle += arrive - f
                start = arrive
                last_wait[s] = 0.0
            t = times[s]
            end = start + t
            free[s] = end
            used[s] = True
            last_pre[s] = has_prefill
            busy[s] += t
            arrive = end + (hop if s < last else last_hop)
        return arrive, wait, by_class, idle


class _Replica:
    """One model replica: its scheduler(s), its pipeline, and the requests dispatched to it."""

    def __init__(self, index: int, setup: ReplicaSetup, cluster: ClusterConfig, cost: CostModel) -> None:
        self.index = index
        self.cost = cost.for_replica()  # a cost model may price a batch by the ones this replica ran before
        pp, cap = cluster.pp, setup.batch_cap
        if cluster.pp_scheduling == "virtual-engines":  # one scheduler per micro-batch slot
            self.slots = [_SchedulerSlot(setup, cap, 1, max_held=cap) for _ in range(pp)]
        else:  # one shared pool of pp * B requests
            capped = cluster.pp_scheduling == "shared-capped"
            self.slots = [_SchedulerSlot(setup, cap * pp, pp, batch_cap=cap if capped else None)]
        self.one_batch_per_slot = all(slot.max_in_flight == 1 for slot in self.slots)
        self.pipeline = _Pipeline(pp)
        self.pending: deque[Request] = deque()  # dispatched here, not yet handed to a scheduler
        self.in_flight = 0  # micro-batches
        self.outstanding = 0  # requests dispatched and not finished (least-loaded dispatch)
        self.flops = 0.0
        self.peak_held = 0  # the most requests one of its schedulers held at once

    def plan(self, slot: _SchedulerSlot) -> Batch | None:
        """Hand `slot` the pending requests it has room for and plan its next batch (None: none now)."""
        sched, pending = slot.sched, self.pending
        num_pending = len(pending)
        while pending and slot.has_room():
            sched.add_request(pending.popleft())
        if len(pending) < num_pending:  # only handing requests over raises what the scheduler holds
            self.peak_held = max(self.peak_held, sched.num_requests)
        if not sched.has_unfinished():
            return None
        batch = sched.schedule(slot.batch_cap)
        if batch:
            return batch
        if slot.in_flight == 0 and self.in_flight == 0 and not pending:
            raise RuntimeError(f"scheduler {sched.name} planned an empty batch with nothing in flight")
        return None


# ---- what a run measures --------------------------------------------------------------------------


class _Tally:
    """Per-request times and bubbles, per-batch sizes, token gaps. Plain lists: indexing them is
    several times cheaper than indexing numpy arrays."""

    def __init__(self, requests: list[Request], trace_batches: bool, late_after_s: float = float("inf"),
                 slow_gap_s: float = float("inf")) -> None:
        n = len(requests)
        self.index = {r: i for i, r in enumerate(requests)}  # Request -> its row (requests hash by identity)
        self.first = [np.nan] * n
        self.last_token = [-1.0] * n
        self.finish = [np.nan] * n
        self.bubble = [0.0] * n
        self.pb = ([0.0] * n, [0.0] * n, [0.0] * n)
        self.idle = [0.0] * n
        self.tbt: list[float] = []
        self.sizes: list[int] = []
        self.tokens: list[int] = []
        self.prefill_tokens: list[int] = []
        self.traced: list | None = [] if trace_batches else None
        self.arrival = [r.arrival_time for r in requests]
        self.late_after_s = late_after_s
        self.late = 0  # requests whose first token came more than late_after_s after their arrival
        self.slow_gap_s = slow_gap_s
        self.slow_gaps = 0  # gaps between two tokens of a request longer than slow_gap_s

    def issued(self, replica: int, batch: Batch, rows: list[PlanRow]) -> bool:
        """Record a planned batch; returns whether it holds prompt tokens."""
        num_tokens = num_prefill = 0
        for num, _, is_prefill in rows:
            num_tokens += num
            if is_prefill:
                num_prefill += num
        self.sizes.append(len(rows))
        self.tokens.append(num_tokens)
        self.prefill_tokens.append(num_prefill)
        if self.traced is not None:
            self.traced.append((replica, [(e.request.request_id, e.start, e.num_tokens) for e in batch.entries]))
        return num_prefill > 0

    def charge(self, batch: Batch, wait: float, by_class: list[float], idle: float) -> None:
        """Charge a micro-batch's wait (and the stage idle time before it) to each of its requests."""
        index, bubble, charged = self.index, self.bubble, self.idle
        pb1, pb2, pb3 = self.pb
        w1, w2, w3 = by_class
        for e in batch.entries:
            j = index[e.request]
            bubble[j] += wait
            pb1[j] += w1
            pb2[j] += w2
            pb3[j] += w3
            charged[j] += idle

    def returned(self, batch: Batch, now: float) -> dict[str, int]:
        """Record the tokens a batch back at `now` yields; returns them (all token 0) for on_batch_done."""
        index, first, last, tbt = self.index, self.first, self.last_token, self.tbt
        sampled = {}
        for e in batch.entries:
            if e.samples:
                req = e.request
                sampled[req.request_id] = 0
                j = index[req]
                prev = last[j]
                if prev >= 0.0:
                    gap = now - prev
                    tbt.append(gap)
                    if gap > self.slow_gap_s:
                        self.slow_gaps += 1
                else:
                    first[j] = now
                    if now - self.arrival[j] > self.late_after_s:
                        self.late += 1
                last[j] = now
        return sampled

    def finished(self, requests: list[Request], now: float) -> None:
        for r in requests:
            self.finish[self.index[r]] = now

    def result(self, workload: Workload, makespan: float, replicas: list[_Replica]) -> SimResult:
        n = len(workload)
        return SimResult(
            num_requests=n, makespan_s=makespan, arrival_s=workload.arrival_s.copy(),
            first_token_s=np.array(self.first), finish_s=np.array(self.finish), bubble_s=np.array(self.bubble),
            bubble_pb_s=np.array(self.pb).T.reshape(n, 3), stage_idle_s=np.array(self.idle),
            tbt_s=np.asarray(self.tbt), batch_sizes=np.asarray(self.sizes), batch_tokens=np.asarray(self.tokens),
            batch_prefill_tokens=np.asarray(self.prefill_tokens),
            stage_busy_s=np.array([r.pipeline.busy for r in replicas]), flops=sum(r.flops for r in replicas),
            num_preemptions=sum(e.sched.num_preemptions for r in replicas for e in r.slots),
            peak_held=max(r.peak_held for r in replicas),
            batches=self.traced if self.traced is not None else [],
        )


# ---- the event loop -------------------------------------------------------------------------------


def _make_requests(workload: Workload) -> list[Request]:
    """One Request per workload row, id = row; prompts of one length share a token list (ids never matter)."""
    prompts: dict[int, list[int]] = {}
    requests = []
    for i in range(len(workload)):
        p = int(workload.prompt_len[i])
        ids = prompts.get(p)
        if ids is None:
            ids = prompts[p] = [0] * p
        params = SamplingParams(max_tokens=int(workload.decode_len[i]), ignore_eos=True)
        requests.append(Request(str(i), ids, params, arrival_time=float(workload.arrival_s[i])))
    return requests


class _Run:
    """One simulation: events (arrivals, micro-batch returns) in time order, the replicas, the tally."""

    def __init__(self, sim: Simulator, workload: Workload, progress) -> None:
        cluster = sim.cluster
        self.workload, self.progress = workload, progress
        self.pp = cluster.pp
        self.return_latency = cluster.pp_link()[1] if cluster.pp > 1 else 0.0
        self.round_robin = cluster.dispatch == "round-robin"
        self.next_replica = 0
        self.replicas = [_Replica(i, sim.setup, cluster, sim.cost) for i in range(cluster.replicas)]
        self.requests = _make_requests(workload)
        late_after_s, self.max_late = sim.ttft_limit or (float("inf"), 0)
        slow_gap_s, self.max_slow_gaps = sim.tbt_limit or (float("inf"), 0)
        self.tally = _Tally(self.requests, sim.trace_batches, late_after_s, slow_gap_s)
        self.stopped_early = False
        # (time, sequence number, kind, data): the sequence number keeps ties in push order.
        self.events = [(float(t), i, _ARRIVAL, i) for i, t in enumerate(workload.arrival_s)]
        heapq.heapify(self.events)
        self.seq = len(self.events)
        self.done = 0
        self.makespan = 0.0

    def run(self) -> SimResult:
        events = self.events
        while events:
            now, _, kind, data = heapq.heappop(events)
            if kind == _ARRIVAL:
                self.dispatch(data, now)
            else:
                self.on_return(now, *data)
        n = len(self.requests)
        if self.done != n and not self.stopped_early:
            raise RuntimeError(f"simulation ended with {n - self.done} of {n} requests unfinished")
        result = self.tally.result(self.workload, self.makespan, self.replicas)
        result.stopped_early = self.stopped_early
        return result

    def dispatch(self, i: int, now: float) -> None:
        """Send request `i` to a replica. Once every arrival at this instant is placed, replicas plan."""
        replicas = self.replicas
        if self.round_robin:
            replica = replicas[self.next_replica]
            self.next_replica = (self.next_replica + 1) % len(replicas)
        else:
            replica = min(replicas, key=lambda r: (r.outstanding, r.index))
        replica.outstanding += 1
        replica.pending.append(self.requests[i])
        events = self.events
        if events and events[0][0] == now and events[0][2] == _ARRIVAL:
            return
        for r in replicas:
            if r.pending or r.in_flight == 0:
                self.issue(r, now)

    def issue(self, replica: _Replica, now: float) -> None:
        """Plan and launch micro-batches until `replica` has pp in flight or no scheduler has one to run."""
        pp, slots, pending = self.pp, replica.slots, replica.pending
        while replica.in_flight < pp:
            launched = False
            for slot in slots:
                if slot.in_flight >= slot.max_in_flight or not (pending or slot.sched.has_unfinished()):
                    continue
                batch = replica.plan(slot)
                if batch is not None:
                    self.launch(replica, slot, batch, now)
                    launched = True
                    if replica.in_flight >= pp:
                        return
            # Slots of one batch each (virtual engines) are all planned in one pass: a launch changes
            # nothing another slot plans from.
            if not launched or replica.one_batch_per_slot:
                return

    def launch(self, replica: _Replica, slot: _SchedulerSlot, batch: Batch, now: float) -> None:
        """Price a planned batch, run it through the replica's stages and schedule its return."""
        rows = batch.plan()
        times, hop, flops = replica.cost.batch_cost(rows)
        replica.flops += flops
        has_prefill = self.tally.issued(replica.index, batch, rows)
        back, wait, by_class, idle = replica.pipeline.advance(now, times, hop, self.return_latency, has_prefill)
        if wait or idle:
            self.tally.charge(batch, wait, by_class, idle)
        slot.in_flight += 1
        replica.in_flight += 1
        heapq.heappush(self.events, (back, self.seq, _RETURN, (replica, slot, batch)))
        self.seq += 1

    def on_return(self, now: float, replica: _Replica, slot: _SchedulerSlot, batch: Batch) -> None:
        """A micro-batch is back: its scheduler updates its requests, and the replica plans again."""
        slot.in_flight -= 1
        replica.in_flight -= 1
        finished = slot.sched.on_batch_done(batch, self.tally.returned(batch, now))
        if finished:
            self.tally.finished(finished, now)
            replica.outstanding -= len(finished)
            self.done += len(finished)
            if self.progress is not None:
                self.progress.update(len(finished))
        self.makespan = now
        tally = self.tally
        if (self.max_late and tally.late >= self.max_late) or (self.max_slow_gaps and tally.slow_gaps >= self.max_slow_gaps):
            self.events.clear()  # an SLO is lost: nothing more to learn from this run
            self.stopped_early = True
            return
        self.issue(replica, now)
