"""Pipeline parallelism: two stage processes on loopback (gloo) give the single-process engine's
greedy outputs under every policy; a dead stage fails requests cleanly and leaves no processes."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from charioteer import LLM, SamplingParams
from charioteer.config import EngineArgs
from charioteer.model.loader import load_model
from charioteer.pipeline.executor import PipelineError, split_layers
from texts import prompt_ids

POLICIES = [
    dict(scheduler="sarathi", chunk_size=16),
    dict(scheduler="orca"),
    dict(scheduler="vllm"),
    dict(scheduler="request-level"),
]
NEAR_TIE = 1e-4


def top2_gap(logprobs):
    best = sorted(logprobs.values(), reverse=True)
    return best[0] - best[1]


def assert_same(reference, candidate, label):
    """Token-identical, except after a near-tie (top-2 gap < 1e-4: batch shapes differ, so float sums may)."""
    for i, (ref, out) in enumerate(zip(reference, candidate)):
        assert len(out.token_ids) == len(ref.token_ids), label
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                gap = min(top2_gap(ref.logprobs[step]), top2_gap(out.logprobs[step]))
                assert gap < NEAR_TIE, f"{label}: request {i} token {step} differs ({a} vs {b}), top-2 gap {gap:.2e}"
                break
            assert abs(ref.logprobs[step][a] - out.logprobs[step][b]) < 1e-3, label


def run(model, prompts, params, **config):
    llm = LLM(model, max_num_seqs=4, **config)
    try:
        outputs = llm.generate(prompts, params)
        assert llm.engine.blocks.num_used_blocks == 0
        metrics = llm.engine.pipeline_metrics
        if metrics is not None:
            assert metrics.num_stages == config["pipeline_parallel_size"]
            assert set(metrics.request_bubble_s) == {o.request_id for o in outputs}
            assert all(len(r.stages) == metrics.num_stages for r in metrics.records)
            assert all(v >= 0 for v in metrics.request_bubble_s.values())
        return [o.outputs[0] for o in outputs]
    finally:
        procs = list(llm.engine.executor.procs) if llm.engine.executor else []
        llm.shutdown()
        assert all(not p.is_alive() for p in procs)


def workload(vocab_ids, lengths, max_tokens):
    prompts = [vocab_ids(n, i) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1) for m in max_tokens]
    return prompts, params


@pytest.fixture(scope="module")
def default_workload(default_model):
    return workload(lambda n, i: prompt_ids(default_model.tokenizer, n, offset=13 * i),
                    [5, 41, 17, 70, 3, 29], [6, 3, 8, 4, 7, 5])


@pytest.fixture(scope="module")
def synthetic():
    return load_model("synthetic:tiny,layers=3")  # splits unevenly: layers 0-1 and 2


@pytest.mark.parametrize("config", POLICIES, ids=lambda c: c["scheduler"])
def test_two_stages_match_single_process_default_model(default_model, default_workload, config):
    prompts, params = default_workload
    reference = run(default_model, prompts, params, **config)
    piped = run(default_model, prompts, params, pipeline_parallel_size=2, **config)
    assert_same(reference, piped, f"default model {config}")


@pytest.mark.parametrize("config", POLICIES + [dict(scheduler="orca", micro_batch_cap=2)],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_two_stages_match_single_process_synthetic(synthetic, config):
    prompts, params = workload(lambda n, i: [(7 * i + 3 * j) % 500 + 1 for j in range(n)],
                               [9, 60, 4, 33, 21], [8, 5, 10, 3, 6])
    reference = run(synthetic, prompts, params, **{k: v for k, v in config.items() if k != "micro_batch_cap"})
    piped = run(synthetic, prompts, params, pipeline_parallel_size=2, **config)
    assert_same(reference, piped, f"synthetic {config}")


def test_split_layers_and_bad_sizes():
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(3, 2) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError):
        split_layers(2, 3)
    with pytest.raises(ValueError):
        EngineArgs(pipeline_parallel_size=0)


def _gone(pids, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_peer_lost_errors_are_told_apart():
    from charioteer.pipeline import transport as tp
    # The message gloo gave a stage whose neighbour was SIGKILLed (seen in CI).
    reset = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                         "Read error [127.0.0.1]:6039: Connection reset by peer.")
    assert tp.is_peer_lost(reset)
    assert not tp.is_peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not tp.is_peer_lost(ValueError("gloo Connection reset"))


def test_killed_stage_fails_requests_cleanly(synthetic):
    llm = LLM(synthetic, scheduler="sarathi", chunk_size=8, max_num_seqs=4, pipeline_parallel_size=2)
    engine = llm.engine
    pids = [p.pid for p in engine.executor.procs]
    for n in (30, 12, 50):
        engine.add_request(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage 1 .* died with exit code -9 \(SIGKILL\)"):
        while True:
            engine.step()
    assert time.monotonic() - start < 5
    assert not engine.has_unfinished_requests()  # every request ended (aborted), none hangs
    assert _gone(pids)
    with pytest.raises(PipelineError, match="pipeline is down"):
        engine.step()
    llm.shutdown()  # idempotent after a failure


def test_killed_driver_takes_its_stages_along(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from charioteer import LLM
        llm = LLM("synthetic:tiny", pipeline_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm.engine.executor.procs), flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert _gone(pids)
