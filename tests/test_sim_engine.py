"""The simulator drives the engine's schedulers exactly as the engine's own loop does."""
import numpy as np
import pytest

from charioteer.config import SchedulerConfig
from charioteer.memory.block_manager import BlockManager, cdiv
from charioteer.request import Request
from charioteer.sampling_params import SamplingParams
from charioteer.scheduling import SCHEDULER_CLASSES, make_scheduler
from charioteer.sim.cost import FixedCostModel
from charioteer.sim.simulator import ReplicaSetup, SimRequest, Simulator
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


def test_sim_request_properties_match_request():
    rng = np.random.default_rng(0)
    for _ in range(300):
        p = int(rng.integers(1, 20))
        a = Request("a", [0] * p, SamplingParams(max_tokens=30, ignore_eos=True))
        b = SimRequest("b", [0] * p, SamplingParams(max_tokens=30, ignore_eos=True))
        outs = int(rng.integers(0, 10))
        computed = int(rng.integers(0, p + outs + 1))
        for req in (a, b):
            req.output_token_ids.extend([0] * outs)
            req.num_computed_tokens = computed
        for prop in ("num_tokens", "num_remaining_tokens", "in_prefill"):
            assert getattr(a, prop) == getattr(b, prop)


def test_fast_and_plain_requests_give_same_result():
    wl = _workload(15)
    max_len = int((wl.prompt_len + wl.decode_len).max())
    runs = [Simulator(ReplicaSetup("sarathi", 3, max_len, chunk_size=8), ClusterConfig(pp=2), FixedCostModel(2, 0.01),
                      trace_batches=True, fast_requests=fast).run(wl) for fast in (True, False)]
    assert runs[0].batches == runs[1].batches
