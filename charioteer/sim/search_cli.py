"""`charioteer simulate --search`: the deployment search from the command line."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from charioteer.sim.search import (SLO, SearchJob, SearchSpace, best_config, candidates, run_search,
                                   unit_poisson_arrivals)
from charioteer.sim.search_report import pareto_plot, search_table
from charioteer.sim.specs import ClusterConfig, hardware_spec, model_shape
from charioteer.sim.workload import WorkloadSpec, make_workload

# What `--search --preset paper-fig12` searches unless flags say otherwise: the paper's model on up to 64 A100s.
FIG12_SEARCH = {"model": "gpt3-175b", "hardware": "a100-80gb", "devices": 64}


def _max_seq_len(args, wspec: WorkloadSpec, longest: int) -> int:
    """KV reserved per request: --max-seq-len, else the longest request (or the synthetic lengths' maximum)."""
    if args.max_seq_len is not None:
        return args.max_seq_len
    synthetic = wspec.lengths != "trace" and wspec.prompt_len is None
    return max(longest, wspec.max_len) if synthetic else longest


def build_job(args, cluster: ClusterConfig, wspec: WorkloadSpec) -> tuple[SearchJob, SearchSpace, dict]:
    """The search's job and space from the flags (the preset's defaults where a flag is unset)."""
    preset = FIG12_SEARCH if args.preset == "paper-fig12" else {"model": "llama-13b", "hardware": "a100-80gb",
                                                                  "devices": 8}
    slo = SLO(args.slo_ttft, args.slo_tbt)
    model = model_shape(args.model or preset["model"])
    hardware = hardware_spec(args.hardware or preset["hardware"])
    space = SearchSpace(args.devices or preset["devices"], args.search_tp, args.search_pp, args.search_policies,
                        args.search_chunk_sizes, args.search_batch_caps, args.search_min_batch_cap)
    workload = make_workload(wspec)
    job = SearchJob(model, hardware, cluster, workload.prompt_len, workload.decode_len,
                    unit_poisson_arrivals(len(workload), args.seed), _max_seq_len(args, wspec, workload.max_seq_len),
                    slo, cost_table=args.cost_table, rel_tol=args.search_tolerance)
    described = (f"trace {os.path.basename(wspec.trace)}" if wspec.lengths == "trace" else
                 f"{wspec.lengths} lengths {wspec.min_len}-{wspec.max_len}, P:D {wspec.pd_ratio:g}")
    return job, space, {"workload": described, "workload_spec": dataclasses.asdict(wspec)}


def cmd_search(args, cluster: ClusterConfig, wspec: WorkloadSpec, t0: float) -> int:
    from tqdm import tqdm

    job, space, about = build_job(args, cluster, wspec)
    found, skipped = candidates(job, space)
    if not found:
        raise ValueError("no configuration fits: " + "; ".join(skipped or ["no tp x pp within --devices"]))
    workers = args.workers or os.cpu_count() or 1
    with tqdm(total=len(found), unit="config", desc="searching", file=sys.stderr, disable=args.no_progress) as bar:
        configs = run_search(job, found, workers=workers, progress=bar)
    payload = {"preset": args.preset, "model": job.model.name, "hardware": job.hardware.name, "devices": space.devices,
               "slo": dataclasses.asdict(job.slo), "num_requests": len(job.prompt_len), **about,
               "rel_tol": job.rel_tol, "workers": workers, "best": best_config(configs), "configs": configs,
               "skipped": skipped}
    if args.plot:
        pareto_plot(payload, args.plot)
    payload["wall_s"] = time.perf_counter() - t0
    if args.json:
        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        print(search_table(payload))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0
