"""`simulate --search` output: the table of configurations and the Pareto plot."""
from __future__ import annotations

from charioteer.sim.search import pareto_front


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def search_table(payload: dict) -> str:
    """Markdown: the SLOs and workload, then every configuration, best capacity per device first."""
    slo, best = payload["slo"], payload["best"]
    lines = [f"# Deployment search: {payload['model']} on {payload['devices']} x {payload['hardware']}", "",
             f"SLOs: p99 TTFT <= {slo['ttft_p99_s']:g} s, p99 TBT <= {slo['tbt_p99_s'] * 1e3:g} ms; "
             f"{payload['num_requests']} requests ({payload['workload']}), Poisson arrivals, bisection to "
             f"{payload['rel_tol'] * 100:g} % of the rate.", ""]
    if best is None:
        lines.append("No configuration holds the SLOs at any rate tried.")
    else:
        lines.append(f"Best: {_label(best)}: {best['capacity_qps']:.3g} req/s, "
                     f"{best['capacity_per_device']:.3g} req/s per device.")
    lines += ["", "| tp | pp | replicas | policy | C | B | capacity (req/s) | per device | p99 TTFT (ms) "
              "| p99 TBT (ms) | limit |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(payload["configs"], key=lambda r: -r["capacity_per_device"]):
        lines.append(f"| {r['tp']} | {r['pp']} | {r['replicas']} | {r['policy']} | {r['chunk_size'] or '-'} "
                     f"| {r['batch_cap']} | {r['capacity_qps']:.3g} | {r['capacity_per_device']:.3g} "
                     f"| {_ms(r['ttft_p99_s'])} | {_ms(r['tbt_p99_s'])} | {r['limit']} |")
    lines += [f"- skipped {s}" for s in payload["skipped"]]
    lines += ["", "limit: slo = bisection found where the SLOs fail; throughput = they hold even at the "
              "saturation throughput (a longer trace would load it more); slo-unmet = they fail at every rate tried."]
    return "\n".join(lines)


def _label(r: dict) -> str:
    chunk = f" C={r['chunk_size']}" if r["chunk_size"] else ""
    return f"{r['policy']}{chunk} B={r['batch_cap']} TP{r['tp']} x PP{r['pp']} x {r['replicas']} replicas"


def pareto_plot(payload: dict, path: str) -> None:
    """Capacity per device against p99 time between tokens at that capacity, one marker per policy,
    the Pareto front (more capacity for less TBT) joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = [r for r in payload["configs"] if r["capacity_qps"] > 0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in sorted({r["policy"] for r in held}):
        rows = [r for r in held if r["policy"] == policy]
        ax.scatter([r["tbt_p99_s"] * 1e3 for r in rows], [r["capacity_per_device"] for r in rows], label=policy,
                   alpha=0.75)
    front = pareto_front(held)
    ax.plot([r["tbt_p99_s"] * 1e3 for r in front], [r["capacity_per_device"] for r in front], "k--", lw=1,
            label="Pareto front")
    for r in front:
        ax.annotate(f"{r['policy']} TP{r['tp']}xPP{r['pp']} B{r['batch_cap']}", (r["tbt_p99_s"] * 1e3, r["capacity_per_device"]),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(payload["slo"]["tbt_p99_s"] * 1e3, color="grey", lw=0.8, ls=":", label="TBT SLO")
    ax.set_xlabel("p99 time between tokens at capacity (ms)")
    ax.set_ylabel("capacity per device (req/s)")
    ax.set_title(f"{payload['model']} on {payload['devices']} x {payload['hardware']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
