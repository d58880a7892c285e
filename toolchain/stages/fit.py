"""Stage ``fit``: rewrite each variant's ONNX file at an opset the target's runtime reads."""
from __future__ import annotations

import os
from pathlib import Path

from ...targets import Target
from ..artifacts import Choice, Prepared
from ..config import BuildPlan
from ..opset import convert_for_target, model_opset


def fit(plan: BuildPlan, model: Prepared, choice: Choice) -> dict[str, int]:
    """Fit the chosen variant (and the fp32 one when it ships) to the target, in place; returns precision → opset.

    Candidates the measured ``auto`` choice built were fitted then. Raises TargetError (see ``fit_target``).
    """
    opsets = {p: m.opset for p, m in choice.measured.items()}
    if choice.precision not in opsets:
        opsets[choice.precision] = fit_target(choice.compressed.path, plan.target)
    if plan.config.keep_fp32 and "fp32" not in opsets:
        opsets["fp32"] = fit_target(model.exported.path, plan.target)
    return opsets


def fit_target(path: Path, target: Target) -> int:
    """Rewrite the ONNX file at ``path`` at an opset ``target`` reads (see ``convert_for_target``); returns the opset.

    Raises:
        TargetError: impossible for the target (e.g. INT4 block DequantizeLinear on an opset ≤ 17 target).
    """
    import onnx

    model = convert_for_target(onnx.load(os.fspath(path)), target)
    onnx.save(model, os.fspath(path))
    return model_opset(model)
