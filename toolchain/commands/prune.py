"""``dsedge prune``: 2:4 semi-structured sparsity or structured FFN channel pruning.

An ONNX MODEL is pruned on the graph (no fine-tune: ONNX weights are not trained here). A torch MODEL (the reference
model's name, a Hugging Face directory, a training run directory or ``module:function``) is pruned in torch, then
fine-tuned to the unpruned teacher for ``--finetune-steps`` on its calibration inputs (``--calib`` or the source's
own), and exported to ONNX; the report gives held-out accuracy before and after the fine-tune.
"""
from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from ...runtime.params import FiniteFloat
from ...runtime.errors import ConfigError, QuantizationError
from ...runtime.files import atomic_path, check_output_file, check_report_file, write_text_atomic
from .quantize import _load, check_loads_in_ort, save_model_atomic


def _torch_source_calibration(source, calib: Path) -> None:
    """``--calib`` for a torch source: .npz files checked against the source's inputs, split calibrate/validate."""
    from ...runtime.bundle import IOSpec
    from ..npz_inputs import load_calibration_dir

    if not calib.is_dir():
        raise ConfigError(f"--calib {calib}: a torch MODEL's calibration data is a directory of .npz files "
                          f"({'not found' if not calib.exists() else 'this is a file'})",
                          "put the .npz files in a directory and pass it (its first half fine-tunes, the second "
                          "half validates)")
    specs = [IOSpec(n, str(v.dtype), tuple(source.dynamic_axes.get(n, {}).get(i, d) for i, d in enumerate(v.shape)))
             for n, v in source.example_inputs.items()]
    source.calibration, source.validation = load_calibration_dir(calib, specs)
    source.validation_kind = f"--calib {calib} (second half, not used for training)"


def _prune_torch(model: str, output: Path, pattern: str, sparsity: float, steps: int | None,
                 calib: Path | None) -> dict:
    from ..student import PruneSpec, make_student
    from ..config import BuildConfig
    from ..export import export_onnx
    from ..sources import resolve_source

    source = resolve_source(model)
    if source.module is None:
        raise ConfigError(f"{model} is not a torch source", "pass an .onnx path ending in .onnx")
    if calib:
        _torch_source_calibration(source, calib)
    spec = PruneSpec(pattern, 0.5 if pattern == "2:4" else sparsity)
    settings = BuildConfig(prune=str(spec), finetune_steps=steps)
    report = make_student(source, settings, spec, log=lambda s: click.echo(f"  {s}", err=True))
    with atomic_path(output) as tmp:
        exported = export_onnx(source, tmp)
    return {"parity_max_abs_diff": exported.parity_max_abs_diff, **report}


def _refuse_nothing_pruned(source, model: str, report: dict) -> None:  # type: ignore[no-untyped-def]
    """A 2:4 pass that pruned no layer (``report["layers"]`` empty) would write the source again as "pruned".

    Raises:
        QuantizationError: always; the message says why (the model is quantized already, its MatMul/Gemm weights
            have K not a multiple of 4, or it has none).
    """
    from ..quantize.graph import quantized_nodes

    quantized = quantized_nodes(source)
    if quantized:
        ops = sorted({n.op_type for n in quantized})
        raise QuantizationError(f"2:4 sparsity has nothing to prune in {model}: it is quantized already "
                                f"({len(quantized)} {'/'.join(ops)} nodes), and 2:4 prunes float MatMul/Gemm weights",
                                "prune the float model, then quantize the pruned one (dsedge prune, then "
                                "dsedge quantize)")
    skipped = report.get("skipped") or []
    raise QuantizationError(
        f"2:4 sparsity has nothing to prune in {model}: it prunes MatMul/Gemm and Conv weights given as float "
        f"initializers with K (input features; a Conv's input channels per group) a multiple of 4, and the model has "
        + (f"{len(skipped)} with other K (e.g. {skipped[0]!r})" if skipped else "none"),
        "2:4 suits layers with 4k input features or channels (TensorRT --sparsity=enable on A100/Orin); a stem "
        "reading 1-3 image channels cannot take it")


PRUNE_WARN_COSINE = 0.99  # below this (cosine mean vs the source) a prune without fine-tuning gets a warning


def accuracy_vs_source(source: Path, pruned: Path, model, calib: Path | None) -> tuple[dict | None, str]:  # type: ignore[no-untyped-def]
    """The pruned ONNX file against its source (``toolchain.evaluate.compare_models``: cosine per sample of the
    first batched output, …) on up to 64 rows of ``calib`` (a .npz file or a directory of them), else on 8
    synthetic inputs (``runtime.bench.synthetic_inputs``, 32 tokens). Returns (record, what it was measured on); (None, why) when
    it cannot be measured (e.g. synthetic token ids outside the model's vocabulary)."""
    from ...runtime.bench import synthetic_inputs
    from ...runtime.golden import take_rows
    from ...runtime.npz import read_npz
    from ..evaluate import compare_models
    from ..export import io_specs
    from ..npz_inputs import read_npz_dir

    specs, _ = io_specs(model)
    try:
        if calib is not None:
            feeds = read_npz_dir(calib, specs) if Path(calib).is_dir() else dict(read_npz(calib))
            on = f"--calib {calib}"
        else:
            feeds = synthetic_inputs(specs, batch=8, seq_len=32)
            on = "8 synthetic inputs (pass --calib for real ones)"
        feeds = take_rows(feeds, slice(None, 64))  # a rank-0 input goes whole
        return compare_models(source, pruned, feeds), on
    except Exception as e:  # ORT refusing made-up inputs, unreadable data: the prune itself stands
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return None, f"not measured ({first}); pass --calib data the model accepts"


@click.command("prune")
@click.argument("model")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output .onnx path.")
@click.option("--pattern", type=click.Choice(["2:4", "channels"]), default="2:4", show_default=True,
              help="2:4 = zero 2 of every 4 weights along K (A100/Orin sparse tensor cores); channels = remove "
                   "hidden channels of Linear → activation → Linear blocks.")
@click.option("--sparsity", type=FiniteFloat(), default=0.3, show_default=True,
              help="Global fraction of FFN/MLP hidden channels to remove (--pattern channels).")
@click.option("--calib", type=click.Path(path_type=Path),
              help="Calibration data (.npz or dir): activation-aware importance (Wanda) instead of magnitude; for a "
                   "torch MODEL (a directory of .npz) also the fine-tune's data (first half) and held-out set "
                   "(second half).")
@click.option("--finetune-steps", type=int, default=None,
              help="Torch MODEL only: distillation fine-tune steps after pruning [default: 500; 0 = none].")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout (last thing printed).")
@click.pass_context
def prune(ctx: click.Context, model: str, output: Path, pattern: str, sparsity: float, calib: Path | None,
          finetune_steps: int | None, report_path: Path | None, as_json: bool) -> None:
    """Prune MODEL (an .onnx file, or a torch source: all-minilm-l6-v2, a HF directory, a run directory,
    module:function) and write ONNX to --output (written atomically). Torch sources are fine-tuned to the unpruned
    teacher; ONNX files are not (prune the torch model, or use dsedge build --prune, to fine-tune)."""
    from ..prune import prune_onnx

    check_output_file(output)
    if report_path:
        check_report_file(report_path, output, model)
    if pattern == "2:4" and ctx.get_parameter_source("sparsity") in (ParameterSource.COMMANDLINE,
                                                                      ParameterSource.ENVIRONMENT):
        raise ConfigError("--sparsity applies to --pattern channels; 2:4 is always 50 %", "drop --sparsity")
    if pattern == "channels" and not 0.0 < sparsity < 1.0:
        raise ConfigError(f"--sparsity {sparsity} is outside (0, 1)", "e.g. --sparsity 0.3")
    if finetune_steps is not None and finetune_steps < 0:
        raise ConfigError(f"--finetune-steps must be >= 0, got {finetune_steps}", "e.g. --finetune-steps 500")
    if model.lower().endswith(".onnx"):
        if finetune_steps:
            raise ConfigError("--finetune-steps needs a torch MODEL: ONNX weights are not trained here",
                              "pass the torch source (HF directory, run directory, module:function) or drop it")
        source = _load(Path(model))
        out, report = prune_onnx(source, pattern, sparsity, calib if calib else None)
        if not report["layers" if pattern == "2:4" else "blocks"]:
            _refuse_nothing_pruned(source, model, report)
        # as quantize: a pruned graph ORT refuses (a pruner bug) never replaces --output
        save_model_atomic(out, output, check=lambda tmp: check_loads_in_ort(
            tmp, f"the model pruned from {model}", "this is a dsedge bug for this model: report it with the model, "
            "and try --pattern 2:4 or a lower --sparsity meanwhile"))
        acc, on = accuracy_vs_source(Path(model), output, source, calib)
        report["accuracy_vs_source"] = {"on": on, **(acc or {})}
    else:
        report = _prune_torch(model, output, pattern, sparsity, finetune_steps, calib)
        report = {**report.pop("prune"), **report}
    report = {"source": str(model), "output": str(output), **report}
    if report_path:
        write_text_atomic(report_path, json.dumps(report, indent=2) + "\n")
    say = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    if not report["layers" if pattern == "2:4" else "blocks"]:
        click.echo(f"warning: nothing in {model} was pruned: it has no "
                   + ("weight 2:4 sparsity applies to" if pattern == "2:4" else "Linear → activation → Linear block"),
                   err=True)
    if pattern == "2:4":
        say(f"wrote {output}: 2:4 sparsity on {len(report['layers'])} layers"
            + (f" (skipped {len(report['skipped'])})" if report["skipped"] else ""))
    else:
        said = (f" (asked {sparsity:.1%}: each block keeps at least 8 channels, a multiple of 8)"
                if report["sparsity"] < sparsity - 0.005 else "")
        say(f"wrote {output}: {report['sparsity']:.1%} of MLP hidden channels removed in {len(report['blocks'])} "
            f"blocks{said}")
    acc = report.get("accuracy_vs_source")
    if acc and "cosine_mean" in acc:
        say(f"cosine vs the source on {acc['on']}: mean {acc['cosine_mean']:.4f}, min {acc['cosine_min']:.4f}")
        if acc["cosine_mean"] < PRUNE_WARN_COSINE:
            click.echo(f"warning: pruning cost accuracy (cosine mean {acc['cosine_mean']:.4f} < {PRUNE_WARN_COSINE}) "
                       "and an ONNX file is not fine-tuned here: prune the torch source (dsedge prune DIR, or "
                       "dsedge build --prune) to fine-tune, or prune less", err=True)
    elif acc:
        say(f"accuracy vs the source: {acc['on']}")
    if report.get("finetune"):
        b, a = report["heldout_before"], report["heldout_after"]
        say(f"fine-tune {report['finetune']['steps']} steps: held-out cosine mean vs the unpruned model "
            f"{b['cosine_mean']:.4f} → {a['cosine_mean']:.4f}")
    if as_json:
        click.echo(json.dumps(report, default=float))
