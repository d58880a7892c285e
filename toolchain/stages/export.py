"""Stage ``export``: the fp32 ONNX export (parity-checked against torch) and a copy of it, the reference every
variant's accuracy is measured against."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable

from ...runtime.bundle import IOSpec
from ..artifacts import Prepared
from ..config import BuildPlan
from ..export import Exported, export_onnx
from ..sources import Source


def export(plan: BuildPlan, source: Source, work: Path, log: Callable[[str], None]) -> Prepared:
    """Export ``source`` to ``work/models/fp32.onnx`` and copy it to ``work/reference-fp32.onnx``.

    Raises:
        SourceError: the export fails or its outputs differ from torch's.
    """
    exported = export_with_ranges(source, work / "models" / "fp32.onnx")
    if exported.parity_max_abs_diff is None:  # an ONNX source: nothing exported, nothing to compare with torch
        log("ONNX source used as is: no export, no torch parity check")
    else:
        log(f"exported ONNX ({exported.exporter}); parity max abs diff {exported.parity_max_abs_diff:.3g}")
    reference = work / "reference-fp32.onnx"
    shutil.copyfile(exported.path, reference)
    return Prepared(source=source, exported=exported, reference=reference, validation=source.example_inputs)


def export_with_ranges(source: Source, dest: str | os.PathLike) -> Exported:
    """``export_onnx`` with the source's value ranges (e.g. token ids < vocab size) on the input specs."""
    exported = export_onnx(source, dest)
    return dataclasses.replace(exported, inputs=[IOSpec(s.name, s.dtype, s.shape, source.value_ranges.get(s.name))
                                                 for s in exported.inputs])
