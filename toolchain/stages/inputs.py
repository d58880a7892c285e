"""Stage ``read_inputs``: the real inputs of ``--calib`` / ``--heldout`` (``.npz`` files checked against the
exported model's inputs), or the source's own calibration and example inputs."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.errors import SourceError
from ..artifacts import Prepared
from ..config import BuildPlan
from ..npz_inputs import count_samples, load_calibration_dir, read_npz_dir


def read_inputs(plan: BuildPlan, model: Prepared) -> Prepared:
    """``--calib DIR`` alone: first half calibrates, second half validates; with ``--heldout DIR``, all of
    ``--calib`` calibrates and ``--heldout`` validates; ``--heldout`` alone validates. Without either, the source's
    calibration inputs (if any) and validation on its example inputs.

    Raises:
        CalibrationError: see ``read_npz_dir``.
    """
    cfg, specs = plan.config, model.exported.inputs
    changes: dict[str, Any] = {}
    if cfg.calib and cfg.heldout:
        changes["calibration"] = read_npz_dir(cfg.calib, specs)
        changes["validation"] = read_npz_dir(cfg.heldout, specs, what="held-out")
        changes["calibration_kind"] = f"--calib {cfg.calib} ({count_samples(changes['calibration'])} samples)"
        changes["validation_kind"] = (f"--heldout {cfg.heldout} ({count_samples(changes['validation'])} samples, "
                                      "not calibrated on)")
    elif cfg.calib:
        changes["calibration"], changes["validation"] = load_calibration_dir(cfg.calib, specs)
        changes["calibration_kind"] = (f"--calib {cfg.calib} (first half, {count_samples(changes['calibration'])} "
                                       "samples)")
        changes["validation_kind"] = f"--calib {cfg.calib} (second half, not used for calibration)"
    elif cfg.heldout:
        changes["validation"] = read_npz_dir(cfg.heldout, specs, what="held-out")
        changes["validation_kind"] = f"--heldout {cfg.heldout} ({count_samples(changes['validation'])} samples)"
    source = dataclasses.replace(model.source, **changes)
    validation = source.validation if source.validation is not None else source.example_inputs
    if changes or model.exported.parity_max_abs_diff is None:  # else the export's parity check ran on them
        check_finite_outputs(model.reference, validation, source.validation_kind)
    return dataclasses.replace(model, source=source, validation=validation)


def check_finite_outputs(reference: Path, validation: dict[str, np.ndarray], kind: str) -> None:
    """The fp32 model's outputs on the inputs every variant is validated on must be finite: a NaN/inf there made
    every accuracy figure and golden tolerance NaN, and the build failed only at report.json, as "a dsedge bug".

    Raises:
        SourceError: an output holds NaN/inf.
    """
    from ..evaluate import model_outputs

    for name, out in model_outputs(reference, validation).items():
        if out.dtype.kind == "f" and not np.isfinite(out).all():
            bad = int(out.size - np.isfinite(out).sum())
            raise SourceError(f"the fp32 model's output {name!r} holds {bad} NaN/inf values on {kind}",
                              "validate on inputs the model is defined for (--heldout DIR of real inputs), or fix "
                              "the model")
