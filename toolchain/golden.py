"""Golden I/O for a bundle (a step of ``dsedge build``): held-out input rows, the fp32 reference outputs on them, and
each variant's build-time figures against those outputs, which become its tolerance on the device.

Rows: up to ``MAX_ROWS`` spread evenly over the build's validation inputs (``--heldout``, else the second half of
``--calib``, else the example inputs: whatever the build validated on). Size cap: the golden arrays hold at most
``CAP_BYTES`` (256 KiB, uncompressed); the largest outputs are left out first (a per-token
``last_hidden_state`` of a text encoder), then rows are halved until the rest fits; ``golden/golden.json`` says what
was left out. A rank-0 input (a scalar flag such as ``use_cache``) is stored as it is, one value fed with every row,
and counts its bytes once; so does a rank-0 output (a loss, a count), which is one value per call: with one, the
golden rows are cut to what one call takes (the batch range's max) and its reference value is stored once. The files
are ``np.savez_compressed`` (no pickle) and hash-listed like every bundle file. See runtime/golden.py for the check.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

from ..runtime.backends.ort import OrtBackend
from ..runtime.bundle import IOSpec, Variant
from ..runtime.golden import (INFO_FILE, INPUTS_FILE, OUTPUTS_FILE, compare, count_rows, run_rows, take_rows,
                              tolerances)
from .evaluate import host_backend

MAX_ROWS = 8
CAP_BYTES = 256 << 10


def pick_rows(n: int, rows: int) -> np.ndarray:
    """``rows`` indices spread evenly over ``range(n)`` (first and last included)."""
    return np.unique(np.linspace(0, n - 1, num=min(rows, n)).round().astype(int))


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays.values()))


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def fit_cap(inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray], cap: int = CAP_BYTES
            ) -> tuple[int, list[str]]:
    """(rows to keep, outputs to keep): leave out the largest outputs first (at least one stays), then halve rows.
    Rank-0 inputs and outputs (one value, not rows) count their bytes once, whatever the rows."""
    n = count_rows(inputs)
    fixed = _nbytes({k: v for k, v in inputs.items() if v.ndim == 0})
    per_row_in = _nbytes({k: v for k, v in inputs.items() if v.ndim}) / max(n, 1)
    per_row_out = {k: v.nbytes / max(n, 1) if v.ndim else 0.0 for k, v in outputs.items()}
    once_out = {k: 0 if v.ndim else v.nbytes for k, v in outputs.items()}
    keep = sorted(outputs, key=lambda k: per_row_out[k])

    def size(rows: int) -> float:
        return fixed + sum(once_out[k] for k in keep) + rows * (per_row_in + sum(per_row_out[k] for k in keep))

    while len(keep) > 1 and size(n) > cap:
        keep.pop()
    while n > 1 and size(n) > cap:
        n //= 2
    return n, [k for k in outputs if k in keep]


def scalar_inputs(inputs: list[IOSpec]) -> list[str]:
    """The model's rank-0 inputs (a scalar flag such as ``use_cache`` or ``temperature``): golden I/O stores each as
    one value, fed unchanged with every chunk of rows."""
    return [s.name for s in inputs if not s.shape]


def unbatched_inputs(validation: dict[str, np.ndarray], inputs: list[IOSpec]) -> list[str]:
    """The inputs that leave no golden rows to cut, when there are none to cut ([] otherwise): every input is
    rank-0 (no batch axis anywhere), a batched input's validation array has no axis 0, or a rank-0 input's
    validation value is not one value. A rank-0 input beside batched ones is no obstacle: it is stored whole."""
    scalars = scalar_inputs(inputs)
    batched = [s.name for s in inputs if s.shape]
    broken = [s.name for s in inputs if s.shape and np.ndim(validation[s.name]) == 0]
    odd = [n for n in scalars if np.size(validation[n]) != 1]
    if not batched or broken or odd:
        return scalars + broken
    return []


def _golden_value(validation: np.ndarray, spec: IOSpec, idx: np.ndarray) -> np.ndarray:
    """The golden array of one input: its rows ``idx``, or a rank-0 input's one value as a rank-0 array (the
    build's own example inputs may hold it as ``[v]``)."""
    if not spec.shape:
        return np.asarray(validation).reshape(())
    return np.ascontiguousarray(validation[idx])


def attach_golden(reference_onnx: str | os.PathLike, models: dict[str, str | os.PathLike], variants: list[Variant],
                  validation: dict[str, np.ndarray], inputs: list[IOSpec], shape_ranges: dict[str, Any],
                  validation_kind: str = "", cap: int = CAP_BYTES) -> dict[str, bytes | str]:
    """Choose golden rows, run the fp32 reference and every variant on them (ORT CPU), set each ``Variant.golden``.

    Args:
        reference_onnx: the untouched fp32 export the build validates against.
        models: bundle path → ONNX file, as given to ``write_bundle`` (``variants[i].file`` is a key).
        validation: the inputs the build validated on, name → array with batch axis 0, or one value for a rank-0
            input (stored rank-0, fed with every chunk of rows). At least one input has a batch axis:
            ``unbatched_inputs`` names the inputs when none has, and the build then attaches no golden I/O.
    Returns:
        extra bundle files: ``golden/inputs.npz``, ``golden/outputs.npz`` (bytes), ``golden/golden.json`` (text).
    """
    from ..runtime.golden import batch_limits

    limits = batch_limits(inputs, shape_ranges)
    n = count_rows({s.name: validation[s.name] for s in inputs if s.shape})
    idx = pick_rows(n, MAX_ROWS)
    feeds = {s.name: _golden_value(validation[s.name], s, idx) for s in inputs}
    ref_backend = OrtBackend(reference_onnx, providers=["CPUExecutionProvider"])
    reference = run_rows(ref_backend.run, feeds, limits)
    rows, kept = fit_cap(feeds, reference, cap)
    scalar_out = [k for k in kept if not reference[k].ndim]
    if scalar_out:  # one value per call (a loss, a count over the call's rows): one call, stored once
        rows = min(rows, max(1, limits[1]))
    if rows < len(idx):
        feeds = take_rows(feeds, slice(0, rows))
        # a rank-0 output depends on the rows of its call: computed again on the rows kept
        reference = run_rows(ref_backend.run, feeds, limits) if scalar_out else take_rows(reference, slice(0, rows))
    reference = {k: np.array(reference[k], order="C") for k in kept}  # (ascontiguousarray makes a 0-d [1])
    for v in variants:
        calls: dict[str, list[np.ndarray]] = {}
        got = run_rows(host_backend(models[v.file]).run, feeds, limits, calls)  # BF16: its FP32 emulation
        v.golden = tolerances(reference, compare(reference, got, calls))
    inputs_npz, outputs_npz = _npz_bytes(feeds), _npz_bytes(reference)
    info = {"rows": int(rows), "outputs": kept, "left_out": [k for k in ref_backend.output_names if k not in kept],
            "from": validation_kind or "the build's validation inputs", "row_indices": [int(i) for i in idx[:rows]],
            "cap_bytes": cap, "bytes": len(inputs_npz) + len(outputs_npz),
            "rule": "cosine_min >= build cosine_min - 0.005 and max_abs_diff <= 2 x build max_abs_diff"}
    return {INPUTS_FILE: inputs_npz, OUTPUTS_FILE: outputs_npz, INFO_FILE: json.dumps(info, indent=2) + "\n"}
