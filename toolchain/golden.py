"""Golden I/O for a bundle (a step of ``dsedge build``): held-out input rows, the fp32 reference outputs on them, and
each variant's build-time figures against those outputs, which become its tolerance on the device.

Rows: up to ``MAX_ROWS`` spread evenly over the build's validation inputs (``--heldout``, else the second half of
``--calib``, else the example inputs: whatever the build validated on). Size cap: the golden arrays hold at most
``CAP_BYTES`` (256 KiB, uncompressed); the largest outputs are left out first (a per-token
``last_hidden_state`` of a text encoder), then rows are halved until the rest fits; ``golden/golden.json`` says what
was left out. The files are ``np.savez_compressed`` (no pickle) and hash-listed like every bundle file.
See runtime/golden.py for the check.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

from ..runtime.backends.ort import OrtBackend
from ..runtime.bundle import IOSpec, Variant
from ..runtime.golden import INFO_FILE, INPUTS_FILE, OUTPUTS_FILE, compare, run_rows, tolerances
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
    """(rows to keep, outputs to keep): leave out the largest outputs first (at least one stays), then halve rows."""
    n = len(next(iter(inputs.values())))
    per_row_in = _nbytes(inputs) / max(n, 1)
    per_row_out = {k: v.nbytes / max(n, 1) for k, v in outputs.items()}
    keep = sorted(outputs, key=lambda k: per_row_out[k])
    while len(keep) > 1 and n * (per_row_in + sum(per_row_out[k] for k in keep)) > cap:
        keep.pop()
    while n > 1 and n * (per_row_in + sum(per_row_out[k] for k in keep)) > cap:
        n //= 2
    return n, [k for k in outputs if k in keep]


def unbatched_inputs(validation: dict[str, np.ndarray], inputs: list[IOSpec]) -> list[str]:
    """Inputs with no axis 0 to cut golden rows from (a rank-0 flag)."""
    return [s.name for s in inputs if not s.shape or np.ndim(validation[s.name]) == 0]


def attach_golden(reference_onnx: str | os.PathLike, models: dict[str, str | os.PathLike], variants: list[Variant],
                  validation: dict[str, np.ndarray], inputs: list[IOSpec], shape_ranges: dict[str, Any],
                  validation_kind: str = "", cap: int = CAP_BYTES) -> dict[str, bytes | str]:
    """Choose golden rows, run the fp32 reference and every variant on them (ORT CPU), set each ``Variant.golden``.

    Args:
        reference_onnx: the untouched fp32 export the build validates against.
        models: bundle path → ONNX file, as given to ``write_bundle`` (``variants[i].file`` is a key).
        validation: the inputs the build validated on, name → array with batch axis 0 (every input has one:
            ``unbatched_inputs`` names those that do not, and the build then attaches no golden I/O).
    Returns:
        extra bundle files: ``golden/inputs.npz``, ``golden/outputs.npz`` (bytes), ``golden/golden.json`` (text).
    """
    from ..runtime.golden import batch_limits

    limits = batch_limits(inputs, shape_ranges)
    n = len(next(iter(validation.values())))
    idx = pick_rows(n, MAX_ROWS)
    feeds = {s.name: np.ascontiguousarray(validation[s.name][idx]) for s in inputs}
    ref_backend = OrtBackend(reference_onnx, providers=["CPUExecutionProvider"])
    reference = run_rows(ref_backend.run, feeds, limits)
    rows, kept = fit_cap(feeds, reference, cap)
    feeds = {k: v[:rows] for k, v in feeds.items()}
    reference = {k: np.ascontiguousarray(reference[k][:rows]) for k in kept}
    for v in variants:
        got = run_rows(host_backend(models[v.file]).run, feeds, limits)  # a BF16 variant: its FP32 emulation
        v.golden = tolerances(reference, compare(reference, got))
    inputs_npz, outputs_npz = _npz_bytes(feeds), _npz_bytes(reference)
    info = {"rows": int(rows), "outputs": kept, "left_out": [k for k in ref_backend.output_names if k not in kept],
            "from": validation_kind or "the build's validation inputs", "row_indices": [int(i) for i in idx[:rows]],
            "cap_bytes": cap, "bytes": len(inputs_npz) + len(outputs_npz),
            "rule": "cosine_min >= build cosine_min - 0.005 and max_abs_diff <= 2 x build max_abs_diff"}
    return {INPUTS_FILE: inputs_npz, OUTPUTS_FILE: outputs_npz, INFO_FILE: json.dumps(info, indent=2) + "\n"}
