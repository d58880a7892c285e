"""``dsedge build`` as a recipe: the stages of :mod:`dsedge.toolchain.stages`, called in order, each a function
from artifact to artifact.

validate the config → resolve the source → export fp32 ONNX (+ parity) → read calibration / held-out inputs →
[prune / fine-tune / QAT the torch source and re-export it; only with ``--prune`` or ``--qat-steps``] → compress
(the precision asked, or ``auto``'s measured choice) → fit the target's opset → validate vs the original fp32 →
measure CPU latency → engine recipe → report → write the bundle atomically.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

from ..runtime.storage import storage_errors
from .config import BuildConfig, plan_build
from .stages.compress import compress
from .stages.engine_recipe import engine_recipe
from .stages.export import export
from .stages.finetune import finetune
from .stages.fit import fit
from .stages.inputs import read_inputs
from .stages.measure import measure
from .stages.report import assemble_report
from .stages.runner import StageRunner
from .stages.source import resolve
from .stages.validate import validate
from .stages.workdir import workdir
from .stages.write import write

BuildOptions = BuildConfig  # the name earlier versions exported


@dataclass
class BuildResult:
    bundle: Path
    report: dict[str, Any]


@storage_errors("dsedge build")
def build(config: BuildConfig, log: Callable[[str], None] = lambda s: None,
          progress: Callable[[str], ContextManager[Any]] | None = None) -> BuildResult:
    """Run every stage and publish the bundle. Returns its path and the report (also in ``report.json``).

    ``log`` receives one line per decision as it is made; ``progress(stage)`` (a context manager) wraps each stage.

    Raises:
        TargetError / PrecisionNotSupported / ConfigError / SourceError / CalibrationError / QuantizationError /
            AccuracyGateError: bad input, with nothing written to ``config.out_dir`` except, at most, the empty
            directory itself.
    """
    run = StageRunner(progress)
    plan = run("check config", plan_build, config)
    source = run("resolve source", resolve, plan, log)  # a bad --model is refused before any progress line
    log(f"target {plan.target.name}: precision "
        + (plan.precision if config.precision != "auto" else "auto (candidates built and measured below)"))
    with workdir(plan.config.out_dir) as work:
        model = run("export", export, plan, source, work, log, timing="export_s")
        model = run("read inputs", read_inputs, plan, model)
        model = run("fine-tune", finetune, plan, model, work, log, timing="compensate_s" if plan.finetuning else None)
        choice = run("compress", compress, plan, model, work, log, timing="compress_s")
        opsets = run("fit to target", fit, plan, model, choice)
        log(f"fitted to {plan.target.name}: opset {opsets[choice.precision]}")
        variants, warnings = run("validate", validate, plan, model, choice, opsets, log, timing="validate_s")
        variants = run("measure latency", measure, plan, model, choice, variants, timing="validate_s")
        recipe = run("engine recipe", engine_recipe, plan, model, variants, work)
        if plan.config.dla_core is not None:  # --dla asked for, and a variant will not run there: said here too
            for name, lines in recipe.notes.items():
                for line in lines:
                    if "DLA" in line:
                        log(f"note: {name}: {line}")
        report = assemble_report(plan, model, choice, opsets, variants, recipe, warnings, run.timings, run.started)
        dest = run("write bundle", write, plan, model, variants, recipe, report)
    log(f"wrote {dest}")
    return BuildResult(dest, report)
