"""``dsedge build``."""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, ContextManager, Iterator

import click
from click.core import ParameterSource

from ...runtime.errors import DsedgeError
from ...runtime.params import OptionalValueCommand


@click.command("build", cls=OptionalValueCommand)
@click.option("--target", "-t", default="jetson", show_default=True,
              help="Target name or alias (jetson, cpu, …) or a profile file ./my-device.toml.")
@click.option("--model", "-m", default=None,
              help="ONNX file, Hugging Face model dir, training run dir, or module:function. Default: the reference "
                   "model all-MiniLM-L6-v2.")
@click.option("--out", "out_dir", default="out", show_default=True, type=click.Path(file_okay=False),
              help="Output directory; the bundle is OUT/NAME-TARGET.dse.")
@click.option("--precision", "-p", default="auto", show_default=True,
              type=click.Choice(["auto", "int4", "int8", "fp16", "bf16", "fp32"]),
              help="Model precision; auto = the best the target supports.")
@click.option("--fallback", is_flag=True, help="If the target lacks --precision, fall back int4 → int8 → fp16.")
@click.option("--calib", type=click.Path(exists=True, file_okay=False), default=None,
              help="Directory of .npz files with real inputs (first half calibrates, second half validates; with "
                   "--heldout, all of it calibrates).")
@click.option("--heldout", type=click.Path(exists=True, file_okay=False), default=None,
              help="Directory of .npz files with held-out real inputs, never calibrated on: accuracy vs fp32 is "
                   "measured on them.")
@click.option("--block-size", default=None, type=click.Choice(["16", "32", "64", "128"]),
              help="INT4 weights per scale along K. Default: 32 on ONNX Runtime targets, 64 on TensorRT ones (whose "
                   "INT4 takes 64 or 128 only).")
@click.option("--algorithm", type=click.Choice(["auto", "rtn", "awq", "gptq", "awq+gptq"]), default="auto",
              show_default=True, help="INT4 algorithm (AWQ arXiv:2306.00978, GPTQ arXiv:2210.17323); auto = gptq "
                                      "when there is calibration data, else rtn.")
@click.option("--accuracy-gate", "accuracy_gate", default=None,
              help="METRIC:THRESHOLD[,…], e.g. cosine:0.99: raise the most sensitive layers (INT4 → INT8 → float) "
                   "until it passes on held-out data. Metrics: cosine, cosine-min, top1 (argmax agreement of a "
                   "classifier's output; nearest-neighbour agreement of a sentence encoder's embeddings).")
@click.option("--gate-output", "gate_output", default=None, metavar="NAME",
              help="The model output whose accuracy vs fp32 the build judges (auto's choice, the accuracy table, "
                   "--accuracy-gate). Default: sentence_embedding for a sentence encoder, else the first batched output.")
@click.option("--no-embeddings", is_flag=True, help="Keep embedding tables in fp32 (INT4 only).")
@click.option("--no-fp32", is_flag=True, help="Do not ship the fp32 variant beside the compressed one.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Intra-op threads for the build-time latency measurement (default: the thread count of one serving instance on this machine, e.g. 1 on 2 cores, where the runtime serves on 2 x 1-thread instances).")
@click.option("--budget-ms", type=float, default=None,
              help="The bundle's default latency budget per request, ms (what load() and serve use when a request "
                   "names none, and what bench and the latency tests judge against). Default: the target's.")
@click.option("--dla", "dla_core", type=int, default=None,
              help="Use this DLA core in the engine recipe (targets with DLA; falls back to GPU where DLA cannot run).")
@click.option("--engine", is_flag=True,
              help="Also build the TensorRT engine into engines/ (needs TensorRT and the target's GPU here).")
@click.option("--prune", "prune", default=None, metavar="SPEC",
              help="Prune the torch source before export: channels:FRACTION (FFN hidden channels, global target, "
                   "e.g. channels:0.3) or 2:4 (targets with sparse tensor cores: a100, h100, jetson-orin); then "
                   "fine-tune to the unpruned teacher.")
@click.option("--finetune-steps", "finetune_steps", type=click.IntRange(min=0), default=None,
              help="Distillation fine-tune steps after --prune on the calibration inputs [default: 500; 0 = none].")
@click.option("--qat-steps", "qat_steps", type=click.IntRange(min=0), default=0, is_flag=False, flag_value=500,
              show_default=True,
              help="INT4 fake-quant fine-tune (QAT) steps before export, with --precision int4 (0 = off; "
                   "--qat-steps alone = 500).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the build report as JSON on stdout (last thing printed); a failed build prints "
                   '{"ok": false, "error": ..., "hint": ..., "type": ...} instead.')
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="A build.toml ([build] table, the keys of these options); flags given here override it.")
@click.pass_context
def build(ctx: click.Context, target: str, model: str | None, out_dir: str, precision: str, fallback: bool,
          calib: str | None, heldout: str | None, block_size: str, algorithm: str, accuracy_gate: str | None,
          no_embeddings: bool, no_fp32: bool, threads: int | None, budget_ms: float | None, dla_core: int | None,
          engine: bool, prune: str | None, finetune_steps: int | None, qat_steps: int, gate_output: str | None,
          as_json: bool, config_file: str | None) -> None:
    """Export, compress, validate and bundle a model for a target."""
    from rich.console import Console

    from .. import pipeline
    from ..report import compensation_lines, summary_table

    quiet = ctx.meta.get("dsedge.verbosity", 0) < 0
    console = Console(stderr=as_json)
    logged: set[str] = set()

    def log(line: str) -> None:
        logged.add(line)
        if not quiet:
            console.print(f"[dim]·[/dim] {line}")
    try:
        config = config_from_flags(ctx, config_file, model=model, target=target, out_dir=out_dir,
                                   precision=precision, calib=calib, heldout=heldout, fallback=fallback,
                                   block_size=int(block_size) if block_size is not None else None,
                                   algorithm=algorithm, accuracy_gate=accuracy_gate, embeddings=not no_embeddings,
                                   keep_fp32=not no_fp32, threads=threads, budget_ms=budget_ms, dla_core=dla_core,
                                   engine=engine, prune=prune, finetune_steps=finetune_steps, qat_steps=qat_steps,
                                   gate_output=gate_output)
        with stage_progress(console, enabled=not quiet) as progress:
            result = pipeline.build(config, log=log, **({"progress": progress} if progress else {}))
    except DsedgeError as e:  # --json: stdout still holds one JSON object; the error line goes to stderr as always
        if as_json:
            click.echo(json.dumps(failure_record(e)))
        raise
    console.print(summary_table(result.report))
    for line in compensation_lines(result.report):
        console.print(line)
    if not quiet:
        for note in result.report["notes"]:
            if note not in logged:  # a decision already said as it was made (e.g. auto's choice) is not said twice
                console.print(f"note: {note}")
    console.print(f"validated on {result.report['validation']['inputs']}; "
                  f"build wall time {result.report['wall_time_s']:.1f} s; bundle: {result.bundle}")
    if as_json:
        click.echo(json.dumps({"ok": True, **result.report}, default=str))


def failure_record(err: DsedgeError) -> dict[str, Any]:
    """What ``dsedge build --json`` prints on stdout for a failed build: ``ok`` false, the one-line ``error``, its
    ``hint``, the error class as ``type`` (e.g. ``AccuracyGateError``) and the process ``exit_code``."""
    return {"ok": False, "error": str(err), "hint": err.hint, "type": type(err).__name__, "exit_code": err.exit_code}




def config_from_flags(ctx: click.Context, config_file: str | None, **values: Any) -> Any:
    """The ``BuildConfig``: ``--config`` file first, then every flag given on the command line over it (flags left
    at their defaults do not override the file)."""
    from ..config import BuildConfig, read_config_file

    if config_file is None:
        return BuildConfig(**values)
    base = read_config_file(config_file)
    given = {}
    for param in (p.name for p in ctx.command.params):
        source = ctx.get_parameter_source(param) if param else None
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            field = {"no_embeddings": "embeddings", "no_fp32": "keep_fp32"}.get(param, param)
            if field in values:
                given[field] = values[field]
    return base.replace(**given)


@contextlib.contextmanager
def stage_progress(console: Any, enabled: bool = True) -> Iterator[Callable[[str], ContextManager[Any]] | None]:
    """One spinner line under the build's log: the running stage's name and elapsed time (rich), and a ``✓ stage
    N.N s`` line for each stage that took over a second. Yields None (no display) when ``console`` is not a terminal
    (CI, a pipe, a file) or not ``enabled`` (``--quiet``)."""
    if not (enabled and console.is_terminal):
        yield None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("starting", total=None)

        @contextlib.contextmanager
        def show(stage: str) -> Iterator[None]:
            bar.reset(task, description=stage)
            t = time.perf_counter()
            yield
            dt = time.perf_counter() - t
            if dt >= 1.0:
                console.print(f"[green]✓[/green] {stage} [dim]{dt:.1f} s[/dim]")

        yield show
