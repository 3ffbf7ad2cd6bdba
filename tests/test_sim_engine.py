"""The simulator drives the engine's schedulers exactly as the engine's own loop does."""
import numpy as np
import pytest

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request, SamplingParams
from charioteer.scheduling import SCHEDULER_CLASSES, make_scheduler
from charioteer.sim.cost import FixedCostModel
from charioteer.sim.simulator import ReplicaSetup, Simulator
from charioteer.sim.specs import ClusterConfig
from charioteer.sim.workload import Workload


def _workload(n=25, seed=3):
    rng = np.random.default_rng(seed)
    return Workload(np.zeros(n), rng.integers(3, 40, n), rng.integers(1, 9, n))


def _engine_loop(policy, cap, chunk, wl, max_len):
    """What LLMEngine.step does, with the model replaced by a constant token."""
    config = SchedulerConfig(policy=policy, max_num_seqs=cap, chunk_size=chunk)
    sched = make_scheduler(config, BlockManager(cap * cdiv(max_len, 16), 16, "reserve"))
    for i in range(len(wl)):
        sched.add_request(Request(str(i), [0] * int(wl.prompt_len[i]),
                                  SamplingParams(max_tokens=int(wl.decode_len[i]), ignore_eos=True)))
    seq = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch
        seq.append([(e.request.request_id, e.start, e.num_tokens) for e in batch.entries])
        sched.on_batch_done(batch, {e.request.request_id: 0 for e in batch.entries if e.samples})
    return seq


@pytest.mark.parametrize("policy", sorted(SCHEDULER_CLASSES))
def test_same_batch_sequence_as_engine_loop(policy):
    wl = _workload()
    max_len = int((wl.prompt_len + wl.decode_len).max())
    expected = _engine_loop(policy, 4, 8, wl, max_len)
    sim = Simulator(ReplicaSetup(policy, 4, max_len, chunk_size=8), ClusterConfig(), FixedCostModel(1, 0.01),
                    trace_batches=True)
    result = sim.run(wl)
    assert [b[1] for b in result.batches] == expected
    assert result.makespan_s == pytest.approx(0.01 * len(expected))


def _capped_engine_loop(policy, cap, pp, chunk, wl, max_len):
    """LLMEngine.step with micro_batch_cap: one scheduler holding pp * cap requests, up to pp
    micro-batches of at most cap requests in flight, the oldest returning first."""
    config = SchedulerConfig(policy=policy, max_num_seqs=cap * pp, chunk_size=chunk)
    sched = make_scheduler(config, BlockManager(cap * pp * cdiv(max_len, 16), 16, "reserve"))
    for i in range(len(wl)):
        sched.add_request(Request(str(i), [0] * int(wl.prompt_len[i]),
                                  SamplingParams(max_tokens=int(wl.decode_len[i]), ignore_eos=True)))
    seq, in_flight = [], []
    while sched.has_unfinished():
        while len(in_flight) < pp:
            batch = sched.schedule(max_requests=cap)
            if not batch:
                break
            seq.append([(e.request.request_id, e.start, e.num_tokens) for e in batch.entries])
            in_flight.append(batch)
        batch = in_flight.pop(0)
        sched.on_batch_done(batch, {e.request.request_id: 0 for e in batch.entries if e.samples})
    return seq


@pytest.mark.parametrize("policy", sorted(SCHEDULER_CLASSES))
def test_shared_capped_matches_engine_micro_batch_cap(policy):
    """With equal stage times micro-batches return in issue order, as the engine waits for them; the
    simulator hands requests to the scheduler a few at a time (late binding) and still plans the same."""
    wl = _workload(40)
    max_len = int((wl.prompt_len + wl.decode_len).max())
    expected = _capped_engine_loop(policy, 3, 2, 8, wl, max_len)
    cluster = ClusterConfig(pp=2, pp_scheduling="shared-capped", intra_node_latency=0.0, inter_node_latency=0.0)
    result = Simulator(ReplicaSetup(policy, 3, max_len, chunk_size=8), cluster, FixedCostModel(2, 0.01),
                       trace_batches=True).run(wl)
    assert [b[1] for b in result.batches] == expected
