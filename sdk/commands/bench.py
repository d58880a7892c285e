"""``dsedge bench BUNDLE``: measure a bundle's latency on this device and judge it against its latency budget.

Prints the device and backend really used first (like trtexec / perf_analyzer), then one row per batch size:
latency min/mean/p50/p90/p95/p99/max in ms, throughput, and pass/fail at the chosen percentile.
Exit codes: 0 every batch size within budget (and no regression), 1 over budget or regressed vs ``--compare``,
2 usage error (bad option, missing/corrupt bundle, unknown variant, a batch size the bundle cannot take, a
``--compare`` baseline with no result to compare with).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import click

from . import provider_list

from ..runtime.errors import BenchError
from ..runtime.params import FiniteFloat
from ..runtime.schema import dumps

from ..runtime import bench as core
from ..runtime.bench_load import check_iterations
from ..runtime.files import check_output_file, write_bytes_atomic
from ..runtime.errors import DsedgeError
from .bench_output import plot_cdf, pyplot, render_report

log = logging.getLogger("dsedge")


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


def _notes(profile: Any, session: Any, device: dict[str, Any] | None = None) -> list[str]:
    """Say so when the numbers cannot be the target's: a GPU target's bundle measured without a GPU; on Jetson,
    clocks not locked, a capped power mode or a hot module (runtime/jetson.py)."""
    notes = list(((device or {}).get("jetson") or {}).get("warnings", []))
    gpu_target = profile is not None and (profile.backend == "tensorrt" or profile.compute_capability is not None)
    if gpu_target and not core.uses_gpu(session):
        notes.insert(0, f"bundle is for {profile.name} ({profile.backend}) but ran here on "
                        f"{', '.join(session.providers)}: these are not {profile.name} figures")
    return notes


@click.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--variant", default=None, help="Variant to measure (default: the manifest's default variant).")
@click.option("--batch", "batches", default="1", show_default=True, callback=parse_batches,
              help="Comma-separated batch sizes, e.g. 1,8,32.")
@click.option("--seq-len", type=click.IntRange(min=1), default=None,
              help="Tokens per sequence for text models (default: the bundle's optimum shape, else 128).")
@click.option("--duration", "duration_s", type=FiniteFloat(min=0, min_open=True, max=86400), default=None,
              help="Seconds of timed runs per batch size (default 3).")
@click.option("--iterations", type=click.IntRange(min=1, max=1_000_000), default=None, help="Timed runs per batch size (instead of --duration).")
@click.option("--warmup", type=click.IntRange(min=0, max=100_000), default=10, show_default=True, help="Untimed runs first.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU intra-op threads (default: ONNX Runtime's).")
@click.option("--providers", default=None, help="Comma-separated ORT providers (default: TensorRT → CUDA → CPU, whichever exist).")
@click.option("--budget-ms", type=FiniteFloat(max=3.6e6), default=None,
              help="Latency budget in ms (default: the manifest's, else the target profile's).")
@click.option("--percentile", default="p99", show_default=True, help="Percentile judged against the budget: p50/p90/p95/p99.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="Token ids are drawn from [0, N) (default: the manifest's vocab_size, else 100).")
@click.option("--concurrency", type=click.IntRange(min=1, max=256), default=1, show_default=True,
              help="Closed-loop clients calling the session at once (each sends its next request on its answer).")
@click.option("--inputs", "inputs_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A folder of .npz files named like the inputs: real inputs instead of synthetic ones.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report (schema dsedge.bench-report/1) instead of the table.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the JSON report here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write latency CDFs per batch size to this PNG.")
@click.option("--compare", "baseline", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A baseline report (from --json / -o): exit 1 if a percentile regressed beyond --tolerance.")
@click.option("--tolerance", type=FiniteFloat(min=0), default=0.10, show_default=True,
              help="Allowed slowdown vs --compare as a fraction (0.10 = 10 %).")
@click.pass_context
def bench(ctx: click.Context, bundle: Path, variant: str | None, batches: list[int], seq_len: int | None,
          duration_s: float | None, iterations: int | None, warmup: int, threads: int | None, providers: str | None,
          budget_ms: float | None, percentile: str, vocab_size: int | None, concurrency: int,
          inputs_dir: Path | None, as_json: bool, output: Path | None, plot: Path | None, baseline: Path | None,
          tolerance: float) -> None:
    """Measure BUNDLE's latency per batch size and check it against its latency budget."""
    from .. import __version__
    from ..session import load

    if duration_s is not None and iterations is not None:
        raise click.UsageError("pass --duration or --iterations, not both")
    check_iterations(iterations, concurrency)  # before seconds of loading the bundle
    # a path that can never be written (a directory, a file in the way, a file of a bundle: -o BUNDLE/report.json
    # would break its sha256) fails before measuring, not after
    for option, path in (("-o/--output", output), ("--plot", plot)):
        if path is not None:
            check_output_file(path, option, "report.json" if option != "--plot" else "cdf.png")
    if output and plot and output.resolve() == plot.resolve():
        raise click.UsageError(f"-o and --plot are the same file {str(output)!r}: the plot would replace the report")
    if plot:
        pyplot()  # a missing matplotlib fails before seconds of measuring, with nothing written
    settings = core.BenchSettings(warmup=warmup, iterations=iterations, duration_s=duration_s, percentile=percentile)
    base = core.load_report(baseline) if baseline else None  # a bad baseline fails before minutes of measuring
    session = load(bundle, variant=variant, threads=threads, instances=1,  # run() only: one backend
                   providers=provider_list(providers))
    if seq_len is not None and not any(isinstance(d, str) for i in session.inputs for d in i.shape[1:]):
        session.close()  # e.g. a CNN or an MLP: --seq-len would be recorded in the report but change nothing
        raise click.UsageError(f"--seq-len {seq_len}: the bundle's inputs have no variable axis besides the batch "
                               f"({', '.join(f'{i.name} {list(i.shape)}' for i in session.inputs)}); drop --seq-len")
    profile = _target_profile(session.manifest)
    budget, source = core.resolve_budget(budget_ms, session.manifest, profile.default_budget_ms if profile else None)
    real, tiled = None, []
    if inputs_dir is not None:
        from ..runtime.bench_load import read_inputs_dir
        from ..runtime.golden import count_rows

        real = read_inputs_dir(inputs_dir, session.inputs)
        rows = count_rows(real)  # of the batched inputs: a rank-0 one (e.g. temperature) is one value, no rows
        short = [str(b) for b in batches if b > rows]
        if rows and short:  # said before measuring, and kept in the report's notes: these batches repeat rows
            tiled = [f"--inputs {str(inputs_dir)!r} holds {rows} row{'s' * (rows != 1)}, fewer than batch size "
                     f"{', '.join(short)}: the rows are repeated to fill each batch"]
            log.warning("%s", tiled[0])
    results = core.bench_session(session, batches, seq_len, settings, budget, vocab_size, inputs=real,
                                 inputs_label=str(inputs_dir) if inputs_dir else "synthetic", concurrency=concurrency)
    report = core.build_report(session, results, settings, seq_len=seq_len, threads=threads, budget_source=source,
                               dsedge_version=__version__)
    report["settings"].update({"concurrency": concurrency, "inputs": str(inputs_dir) if inputs_dir else "synthetic"})
    report["notes"] += tiled + _notes(profile, session, report["device"])
    for n in report["notes"]:
        if "Jetson clocks" in n:
            log.warning("%s", n)
    comparisons = core.compare_reports(report, base, tolerance, settings.percentile) if base else []
    if comparisons and all(c.baseline_ms is None for c in comparisons):  # a gate that compared nothing never passes
        raise BenchError(f"nothing compared with {str(baseline)!r}: {comparisons[0].unmatched}",
                         "measure with the baseline's variant, batch sizes, --seq-len and --concurrency, or write a "
                         "new baseline with -o")
    if comparisons:
        dev, bdev = report["device"], base.get("device", {})
        same = all(dev.get(k) == bdev.get(k) for k in ("cpu", "gpu", "providers"))
        report["comparison"] = {"baseline": str(baseline), "tolerance": tolerance, "same_device": same,
                                "baseline_device": {k: bdev.get(k) for k in ("host", "cpu", "gpu", "providers")},
                                "results": [c.to_dict() for c in comparisons],
                                "regressed": any(c.regressed for c in comparisons)}
    text = dumps("bench-report", report, BenchError, "bench report")
    if output:
        write_bytes_atomic(output, (text + "\n").encode())
    if plot:
        plot_cdf(results, plot, title=f"{report['bundle']['name']} / {report['bundle']['variant']} on "
                                       f"{report['device']['gpu'] or report['device']['cpu']}")
    if as_json:
        click.echo(text)
    else:
        render_report(report, comparisons)
    failed = report["passed"] is False or any(c.regressed for c in comparisons)
    ctx.exit(1 if failed else 0)
