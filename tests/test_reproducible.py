"""The batch-invariant mode gives the same fp32 bits from process to process, with 1 or 2 threads.

The default mode does not promise that (README "Exactness"): MKL's GEMMs and SDPA may block their
sums differently from one process to another. MKL's strict CNR mode (MKL_CBWR=AUTO,STRICT with
MKL_DYNAMIC and OMP_DYNAMIC off) was this test's subject, but inside full suites on the Xeon one
process of the three kept differing (3 of 6 suites with MKL_CBWR alone, then CI with both switches),
never when run on its own, so it is no longer promised. The batch-invariant mode runs no MKL and no
SDPA, and is.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_GENERATE = """
import json, os, torch
from charioteer import LLM, SamplingParams
from texts import PASSAGE

words = PASSAGE.split()
prompts = [" ".join(words[: 30 + 25 * i]) for i in range(8)]
# Chunks of 40 beside up to 7 decodes: the GEMMs the default mode would hand to MKL's packed sgemm.
llm = LLM(max_num_seqs=8, chunk_size=40, batch_invariant=True)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=1))
setting = {"threads": torch.get_num_threads(), "load": os.getloadavg(), "affinity": sorted(os.sched_getaffinity(0)),
           "env": {k: v for k, v in os.environ.items() if k.startswith(("MKL", "OMP", "KMP", "CHARIOTEER"))}}
print(json.dumps({"logprobs": [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in outs], "setting": setting}))
"""


def test_batch_invariant_fp32_logprobs_are_bitwise_the_same_in_three_processes():
    runs = []
    for threads in ("2", "2", "1"):  # threads split a GEMM's columns, never a sum, so one thread gives the same bits
        env = dict(os.environ, OMP_NUM_THREADS=threads, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
        done = subprocess.run([sys.executable, "-c", _GENERATE], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    # A mismatch names each process's threads, load and environment (a string: pytest shortens a list's repr).
    settings = json.dumps([run["setting"] for run in runs])
    assert runs[0]["logprobs"] == runs[1]["logprobs"] == runs[2]["logprobs"], settings
