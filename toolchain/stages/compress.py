"""Stage ``compress``: the chosen precision's compressor, or with ``--precision auto`` the measured choice among
the target's candidates (``auto.choose_auto``); the decision is logged once it is made."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from ..artifacts import Choice, Prepared
from ..config import BuildPlan
from ..gates import gate_summary
from .compressors import COMPRESSORS, check_converted, float_layers_note
from .auto import choose_auto


def compress(plan: BuildPlan, model: Prepared, work: Path, log: Callable[[str], None]) -> Choice:
    """Compress ``model.exported`` to the plan's precision (fp32: the export, fused for ONNX Runtime when it can
    be: ``compress_fp32``).

    A quantizing precision (int4, int8) that converted no layer of the model is an error when it was asked for, and
    a skipped candidate under ``auto`` (said in the notes); where it converted only some layers, the log line says
    which op types stayed float (the variant's notes say it too).

    Raises:
        CalibrationError / QuantizationError / AccuracyGateError: from the compressor; QuantizationError when the
            precision asked for quantized no layer.
    """
    cfg, target = plan.config, plan.target
    if cfg.precision != "auto":
        precision = plan.precision
        compressed = check_converted(COMPRESSORS[precision](model.exported, work, plan, model.source),
                                     model.source, asked=True, target=plan.target)
        choice = Choice(precision, compressed, notes=plan.notes)
    else:
        reference = model.reference
        if plan.finetuning:  # a pruned/QAT student: auto judges the compression of the student itself
            reference = work / "student-fp32.onnx"
            shutil.copyfile(model.exported.path, reference)
        precision, measured, record = choose_auto(plan, model.exported, reference, work, model.source,
                                                  model.validation, log)
        if plan.finetuning:
            record["rule"] += " vs the pruned/fine-tuned fp32 student (variants report accuracy vs the original)"
        how = "by measured latency" if target.auto_by_latency else "as the first accurate precision"
        skipped = [c["precision"] for c in record["candidates"] if not c.get("qualifies")]
        notes = [f"auto chose {precision} for {target.name} {how} ({record['rule']})"
                 + (f"; rejected: {', '.join(skipped)}" if skipped else "")]
        if target.auto_by_latency:                 # the measured timings that decided it
            notes.append(record["why"])
        notes += [f"auto skipped {c['precision']}: {c['skipped']}" for c in record["candidates"] if "skipped" in c]
        log(notes[0])
        choice = Choice(precision, measured[precision].compressed, measured, record, tuple(notes))
    if choice.precision != "fp32":
        partial = float_layers_note(choice.precision, choice.compressed.details)
        log(f"compressed to {choice.precision}" + gate_summary(choice.compressed.details)
            + (f"; {partial}" if partial else ""))
    return choice
