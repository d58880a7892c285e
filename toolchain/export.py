"""Stage 1 of ``dsedge build``: export a torch source to ONNX with dynamic axes and check parity on real inputs."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..runtime.bundle import IOSpec
from ..runtime.errors import SourceError

if TYPE_CHECKING:  # sources imports this module's io_specs
    from .sources import Source

EXPORT_OPSET = 21  # INT4 block DequantizeLinear needs opset 21; per-target conversion happens later.


@dataclass
class Exported:
    """An fp32 ONNX model on disk and what was checked about it.

    ``parity_max_abs_diff`` is the max |onnx - torch| over all outputs on the source's real inputs (None for ONNX
    sources, which are taken as they are).
    """

    path: Path
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    parity_max_abs_diff: float | None
    exporter: str
    reference: Path | None = None   # what accuracy gates compare with (the original before --prune/--qat-steps)


def io_specs(model) -> tuple[list[IOSpec], list[IOSpec]]:  # type: ignore[no-untyped-def]
    """IO specs from an ``onnx.ModelProto``: dtype names and shapes with symbolic dims as strings."""
    from onnx import helper

    init = {i.name for i in model.graph.initializer}

    def spec(v) -> IOSpec:  # type: ignore[no-untyped-def]
        t = v.type.tensor_type
        dtype = str(helper.tensor_dtype_to_np_dtype(t.elem_type))
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or f"d{i}")
                     for i, d in enumerate(t.shape.dim))
        return IOSpec(v.name, dtype, dims)

    return [spec(v) for v in model.graph.input if v.name not in init], [spec(v) for v in model.graph.output]


def _torch_outputs(module, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        out = module(*[torch.from_numpy(v) for v in inputs.values()])
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach().numpy() for o in out]


def export_onnx(source: Source, dest: str | os.PathLike, opset: int = EXPORT_OPSET) -> Exported:
    """Export ``source.module`` to ``dest`` (single file, weights inside) and compare with torch.

    Uses ``torch.onnx.export(dynamo=True)``, which keeps dynamic batch/sequence axes; falls back to the TorchScript
    exporter when dynamo cannot trace the module. ONNX sources are copied unchanged.

    Raises:
        SourceError: both exporters failed (the message names the first error).
    """
    import onnx

    dest = Path(dest)
    if source.onnx_path is not None:
        model = onnx.load(os.fspath(source.onnx_path))
        onnx.save(model, os.fspath(dest))
        ins, outs = io_specs(model)
        check_io_dtypes(ins, outs)
        return Exported(dest, ins, outs, None, "none (ONNX source)")

    import torch

    names = list(source.example_inputs)
    args = tuple(torch.from_numpy(v) for v in source.example_inputs.values())
    dims: dict[str, torch.export.Dim] = {}
    # positional, like ``args``: a dict would have to be keyed by forward()'s parameter names, which the input
    # names (input_0, a run's input_names, …) need not be, and torch.export refuses the mismatch
    dynamic_shapes = tuple({int(a): dims.setdefault(sym, torch.export.Dim(sym))
                            for a, sym in source.dynamic_axes.get(n, {}).items()} or None for n in names)
    first_error = None
    exporter = "dynamo"
    import logging

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # torchvision notices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(source.module, args, os.fspath(dest), dynamo=True, input_names=names,
                              output_names=source.output_names, dynamic_shapes=dynamic_shapes,
                              opset_version=opset, external_data=False, verbose=False)
        except Exception as e:  # the dynamo exporter raises many kinds; try the TorchScript one next
            first_error = e
            exporter = "torchscript"
            try:
                torch.onnx.export(source.module, args, os.fspath(dest), dynamo=False, input_names=names,
                                  output_names=source.output_names, opset_version=min(opset, 20),
                                  dynamic_axes={n: {int(a): s for a, s in ax.items()}
                                                for n, ax in source.dynamic_axes.items()})
            except Exception as e2:
                raise SourceError(f"ONNX export failed: {type(first_error).__name__}: "
                                  f"{str(first_error).splitlines()[0][:200] if str(first_error) else ''}",
                                  f"make the model traceable by torch.export (TorchScript fallback: {type(e2).__name__})") from None
    model = onnx.load(os.fspath(dest))
    if model.opset_import[0].version < opset:
        from .opset import upgrade_opset
        model = upgrade_opset(model, opset)
        onnx.save(model, os.fspath(dest))
    ins, outs = io_specs(model)
    check_io_dtypes(ins, outs)
    extra = list(source.output_names or [])[len(outs):]
    if extra:  # the exporter names the first outputs and drops the rest without a word
        raise SourceError(f"the model returns {len(outs)} output{'s' * (len(outs) != 1)} but output_names names "
                          f"{len(source.output_names)}: {', '.join(map(repr, extra))} name{'s' * (len(extra) == 1)} "
                          f"nothing", "give one name per output the model's forward returns (a training run: "
                          "[model] output_names in its config)")
    diff = parity(source, dest)
    return Exported(dest, ins, outs, diff, exporter)


def check_io_dtypes(inputs: list[IOSpec], outputs: list[IOSpec]) -> None:
    """A bundle's inputs and outputs are of the manifest's dtypes; a float64 model failed only when the manifest was
    written, as "a dsedge bug".

    Raises:
        SourceError: an input or output of another dtype (float64, …).
    """
    from ..runtime.bundle import IO_DTYPES

    for kind, specs in (("input", inputs), ("output", outputs)):
        for s in specs:
            if s.dtype not in IO_DTYPES:
                raise SourceError(f"the model's {kind} {s.name!r} is {s.dtype}, which a bundle cannot carry "
                                  f"(dtypes: {', '.join(sorted(IO_DTYPES))})",
                                  "cast the model and its inputs, e.g. model.float() and float32 example inputs")


def parity(source: Source, onnx_path: str | os.PathLike) -> float:
    """Max abs difference between torch and ONNX Runtime outputs on the source's real inputs (or examples)."""
    import onnxruntime as ort

    feeds = source.validation if source.validation is not None else source.example_inputs
    sess = ort.InferenceSession(os.fspath(onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    want = _torch_outputs(source.module, feeds)
    diff = float(max(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))) for g, w in zip(got, want)))
    if not np.isfinite(diff):  # NaN/inf outputs: every accuracy figure would be NaN, found only at report.json
        raise SourceError("the model's outputs hold NaN/inf on its "
                          + ("validation" if source.validation is not None else "example") + " inputs",
                          "fix the model's forward(), or return example inputs it is defined for")
    return diff
