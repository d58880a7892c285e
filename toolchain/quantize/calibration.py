"""Calibration data: read it (files or a Python iterable), check it against the model, collect activations.

A *batch* is ``dict[input name -> numpy array]`` matching the ONNX model's graph inputs. A calibration set is
given as a Python iterable of batches, a ``.npz`` file (one batch), or a directory of ``.npz`` files (one batch
each, read in sorted order). Activations of chosen tensors are collected by running the fp32 model in ONNX Runtime
(CPU) with those tensors added as graph outputs.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Union

import numpy as np
import onnx

from ...runtime.errors import CalibrationError
from ...runtime.golden import count_rows, take_rows
from ...runtime.io import check_finite
from ...runtime.npz import read_npz

Batch = dict[str, np.ndarray]
CalibrationSource = Union[str, os.PathLike, Iterable[Batch]]

_KINDS = {"f": "float", "i": "int", "u": "int", "b": "bool"}


def split_batches(arrays: Batch, batch_size: int = 16) -> list[Batch]:
    """One ``{input: array}`` set with the batch on axis 0 → batches of at most ``batch_size`` samples; a rank-0
    input (a scalar such as ``temperature``, ``read_npz_dir``'s one value) goes unchanged with every batch."""
    n = count_rows(arrays)
    return [take_rows(arrays, slice(i, i + batch_size)) for i in range(0, n, batch_size)]


def npz_files(source: str | os.PathLike, what: str = "calibration") -> list[Path]:
    """The ``.npz`` files of a data path: the file itself, or a directory's ``*.npz`` in sorted order (not read).

    ``what`` names the data in errors (``"calibration"``, ``"held-out"``).

    Raises:
        CalibrationError: the path does not exist, or is a directory holding no ``.npz`` file.
    """
    path = Path(source)
    if not path.exists():
        raise CalibrationError(f"{what} data {str(path)!r} does not exist", "pass a .npz file or a directory")
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise CalibrationError(f"{what} directory {str(path)!r} holds no .npz file",
                               "save each batch with numpy.savez(file, **{input_name: array})")
    return files


def read_batches(source: CalibrationSource, what: str = "calibration") -> list[Batch]:
    """All batches of a calibration source as a list (a single ``{input: array}`` mapping is split in 16s).
    ``what`` names the data in errors (``"calibration"``, ``"held-out"``).

    Raises CalibrationError when the path does not exist, holds no ``.npz`` file, or the set is empty.
    """
    if source is None:
        raise CalibrationError(f"no {what} data given", "pass --calib DIR_OR_NPZ (or a Python iterable)"
                               if what == "calibration" else "pass --heldout DIR_OR_NPZ (or a Python iterable)")
    if isinstance(source, (str, os.PathLike)):
        batches = []
        for f in npz_files(source, what):
            try:
                batches.append(read_npz(f))
            except (OSError, ValueError) as e:
                raise CalibrationError(f"{what} file {str(f)!r} is not a readable .npz: {e}",
                                       "save batches with numpy.savez") from None
    elif isinstance(source, dict):
        batches = split_batches(source)
    else:
        batches = [dict(b) for b in source]
    batches = [b for b in batches if b]
    if not batches or all(min((np.asarray(v).shape[0] if np.ndim(v) else 1) for v in b.values()) == 0
                          for b in batches):
        raise CalibrationError(f"{what} data set is empty",
                               "give at least one batch (e.g. 32-128 representative samples)")
    return batches


def check_batches(model: onnx.ModelProto, batches: list[Batch], what: str = "calibration") -> list[Batch]:
    """Check names, rank, static dims and dtype kind of every batch against the model's graph inputs; cast
    same-kind dtypes.

    Raises CalibrationError naming the input (missing, unknown, wrong rank, int given for float …).
    """
    init_names = {t.name for t in model.graph.initializer}
    specs = {}
    for i in model.graph.input:
        if i.name in init_names:
            continue
        tt = i.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim] if tt.HasField("shape") else None
        specs[i.name] = (dtype, dims)
    out = []
    for j, b in enumerate(batches):
        missing = sorted(set(specs) - set(b))
        unknown = sorted(set(b) - set(specs))
        if missing:
            raise CalibrationError(f"{what} batch {j} lacks model input {missing[0]!r}",
                                   f"the model's inputs are {sorted(specs)}")
        if unknown:
            raise CalibrationError(f"{what} batch {j} has {unknown[0]!r}, which is not a model input",
                                   f"the model's inputs are {sorted(specs)}")
        fixed = {}
        for name, (dtype, dims) in specs.items():
            a = np.asarray(b[name])
            check_finite({name: a}, CalibrationError, f"{what} batch {j}")
            if dims is not None and a.ndim != len(dims):
                raise CalibrationError(f"{what} input {name!r} has rank {a.ndim}, the model expects {len(dims)}",
                                       "check the batch layout")
            for axis, (got, want) in enumerate(zip(a.shape, dims or ())):
                if isinstance(want, int) and want and got != want:
                    raise CalibrationError(f"{what} batch {j}: input {name!r} axis {axis} is {got}, the model "
                                           f"expects {want} (shape {dims})", "this axis is static in the model")
            if _KINDS.get(a.dtype.kind) != _KINDS.get(np.dtype(dtype).kind):
                raise CalibrationError(f"{what} input {name!r} is {a.dtype}, the model expects {np.dtype(dtype)}",
                                       "convert the calibration data to the model's input dtype")
            fixed[name] = a.astype(dtype, copy=False)
        out.append(fixed)
    return out


def load_calibration(model: onnx.ModelProto, source: CalibrationSource) -> list[Batch]:
    """:func:`read_batches` then :func:`check_batches`."""
    return check_batches(model, read_batches(source))


def ort_session(model: onnx.ModelProto, *, threads: int = 0):
    """A CPU ONNX Runtime session of an in-memory model (external data must be loaded into the proto)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` with the tensors ``names`` added as graph outputs (type left for ORT to infer)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=name))
    return m


def _token_mask(batch: Batch, act: np.ndarray) -> np.ndarray | None:
    """For transformer inputs: keep only rows of real tokens (attention_mask == 1) when shapes line up."""
    mask = batch.get("attention_mask")
    if mask is None or act.ndim < 3 or tuple(act.shape[:2]) != tuple(mask.shape):
        return None
    return mask.reshape(-1).astype(bool)


def collect_activations(model: onnx.ModelProto, batches: list[Batch], tensors: list[str], *,
                        max_rows: int = 4096, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of each tensor in ``tensors`` over the calibration batches.

    Each activation ``[..., K]`` is flattened to ``[rows, K]`` (float32); padded tokens are dropped when the batch
    has an ``attention_mask`` ``[B, S]`` and the activation is ``[B, S, K]``. At most ``max_rows`` rows are kept per
    tensor (uniform random subsample, fixed ``seed``). Raises CalibrationError when the model fails on a batch.
    """
    sess = ort_session(with_outputs(model, tensors))
    got: dict[str, list[np.ndarray]] = {t: [] for t in tensors}
    for j, b in enumerate(batches):
        try:
            outs = sess.run(tensors, b)
        except Exception as e:  # ORT raises its own exception types; surface as a user error naming the batch
            raise CalibrationError(f"the model failed on calibration batch {j}: {str(e).splitlines()[0]}",
                                   "check the calibration inputs' shapes and values") from None
        for name, act in zip(tensors, outs):
            act = np.asarray(act, np.float32)
            keep = _token_mask(b, act)
            rows = act.reshape(-1, act.shape[-1])
            got[name].append(rows[keep] if keep is not None else rows)
    rng = np.random.default_rng(seed)
    result = {}
    for name, parts in got.items():
        rows = np.concatenate(parts, axis=0)
        if rows.shape[0] > max_rows:
            rows = rows[np.sort(rng.choice(rows.shape[0], max_rows, replace=False))]
        result[name] = rows
    return result


def iterate(batches: list[Batch]) -> Iterator[Batch]:
    """A fresh iterator over the batches (for APIs that consume a reader once)."""
    return iter([dict(b) for b in batches])
