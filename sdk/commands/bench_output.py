"""What ``dsedge bench`` prints and draws: the rich report table and the latency-CDF plot."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..runtime import bench as core
from ..runtime.errors import DsedgeError


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, imported only here (a device image may lack it): ``bench`` calls it
    before measuring, so a missing matplotlib fails at once. Raises DsedgeError if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DsedgeError("--plot needs matplotlib, which is not installed", 'pip install "dsedge[samples]" or drop --plot') from None
    return plt


def plot_cdf(results: Sequence[core.BatchResult], path: Path, title: str = "") -> None:
    """Write latency CDFs (one line per batch size) with the budget as a vertical line to a PNG.

    Raises DsedgeError if matplotlib is missing (see ``pyplot``).
    """
    plt = pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = np.sort(np.asarray(r.samples_ms))
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, ys, where="post", label=f"batch {r.batch} ({r.percentile} {r.latency_ms[r.percentile]:.2f} ms)")
    budget = next((r.budget_ms for r in results if r.budget_ms is not None), None)
    if budget is not None:
        ax.axvline(budget, color="red", linestyle="--", label=f"budget {budget:g} ms")
    pct = core.PERCENTILES[results[0].percentile] / 100 if results else 0.99
    ax.axhline(pct, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")  # a budget far above the latencies would squash linear curves against the axis
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda x, _: f"{x:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:.0e}"[0] in "25" else ""))
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of runs ≤ latency")
    ax.set_ylim(0, 1.01)
    ax.set_title(title or "dsedge bench: latency CDF")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def render_report(report: dict[str, Any], comparisons: Sequence[core.Comparison] = (), console: Any = None) -> None:
    """Print the report through rich: device and versions first, then a table with one row per batch size, then the
    verdict (and the comparison with a baseline)."""
    from rich.console import Console
    from rich.table import Table

    import shutil

    # the table has 13 columns: never narrower than 130 (piped output would otherwise be cut to 80 columns)
    c = console or Console(soft_wrap=True, highlight=False, width=max(130, shutil.get_terminal_size((130, 24)).columns))
    say = lambda s: c.print(s, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    dev, b, s = report["device"], report["bundle"], report["settings"]
    say(f"bundle   : {b['path']}  ({b['name']}, target {b['target']}, variant {b['variant']} / {b['precision']})")
    say(f"device   : {dev['cpu']} ({dev['cpu_count']} CPUs), {dev['platform']}")
    say(f"gpu      : {dev['gpu'] or '-'}   tensorrt: {dev['tensorrt'] or '-'}")
    say(f"backend  : {dev['backend']} (onnxruntime {dev['onnxruntime']}), providers in use: {', '.join(dev['providers'])}")
    jet = dev.get("jetson")
    if jet:
        mode = jet.get("power_mode") or {}
        tg = jet.get("tegrastats") or {}
        gpu, emc = tg.get("gpu") or {}, tg.get("emc") or {}
        say(f"jetson   : power mode {mode.get('name', '?')} ({mode.get('id', '?')}), clocks locked "
            f"{ {True: 'yes', False: 'NO', None: 'unknown'}[jet.get('clocks_locked')] }, GPU {gpu.get('mhz', '?')} MHz, "
            f"EMC {emc.get('mhz', '?')} MHz")
    for n in report.get("notes", []):
        say(f"note     : {n}")
    how = f"{s['iterations']} iterations" if s["iterations"] else f"{s['duration_s'] or 3.0:g} s per batch size"
    budget = f"{s['budget_ms']:g} ms at {s['percentile']} (from {s['budget_source']})" if s["budget_ms"] else "none"
    say(f"settings : warmup {s['warmup']}, {how}, threads {s['threads'] or 'default'}, seq-len {s['seq_len'] or 'auto'}, "
        f"concurrency {s.get('concurrency', 1)}, inputs {s.get('inputs', 'synthetic')}, budget {budget}")
    t = Table(title="latency in ms")
    for col in ("batch", "shape", "n", "min", "mean", "p50", "p90", "p95", "p99", "max", "infer/s", "samples/s",
                "verdict"):
        t.add_column(col, justify="left" if col in ("shape", "verdict") else "right")
    for r in report["results"]:
        lat, thr = r["latency_ms"], r["throughput"]
        shape = "x".join(str(d) for d in max(r["shapes"].values(), key=len)) if r["shapes"] else "-"
        verdict = "-" if r["passed"] is None else ("[green]PASS[/]" if r["passed"] else "[red]FAIL[/]")
        t.add_row(str(r["batch"]), shape, str(r["iterations"]),
                  *(f"{lat[k]:.3f}" for k in ("min", "mean", "p50", "p90", "p95", "p99", "max")),
                  f"{thr['inferences_per_s']:.1f}", f"{thr['samples_per_s']:.1f}", verdict)
    c.print(t)
    if comparisons:
        cmp = report.get("comparison", {})
        say(f"compared with baseline {cmp.get('baseline', '')} ({comparisons[0].percentile}, "
            f"tolerance {comparisons[0].tolerance:.0%})")
        if cmp and not cmp.get("same_device", True):
            bd = cmp["baseline_device"]
            say(f"note: the baseline was measured on other hardware ({bd.get('gpu') or bd.get('cpu')}, "
                f"{', '.join(bd.get('providers') or [])})")
        for cp in comparisons:
            if cp.baseline_ms is None:
                say(f"{cp.batch:>5}  {cp.unmatched or 'no baseline'}")
            else:
                tag = "REGRESSED" if cp.regressed else "ok"
                say(f"{cp.batch:>5}  {cp.baseline_ms:8.3f} → {cp.current_ms:8.3f} ms  ×{cp.ratio:.3f}  {tag}")
    if report["passed"] is None:
        say("no latency budget: measured, not judged (pass --budget-ms)")
    else:
        failed = [r for r in report["results"] if r["passed"] is False]
        if failed:
            say("FAIL: " + "; ".join(f"batch {r['batch']} {r['percentile']} {r['latency_ms'][r['percentile']]:.3f} ms > "
                                     f"{r['budget_ms']:g} ms" for r in failed))
        else:
            say(f"PASS: every batch size within {s['budget_ms']:g} ms at {s['percentile']}")
    regressed = [cp for cp in comparisons if cp.regressed]
    if regressed:
        say("REGRESSION: " + "; ".join(f"batch {cp.batch} {cp.percentile} ×{cp.ratio:.3f}" for cp in regressed))
