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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request
from charioteer.sampling_params import SamplingParams
from charioteer.scheduling import make_scheduler
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


class SimRequest(Request):
    """A Request whose hot length properties skip a few nested property calls.

    Same state, same results as Request's own properties (test_sim_engine checks both agree); the
    schedulers read these hundreds of thousands of times per simulated run.
    """

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        n = len(self.output_token_ids)
        return n == 0 or len(self.prompt_token_ids) + n - self.num_computed_tokens > 1


class _Slot:
    __slots__ = ("sched", "cap", "limit", "in_flight")

    def __init__(self, sched, cap: int, limit: int) -> None:
        self.sched, self.cap, self.limit, self.in_flight = sched, cap, limit, 0


class _Replica:
    def __init__(self, index: int, setup: ReplicaSetup, cluster: ClusterConfig, num_stages: int) -> None:
        self.index = index
        self.pp = cluster.pp
        virtual = cluster.pp_scheduling == "virtual-engines"
        n_slots = self.pp if virtual else 1
        cap = setup.batch_cap if virtual else setup.batch_cap * self.pp
        self.slots = []
        for _ in range(n_slots):
            config = SchedulerConfig(policy=setup.policy, max_num_seqs=cap, chunk_size=setup.chunk_size,
                                     tile_size=setup.tile_size, max_num_batched_tokens=setup.max_num_batched_tokens)
            blocks = BlockManager(cap * cdiv(setup.max_seq_len, setup.block_size), setup.block_size, "reserve")
            self.slots.append(_Slot(make_scheduler(config, blocks), cap, 1 if virtual else self.pp))
        self.virtual = virtual
        # "shared-capped": the simulator holds each planned batch to `batch_cap` requests (see issue()).
        self.batch_cap = setup.batch_cap if cluster.pp_scheduling == "shared-capped" else None
        self.pending: list[Request] = []  # dispatched here, not yet handed to a scheduler (virtual engines)
        self.pending_head = 0
        self.in_flight = 0
        self.outstanding = 0  # dispatched and not finished (least-loaded dispatch)
        self.stage_free = [0.0] * num_stages
        self.stage_used = [False] * num_stages
        self.stage_last_prefill = [False] * num_stages
        self.stage_last_cause = [0] * num_stages  # main PB class of the last micro-batch's wait at each stage
        self.stage_last_wait = [0.0] * num_stages  # how long that micro-batch waited there
        self.stage_busy = [0.0] * num_stages
        self.stage_idle = [0.0] * num_stages
        self.flops = 0.0


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


class Simulator:
    def __init__(self, setup: ReplicaSetup, cluster: ClusterConfig, cost: CostModel, trace_batches: bool = False,
                 fast_requests: bool = True) -> None:
        if cost.num_stages != cluster.pp:
            raise ValueError(f"cost model has {cost.num_stages} stages but the cluster has pp={cluster.pp}")
        self.setup, self.cluster, self.cost = setup, cluster, cost
        self.trace_batches = trace_batches
        self.request_class = SimRequest if fast_requests else Request

    def run(self, workload: Workload, progress=None) -> SimResult:
        setup, cluster, cost = self.setup, self.cluster, self.cost
        n = len(workload)
        if workload.max_seq_len > setup.max_seq_len:
            raise ValueError(f"workload has a {workload.max_seq_len}-token request but max_seq_len is {setup.max_seq_len}")
        pp = cluster.pp
        replicas = [_Replica(i, setup, cluster, pp) for i in range(cluster.replicas)]
        prompts: dict[int, list[int]] = {}
        requests = []
        for i in range(n):
            p = int(workload.prompt_len[i])
            ids = prompts.get(p)
            if ids is None:
                ids = prompts[p] = [0] * p
            req = self.request_class(str(i), ids, SamplingParams(max_tokens=int(workload.decode_len[i]), ignore_eos=True),
                                     arrival_time=float(workload.arrival_s[i]))
            req.sim_index = i  # the simulator's own bookkeeping; schedulers never read it
            requests.append(req)
        # Plain lists: indexing them is several times cheaper than indexing numpy arrays.
        first = [np.nan] * n
        last_tok = [-1.0] * n
        finish = [np.nan] * n
        bubble = [0.0] * n
        pb1, pb2, pb3 = [0.0] * n, [0.0] * n, [0.0] * n
        idle_charged = [0.0] * n
        tbt: list[float] = []
        sizes: list[int] = []
        tokens: list[int] = []
        prefill_tokens: list[int] = []
        traced: list = []
        heap: list = []
        seq = 0
        for i in range(n):
            heap.append((float(workload.arrival_s[i]), seq, _ARRIVAL, i))
            seq += 1
        heapq.heapify(heap)
        rr = 0
        done = 0
        makespan = 0.0
        ret_lat = cluster.pp_link()[1] if pp > 1 else 0.0

        def issue(rep: _Replica, now: float) -> None:
            nonlocal seq
            progressed = True
            while rep.in_flight < pp and progressed:
                progressed = False
                for slot in rep.slots:
                    if rep.in_flight >= pp:
                        break
                    if slot.in_flight >= slot.limit:
                        continue
                    sched = slot.sched
                    # Late binding: a virtual engine takes new requests only while it has room for them.
                    hidden = None
                    if rep.batch_cap is not None:
                        # Workaround (SchedulerConfig has no per-batch cap apart from max_num_seqs): show the
                        # scheduler at most batch_cap ready requests, hiding the rest as if in flight, and
                        # hand it waiting requests only up to the room left in this batch.
                        cap_b = rep.batch_cap
                        ready = [r for r in sched.running if not r.in_flight]
                        hidden = ready[cap_b:]
                        for r in hidden:
                            r.in_flight = True
                        room = cap_b - min(len(ready), cap_b) - len(sched.waiting)
                        while room > 0 and rep.pending_head < len(rep.pending):
                            sched.add_request(rep.pending[rep.pending_head])
                            rep.pending_head += 1
                            room -= 1
                    else:
                        while rep.pending_head < len(rep.pending) and (not rep.virtual or sched.num_requests < slot.cap):
                            sched.add_request(rep.pending[rep.pending_head])
                            rep.pending_head += 1
                    if not sched.has_unfinished():
                        continue
                    batch = sched.schedule()
                    if hidden:
                        for r in hidden:
                            r.in_flight = False
                    if not batch:
                        if slot.in_flight == 0 and rep.in_flight == 0 and rep.pending_head == len(rep.pending):
                            raise RuntimeError(f"scheduler {sched.name} planned an empty batch with nothing in flight")
                        continue
                    entries = batch.entries
                    plan = [(e.num_tokens, e.start, e.is_prefill) for e in entries]
                    times, p2p, flops = cost.batch_cost(plan)
                    rep.flops += flops
                    ntok = 0
                    npre = 0
                    for num, _, is_prefill in plan:
                        ntok += num
                        if is_prefill:
                            npre += num
                    sizes.append(len(entries))
                    tokens.append(ntok)
                    prefill_tokens.append(npre)
                    if self.trace_batches:
                        traced.append((rep.index, [(e.request.request_id, e.start, e.num_tokens) for e in entries]))
                    has_prefill = npre > 0
                    arrive = now
                    wait = 0.0
                    w = [0.0, 0.0, 0.0]
                    idle = 0.0
                    free, used, last_pre = rep.stage_free, rep.stage_used, rep.stage_last_prefill
                    last_cause, last_wait = rep.stage_last_cause, rep.stage_last_wait
                    for s in range(pp):
                        f = free[s]
                        if f > arrive:
                            d = f - arrive
                            wait += d
                            lp = last_pre[s]
                            own = 0 if (lp and has_prefill) else (2 if not (lp or has_prefill) else 1)
                            inherited = min(d, last_wait[s])  # the holder's own queueing, passed on
                            if inherited > 0:
                                w[last_cause[s]] += inherited
                            if d > inherited:
                                w[own] += d - inherited
                            last_cause[s] = last_cause[s] if inherited * 2 >= d else own
                            last_wait[s] = d
                            start = f
                        else:
                            if used[s]:
                                gap = arrive - f
                                idle += gap
                                rep.stage_idle[s] += gap
                            start = arrive
                            last_wait[s] = 0.0
                        t = times[s]
                        end = start + t
                        free[s] = end
                        used[s] = True
                        last_pre[s] = has_prefill
                        rep.stage_busy[s] += t
                        arrive = end + p2p if s < pp - 1 else end + ret_lat
                    if wait or idle:
                        for e in entries:
                            j = e.request.sim_index
                            bubble[j] += wait
                            pb1[j] += w[0]
                            pb2[j] += w[1]
                            pb3[j] += w[2]
                            idle_charged[j] += idle
                    slot.in_flight += 1
                    rep.in_flight += 1
                    heapq.heappush(heap, (arrive, seq, _RETURN, (rep, slot, batch)))
                    seq += 1
                    progressed = True

        while heap:
            now, _, kind, data = heapq.heappop(heap)
            if kind == _ARRIVAL:
                if cluster.dispatch == "round-robin":
                    rep = replicas[rr]
                    rr = (rr + 1) % len(replicas)
                else:
                    rep = min(replicas, key=lambda r: (r.outstanding, r.index))
                rep.outstanding += 1
                rep.pending.append(requests[data])
                # Arrivals at one instant are all dispatched before any batch is planned.
                if heap and heap[0][0] == now and heap[0][2] == _ARRIVAL:
                    continue
                for r in replicas:
                    if r.pending_head < len(r.pending) or r.in_flight == 0:
                        issue(r, now)
                continue
            rep, slot, batch = data
            slot.in_flight -= 1
            rep.in_flight -= 1
            sampled = {}
            for e in batch.entries:
                if e.samples:
                    req = e.request
                    sampled[req.request_id] = 0
                    j = req.sim_index
                    prev = last_tok[j]
                    if prev >= 0.0:
                        tbt.append(now - prev)
                    else:
                        first[j] = now
                    last_tok[j] = now
            finished = slot.sched.on_batch_done(batch, sampled)
            for r in finished:
                finish[r.sim_index] = now
                rep.outstanding -= 1
            if finished:
                done += len(finished)
                if progress is not None:
                    progress.update(len(finished))
            makespan = now
            issue(rep, now)

        if done != n:
            raise RuntimeError(f"simulation ended with {n - done} of {n} requests unfinished")
        return SimResult(
            num_requests=n, makespan_s=makespan, arrival_s=workload.arrival_s.copy(), first_token_s=np.array(first),
            finish_s=np.array(finish), bubble_s=np.array(bubble), bubble_pb_s=np.array([pb1, pb2, pb3]).T.reshape(n, 3),
            stage_idle_s=np.array(idle_charged),
            tbt_s=np.asarray(tbt), batch_sizes=np.asarray(sizes), batch_tokens=np.asarray(tokens),
            batch_prefill_tokens=np.asarray(prefill_tokens),
            stage_busy_s=np.array([r.stage_busy for r in replicas]), flops=sum(r.flops for r in replicas),
            num_preemptions=sum(s.sched.num_preemptions for r in replicas for s in r.slots), batches=traced,
        )
