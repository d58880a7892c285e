"""Stage ``compress``: the chosen precision's compressor, or with ``--precision auto`` the measured choice among
the target's candidates (``auto.choose_auto``); the decision is logged once it is made."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from ..artifacts import Choice, Prepared
from ..config import BuildPlan
from ..gates import gate_summary
from .compressors import COMPRESSORS
from .auto import choose_auto


def compress(plan: BuildPlan, model: Prepared, work: Path, log: Callable[[str], None]) -> Choice:
    """Compress ``model.exported`` to the plan's precision (fp32: the export, fused for ONNX Runtime when it can
    be: ``compress_fp32``).

    Raises:
        CalibrationError / QuantizationError / AccuracyGateError: from the compressor.
    """
    cfg, target = plan.config, plan.target
    if cfg.precision != "auto":
        precision = plan.precision
        compressed = COMPRESSORS[precision](model.exported, work, plan, model.source)
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
        log(notes[0])
        choice = Choice(precision, measured[precision].compressed, measured, record, tuple(notes))
    if choice.precision != "fp32":
        log(f"compressed to {choice.precision}" + gate_summary(choice.compressed.details))
    return choice
