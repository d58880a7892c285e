"""``dsedge bench BUNDLE``: measure a bundle's latency on this device and judge it against its latency budget.

Prints the device and backend really used first (like trtexec / perf_analyzer), then one row per batch size:
latency min/mean/p50/p90/p95/p99/max in ms, throughput, and pass/fail at the chosen percentile.
Exit codes: 0 every batch size within budget (and no regression), 1 over budget or regressed vs ``--compare``,
2 usage error (bad option, missing/corrupt bundle, unknown variant, a batch size the bundle cannot take).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import click

from ..runtime.errors import BenchError
from ..runtime.params import FiniteFloat
from ..runtime.schema import dumps

from ..runtime import bench as core
from ..runtime.bundle import usual_mode
from ..runtime.errors import DsedgeError


def parse_batches(ctx: click.Context | None, param: click.Parameter | None, value: str) -> list[int]:
    """``"1,8,32"`` → ``[1, 8, 32]`` (order kept, duplicates dropped). Raises click.BadParameter (exit 2)."""
    out: list[int] = []
    for part in str(value).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            b = int(part)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not an integer; use e.g. --batch 1,8,32") from None
        if b < 1:
            raise click.BadParameter(f"batch size {b} is not positive")
        if b not in out:
            out.append(b)
    if not out:
        raise click.BadParameter("no batch size given; use e.g. --batch 1,8,32")
    return out


def _target_profile(manifest: Any) -> Any:
    from ..targets import get_target

    try:
        return get_target(str(manifest.target.get("name", "")))
    except DsedgeError:  # a bundle for a target this install has no profile for
        return None


def _notes(profile: Any, session: Any) -> list[str]:
    """Say so when the numbers cannot be the target's: a GPU target's bundle measured without a GPU."""
    gpu_target = profile is not None and (profile.backend == "tensorrt" or profile.compute_capability is not None)
    if gpu_target and not core.uses_gpu(session):
        return [f"bundle is for {profile.name} ({profile.backend}) but ran here on {', '.join(session.providers)}: "
                f"these are not {profile.name} figures"]
    return []


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, usual_mode())               # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_cdf(results: Sequence[core.BatchResult], path: Path, title: str = "") -> None:
    """Write latency CDFs (one line per batch size) with the budget as a vertical line to a PNG.

    matplotlib is imported here only (a device image may lack it). Raises DsedgeError if it is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DsedgeError("--plot needs matplotlib, which is not installed", 'pip install "dsedge[samples]" or drop --plot') from None
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


def format_report(report: dict[str, Any], comparisons: Sequence[core.Comparison] = ()) -> str:
    """The human table: device and versions first, then one row per batch size, then the verdict."""
    dev, b, s = report["device"], report["bundle"], report["settings"]
    lines = [
        f"bundle   : {b['path']}  ({b['name']}, target {b['target']}, variant {b['variant']} / {b['precision']})",
        f"device   : {dev['cpu']} ({dev['cpu_count']} CPUs), {dev['platform']}",
        f"gpu      : {dev['gpu'] or '-'}   tensorrt: {dev['tensorrt'] or '-'}",
        f"backend  : {dev['backend']} (onnxruntime {dev['onnxruntime']}), providers in use: {', '.join(dev['providers'])}",
    ]
    lines += [f"note     : {n}" for n in report.get("notes", [])]
    how = f"{s['iterations']} iterations" if s["iterations"] else f"{s['duration_s'] or 3.0:g} s per batch size"
    budget = f"{s['budget_ms']:g} ms at {s['percentile']} (from {s['budget_source']})" if s["budget_ms"] else "none"
    lines.append(f"settings : warmup {s['warmup']}, {how}, threads {s['threads'] or 'default'}, "
                 f"seq-len {s['seq_len'] or 'auto'}, budget {budget}")
    head = (f"{'batch':>5}  {'shape':<14} {'n':>6}  {'min':>8} {'mean':>8} {'p50':>8} {'p90':>8} {'p95':>8} "
            f"{'p99':>8} {'max':>8}  {'infer/s':>9} {'samples/s':>10}  verdict")
    lines += ["", "latency in ms", head, "-" * len(head)]
    for r in report["results"]:
        lat, thr = r["latency_ms"], r["throughput"]
        shape = "x".join(str(d) for d in max(r["shapes"].values(), key=len)) if r["shapes"] else "-"
        verdict = "-" if r["passed"] is None else ("PASS" if r["passed"] else "FAIL")
        lines.append(f"{r['batch']:>5}  {shape:<14} {r['iterations']:>6}  " +
                     " ".join(f"{lat[k]:>8.3f}" for k in ("min", "mean", "p50", "p90", "p95", "p99", "max")) +
                     f"  {thr['inferences_per_s']:>9.1f} {thr['samples_per_s']:>10.1f}  {verdict}")
    if comparisons:
        cmp = report.get("comparison", {})
        lines += ["", f"compared with baseline {cmp.get('baseline', '')} ({comparisons[0].percentile}, "
                      f"tolerance {comparisons[0].tolerance:.0%})"]
        if cmp and not cmp.get("same_device", True):
            bd = cmp["baseline_device"]
            lines.append(f"note: the baseline was measured on other hardware ({bd.get('gpu') or bd.get('cpu')}, "
                         f"{', '.join(bd.get('providers') or [])})")
        for c in comparisons:
            if c.baseline_ms is None:
                lines.append(f"{c.batch:>5}  no baseline with these input shapes")
            else:
                tag = "REGRESSED" if c.regressed else "ok"
                lines.append(f"{c.batch:>5}  {c.baseline_ms:8.3f} → {c.current_ms:8.3f} ms  ×{c.ratio:.3f}  {tag}")
    lines.append("")
    if report["passed"] is None:
        lines.append("no latency budget: measured, not judged (pass --budget-ms)")
    else:
        failed = [r for r in report["results"] if r["passed"] is False]
        if failed:
            lines.append("FAIL: " + "; ".join(
                f"batch {r['batch']} {r['percentile']} {r['latency_ms'][r['percentile']]:.3f} ms > {r['budget_ms']:g} ms"
                for r in failed))
        else:
            lines.append(f"PASS: every batch size within {s['budget_ms']:g} ms at {s['percentile']}")
    regressed = [c for c in comparisons if c.regressed]
    if regressed:
        lines.append("REGRESSION: " + "; ".join(f"batch {c.batch} {c.percentile} ×{c.ratio:.3f}" for c in regressed))
    return "\n".join(lines)


@click.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--variant", default=None, help="Variant to measure (default: the manifest's default variant).")
@click.option("--batch", "batches", default="1", show_default=True, callback=parse_batches,
              help="Comma-separated batch sizes, e.g. 1,8,32.")
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="Tokens per sequence for text models (default: the bundle's optimum shape, else 128).")
@click.option("--duration", "duration_s", type=FiniteFloat(min=0, min_open=True, max=86400), default=None,
              help="Seconds of timed runs per batch size (default 3).")
@click.option("--iterations", type=click.IntRange(min=1), default=None, help="Timed runs per batch size (instead of --duration).")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed runs first.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU intra-op threads (default: ONNX Runtime's).")
@click.option("--providers", default=None, help="Comma-separated ORT providers (default: TensorRT → CUDA → CPU, whichever exist).")
@click.option("--budget-ms", type=FiniteFloat(max=3.6e6), default=None,
              help="Latency budget in ms (default: the manifest's, else the target profile's).")
@click.option("--percentile", default="p99", show_default=True, help="Percentile judged against the budget: p50/p90/p95/p99.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="Token ids are drawn from [0, N) (default: the manifest's vocab_size, else 100).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report (schema dsedge.bench v1) instead of the table.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the JSON report here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write latency CDFs per batch size to this PNG.")
@click.option("--compare", "baseline", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A baseline report (from --json / -o): exit 1 if a percentile regressed beyond --tolerance.")
@click.option("--tolerance", type=FiniteFloat(min=0), default=0.10, show_default=True,
              help="Allowed slowdown vs --compare as a fraction (0.10 = 10 %).")
@click.pass_context
def bench(ctx: click.Context, bundle: Path, variant: str | None, batches: list[int], seq_len: int | None,
          duration_s: float | None, iterations: int | None, warmup: int, threads: int | None, providers: str | None,
          budget_ms: float | None, percentile: str, vocab_size: int | None, as_json: bool, output: Path | None,
          plot: Path | None, baseline: Path | None, tolerance: float) -> None:
    """Measure BUNDLE's latency per batch size and check it against its latency budget."""
    from .. import __version__
    from ..session import load

    if duration_s is not None and iterations is not None:
        raise click.UsageError("pass --duration or --iterations, not both")
    settings = core.BenchSettings(warmup=warmup, iterations=iterations, duration_s=duration_s, percentile=percentile)
    base = core.load_report(baseline) if baseline else None  # a bad baseline fails before minutes of measuring
    session = load(bundle, variant=variant, threads=threads,
                   providers=[p.strip() for p in providers.split(",") if p.strip()] if providers else None)
    profile = _target_profile(session.manifest)
    budget, source = core.resolve_budget(budget_ms, session.manifest, profile.default_budget_ms if profile else None)
    results = core.bench_session(session, batches, seq_len, settings, budget, vocab_size)
    report = core.build_report(session, results, settings, seq_len=seq_len, threads=threads, budget_source=source,
                               dsedge_version=__version__)
    report["notes"] += _notes(profile, session)
    comparisons = core.compare_reports(report, base, tolerance, settings.percentile) if base else []
    if comparisons:
        dev, bdev = report["device"], base.get("device", {})
        same = all(dev.get(k) == bdev.get(k) for k in ("cpu", "gpu", "providers"))
        report["comparison"] = {"baseline": str(baseline), "tolerance": tolerance, "same_device": same,
                                "baseline_device": {k: bdev.get(k) for k in ("host", "cpu", "gpu", "providers")},
                                "results": [c.to_dict() for c in comparisons],
                                "regressed": any(c.regressed for c in comparisons)}
    text = dumps("bench-report", report, BenchError, "bench report")
    if output:
        _write_atomic(output, (text + "\n").encode())
    if plot:
        plot_cdf(results, plot, title=f"{report['bundle']['name']} / {report['bundle']['variant']} on "
                                       f"{report['device']['gpu'] or report['device']['cpu']}")
    click.echo(text if as_json else format_report(report, comparisons))
    failed = report["passed"] is False or any(c.regressed for c in comparisons)
    ctx.exit(1 if failed else 0)
