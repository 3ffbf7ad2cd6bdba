"""report.md, summary.json and PNG plots for a set of simulation runs."""
from __future__ import annotations

import json
import os

import numpy as np

from charioteer.sim.runner import PAPER_FIG12, RunOutput


def _fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay out a matplotlib figure, write it to out_dir/name (120 dpi) and close it; returns `name`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=120)
    plt.close(fig)
    return name


def _bubble_cdf(outputs: list[RunOutput], out_dir: str, plt) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for o in outputs:
        if o.spec.cluster.pp > 1:
            x = np.sort(o.result.bubble_s)
            ax.plot(x, np.arange(1, x.size + 1) / x.size, label=o.spec.name)
    ax.set_xlabel("pipeline bubble time per request (s)")
    ax.set_ylabel("CDF")
    ax.set_title("Bubble time per request (cf. paper Fig. 12a)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out_dir, "fig12a_bubble_cdf.png")


def _completion_bars(outputs: list[RunOutput], out_dir: str, plt, paper: bool) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    names = [o.spec.name for o in outputs]
    ours = [o.summary["completion_time_s"] for o in outputs]
    xs = np.arange(len(names))
    width = 0.38 if paper else 0.6
    ax.bar(xs - (width / 2 if paper else 0), ours, width, label="Charioteer sim")
    if paper:
        paper_vals = [PAPER_FIG12["completion_time_s"].get(n) for n in names]
        ax.bar(xs + width / 2, [v or 0 for v in paper_vals], width, label="paper (approx.)")
    ax.set_xticks(xs, names)
    ax.set_ylabel("completion time (s)")
    ax.set_title("Completion time (cf. paper Fig. 12b)")
    ax.legend()
    return save_figure(fig, out_dir, "fig12b_completion.png")


def _batch_sizes(outputs: list[RunOutput], out_dir: str, plt) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for o in outputs:
        s = o.result.batch_sizes
        ax.hist(s, bins=np.arange(0.5, s.max() + 1.5), histtype="step", density=True, label=o.spec.name)
    ax.set_xlabel("requests per batch")
    ax.set_ylabel("fraction of batches")
    ax.legend()
    return save_figure(fig, out_dir, "batch_sizes.png")


def write_plots(outputs: list[RunOutput], out_dir: str, paper: bool = False) -> list[str]:
    """Figure 12a-style bubble CDF, 12b-style completion bars, batch-size distribution. Returns file names."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; the JSON and report.md are not
        return []
    files = []
    if any(o.spec.cluster.pp > 1 for o in outputs):
        files.append(_bubble_cdf(outputs, out_dir, plt))
    files.append(_completion_bars(outputs, out_dir, plt, paper))
    files.append(_batch_sizes(outputs, out_dir, plt))
    return files


def report_markdown(payload: dict) -> str:
    lines = ["# Charioteer simulation report", ""]
    if payload.get("preset"):
        lines += [f"Preset: `{payload['preset']}`", ""]
    w = payload.get("workload", {})
    if w:
        lines += ["Workload: " + ", ".join(f"{k}={v}" for k, v in w.items() if v is not None), ""]
    lines += ["| run | scheduler | tp x pp x replicas | batch cap | completion (s) | median bubble (s) | "
              "PB1/PB2/PB3 mean (s) | TTFT p50 (s) | TBT p50/p99 (ms) | E2E p50 (s) | mean batch | stage busy % | MFU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["runs"]:
        pb = r["bubble_pb_mean_s"]
        lines.append(
            f"| {r['name']} | {r['scheduler']} | {r['tp']}x{r['pp']}x{r['replicas']} | {r['batch_cap']} | "
            f"{r['completion_time_s']:.1f} | {r['median_bubble_s']:.2f} | "
            f"{pb['PB1']:.2f}/{pb['PB2']:.2f}/{pb['PB3']:.2f} | {_fmt(r['ttft_s']['p50'])} | "
            f"{r['tbt_s']['p50'] * 1e3:.1f}/{r['tbt_s']['p99'] * 1e3:.1f} | {_fmt(r['e2e_s']['p50'], 1)} | "
            f"{r['batch_size']['mean']:.1f} | {r['mean_stage_busy_pct']:.1f} | {r['mfu'] * 100:.1f}% |")
    cmp = payload.get("comparison")
    if cmp:
        lines += ["", "## Against the paper (Figure 12)", "", "| quantity | ours | paper |", "|---|---|---|"]
        for k, v in cmp["ours"].items():
            lines.append(f"| {k} | {v:.2f} | {cmp['paper'][k]} |")
        for r in payload["runs"]:
            paper_t = PAPER_FIG12["completion_time_s"].get(r["name"])
            if paper_t:
                lines.append(f"| completion {r['name']} (s) | {r['completion_time_s']:.0f} | ~{paper_t:.0f} |")
        lines += ["", "Acceptance checks (issue 5): " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in cmp["acceptance"].items())]
        lines += ["", "Parameters are datasheet values with documented efficiency factors (charioteer/sim/specs.py); "
                  "none was fitted to the paper's numbers."]
    if payload.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in payload["plots"]]
    lines += ["", f"Simulated in {payload.get('wall_s', 0):.1f} s of wall time.", ""]
    return "\n".join(lines)


def write_outputs(payload: dict, outputs: list[RunOutput], out_dir: str, paper: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    payload["plots"] = write_plots(outputs, out_dir, paper=paper)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(report_markdown(payload))
