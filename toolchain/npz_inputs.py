"""Real model inputs from ``*.npz`` files (``--calib`` / ``--heldout``): one reader for the build, ``dsedge prune``
and the quantizers — arrays named like the model's inputs, batch axis 0, checked against the model's input specs,
integer inputs of different lengths zero-padded like a tokenizer's ``padding=True``. A rank-0 input (a scalar such as
``temperature`` or ``use_cache``) holds one value in every file and is returned once, rank-0, to be fed unchanged with
every batch cut from the others (``runtime.golden.take_rows``)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..runtime.bundle import IOSpec
from ..runtime.errors import CalibrationError
from ..runtime.golden import count_rows, take_rows
from ..runtime.npz import read_npz


def read_npz_dir(path: str | os.PathLike, specs: list[IOSpec], what: str = "calibration") -> dict[str, np.ndarray]:
    """Real inputs from the ``*.npz`` files of a directory (arrays named like the model's inputs, batch axis 0),
    concatenated in file order. A rank-0 input (spec shape ``[]``) must hold the same value in every file: it is
    returned once, as a rank-0 array; the samples are the rows of the batched inputs.

    Raises:
        CalibrationError: missing/empty directory, unreadable file, missing input names, dtypes or shapes that do
            not match the model's inputs, a rank-0 input that differs between files, no sample at all (or no
            batched input to hold one).
    """
    from ..runtime.errors import InputError
    from ..runtime.io import check_finite, validate_inputs

    input_names = [s.name for s in specs]
    d = Path(path)
    if not d.is_dir():
        raise CalibrationError(f"{what} directory {str(d)!r} " + ("is a file" if d.exists() else "does not exist"),
                               "pass a directory of .npz files")
    files = sorted(d.glob("*.npz"))
    if not files:
        raise CalibrationError(f"{what} directory {str(d)!r} has no .npz files",
                               f"save real inputs with np.savez(f, {', '.join(n + '=…' for n in input_names)})")
    scalars = {s.name for s in specs if not s.shape}
    if scalars and len(scalars) == len(input_names):
        raise CalibrationError(f"{what} data cannot be read for this model: its input(s) "
                               f"{', '.join(map(repr, input_names))} are all rank-0 (one value each), so there are "
                               "no samples (rows along a batch axis) to cut",
                               f"drop --{'calib' if what == 'calibration' else 'heldout'}: a model needs a batched "
                               "input for real inputs to calibrate or validate on")
    parts: dict[str, list[np.ndarray]] = {n: [] for n in input_names}
    for f in files:
        try:
            z = read_npz(f)
        except (ValueError, OSError) as e:
            raise CalibrationError(f"{what} file {f} is not readable: {e}",
                                   f"write it with numpy.savez(f, {', '.join(n + '=…' for n in input_names)})") from None
        missing = [n for n in input_names if n not in z]
        if missing:
            raise CalibrationError(f"{what} file {f} lacks input {missing[0]!r}",
                                   f"each file needs: {', '.join(input_names)}")
        arrays = {n: z[n] for n in input_names}
        try:
            validate_inputs(specs, arrays)
            check_finite(arrays)
        except InputError as e:
            raise CalibrationError(f"{what} file {f}: {e}", e.hint) from None
        for n in input_names:
            a = arrays[n]
            if n in scalars and parts[n] and not np.array_equal(a, parts[n][0]):
                raise CalibrationError(f"{what} input {n!r} is rank-0 (one value for every sample) and holds "
                                       f"{parts[n][0].item()!r} in {files[0].name} but {a.item()!r} in {f.name}",
                                       f"save one value of {n!r} in every file (e.g. the value you deploy with)")
            parts[n].append(a)
    data = {n: (np.asarray(v[0]) if n in scalars else _concat_padded(n, v, what)) for n, v in parts.items()}
    if count_rows(data) == 0:
        raise CalibrationError(f"{what} directory {str(d)!r} holds 0 samples", "save at least one sample per file")
    return data


def _concat_padded(name: str, arrays: list[np.ndarray], what: str) -> np.ndarray:
    """Concatenate along the batch axis; integer inputs (token ids, masks) of different lengths are zero-padded at
    the end to the longest, as a tokenizer's ``padding=True`` does (0 = padding id, masked position). Float inputs of
    different shapes raise CalibrationError: padding would change what they mean."""
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) == 1:
        return np.concatenate(arrays)
    if not all(np.issubdtype(a.dtype, np.integer) for a in arrays):
        raise CalibrationError(f"{what} input {name!r} has different shapes across files: {sorted(shapes)[:3]}",
                               "save every file with one shape (e.g. crop or pad to one size)")
    target = np.max([a.shape[1:] for a in arrays], axis=0)
    return np.concatenate([np.pad(a, [(0, 0)] + [(0, int(t - d)) for d, t in zip(a.shape[1:], target)])
                           for a in arrays])


def load_calibration_dir(path: str | os.PathLike, specs: list[IOSpec]) -> tuple[dict, dict]:
    """Real inputs from ``*.npz`` files (see ``read_npz_dir``) split in half: (calibration, validation).

    Raises:
        CalibrationError: as ``read_npz_dir``, or fewer than 2 samples.
    """
    data = read_npz_dir(path, specs)
    count = count_rows(data)
    if count < 2:
        raise CalibrationError(f"calibration directory {str(path)!r} holds {count} sample(s)", "give at least 2 (more is better)")
    half = count // 2
    return take_rows(data, slice(None, half)), take_rows(data, slice(half, None))  # a rank-0 input goes with both


def count_samples(arrays: dict[str, np.ndarray]) -> int:
    """Samples (rows) of ``arrays``: those of the first batched input (a rank-0 input holds one value, no rows)."""
    return count_rows(arrays)
