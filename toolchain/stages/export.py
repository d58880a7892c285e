"""Stage ``export``: the fp32 ONNX export (parity-checked against torch) and a copy of it, the reference every
variant's accuracy is measured against."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ...runtime.bundle import IOSpec
from ...runtime.token_bounds import graph_value_ranges
from ..artifacts import Prepared
from ..config import BuildPlan
from ..evaluate import check_gate_output
from ..export import Exported, export_onnx
from ..sources import Source


def export(plan: BuildPlan, source: Source, work: Path, log: Callable[[str], None]) -> Prepared:
    """Export ``source`` to ``work/models/fp32.onnx`` and copy it to ``work/reference-fp32.onnx``.

    Raises:
        SourceError: the export fails or its outputs differ from torch's; or it is not fp32 (``check_fp32``).
        ConfigError: ``--gate-output`` names no output of the export (an .onnx source was checked in plan_build);
            said here, before any work that judges accuracy (auto would skip every candidate for it).
    """
    exported = export_with_ranges(source, work / "models" / "fp32.onnx")
    check_fp32(plan, exported.path)
    check_gate_output(plan.config.gate_output, [o.name for o in exported.outputs], "the exported model")
    if exported.parity_max_abs_diff is None:  # an ONNX source: nothing exported, nothing to compare with torch
        log("ONNX source used as is: no export, no torch parity check")
    else:
        log(f"exported ONNX ({exported.exporter}); parity max abs diff {exported.parity_max_abs_diff:.3g}")
    reference = work / "reference-fp32.onnx"
    shutil.copyfile(exported.path, reference)
    return Prepared(source=source, exported=exported, reference=reference, validation=source.example_inputs)


def check_fp32(plan: BuildPlan, path: Path) -> None:
    """Refuse an export whose weights are not fp32: fp16/bf16 weight tensors (float initializers of 2 or more dims)
    or quantized layers (``quantize.graph.quantized_nodes``). The build labels its export ``fp32`` — the variant
    ``-p fp32`` builds, the one shipped beside a compressed variant, auto's reference — and compresses from it
    (an fp16 source gave INT4/INT8 graphs ONNX Runtime cannot load, and ``-p fp16`` found nothing to convert).

    Raises:
        SourceError: naming the weights' type and count; the hint says to build from the fp32 model (``-p fp16``
            makes the fp16 variant from it).
    """
    import onnx

    from ...runtime.errors import SourceError
    from ..quantize.graph import describe_half, half_weights, quantized_nodes

    model = onnx.load(os.fspath(path), load_external_data=False)
    half, total = half_weights(model)
    quantized = quantized_nodes(model)
    if not half and not quantized:
        return
    if half:
        what = describe_half(half, total)
    else:
        what = f"quantized layers ({len(quantized)} {'/'.join(sorted({n.op_type for n in quantized}))} nodes)"
    raise SourceError(f"the model holds {what}: dsedge build needs the fp32 model (it ships its export as the fp32 "
                      "variant and compresses from it)", "build from the fp32 model (ONNX or torch): -p fp16 makes "
                      "the fp16 variant from it, with LayerNorm/Softmax kept fp32")


def export_with_ranges(source: Source, dest: str | os.PathLike) -> Exported:
    """``export_onnx`` with value ranges on the input specs: the source's (e.g. token ids < vocab size), else what
    the exported graph says (an integer input that indexes an embedding table: runtime/token_bounds.py), so an id
    past a table is refused at the input, not answered from a block-quantized Gather that does not check it."""
    exported = export_onnx(source, dest)
    unbounded = [s for s in exported.inputs if s.name not in source.value_ranges and np.dtype(s.dtype).kind in "iu"]
    ranges = {**(_graph_ranges(exported.path) if unbounded else {}), **source.value_ranges}
    return dataclasses.replace(exported, inputs=[IOSpec(s.name, s.dtype, s.shape, ranges.get(s.name))
                                                 for s in exported.inputs])


def _graph_ranges(path: Path) -> dict[str, tuple[int, int]]:
    import onnx

    return graph_value_ranges(onnx.load(os.fspath(path), load_external_data=False))
