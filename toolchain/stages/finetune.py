"""Stage ``finetune`` (``--prune`` / ``--finetune-steps`` / ``--qat-steps``): prune and/or fine-tune the torch
source into a student and re-export it; an ONNX source is pruned on the graph without a fine-tune. Without those
options the model passes through unchanged."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..artifacts import Prepared
from ..student import make_student, prune_onnx_source
from ..config import BuildPlan
from .export import export_with_ranges


def finetune(plan: BuildPlan, model: Prepared, work: Path, log: Callable[[str], None]) -> Prepared:
    """The student (pruned / fine-tuned / QAT-tuned) as the fp32 model to compress; the reference stays the
    original export, so accuracy gates and variants are judged against the original.

    Raises:
        CalibrationError: no calibration inputs to train on. QuantizationError: nothing to prune.
    """
    notes = list(plan.finetune_notes)
    if not plan.finetuning:
        return dataclasses.replace(model, notes=tuple(notes))
    spec, source, exported = plan.prune, model.source, model.exported
    if source.module is not None:
        source = dataclasses.replace(source)          # make_student swaps in the student's module
        compensation = make_student(source, plan.config, spec, log)
        exported = export_with_ranges(source, work / "models" / "fp32.onnx")   # the student
        log(f"exported the fine-tuned student; parity max abs diff {exported.parity_max_abs_diff:.3g}")
    else:
        compensation = {"prune": prune_onnx_source(exported.path, spec, source.calibration)}
        notes.append(f"ONNX source: --prune {spec} applied to the ONNX graph without a fine-tune")
    if spec is not None:
        compensation["prune"]["spec"] = str(spec)
    if source.module is not None:
        notes.append("the fp32 variant is the " + ("pruned, fine-tuned" if spec else "QAT-tuned")
                     + " model; every variant's accuracy is measured against the original fp32 export")
    if spec is not None and spec.pattern == "2:4":
        notes.append("2:4: the engine recipe enables TensorRT's sparse tactics (--sparsity=enable), which run for "
                     "FP16/INT8 GEMMs on sparse tensor cores")
    exported = dataclasses.replace(exported, reference=model.reference)  # gates judge against the original
    return dataclasses.replace(model, source=source, exported=exported, finetune=compensation, notes=tuple(notes))
