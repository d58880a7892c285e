"""Real model inputs from ``*.npz`` files (``--calib`` / ``--heldout``): one reader for the build, ``dsedge prune``
and the quantizers — arrays named like the model's inputs, batch axis 0, checked against the model's input specs,
integer inputs of different lengths zero-padded like a tokenizer's ``padding=True``."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..runtime.bundle import IOSpec
from ..runtime.errors import CalibrationError
from ..runtime.npz import read_npz


def read_npz_dir(path: str | os.PathLike, specs: list[IOSpec], what: str = "calibration") -> dict[str, np.ndarray]:
    """Real inputs from the ``*.npz`` files of a directory (arrays named like the model's inputs, batch axis 0),
    concatenated in file order.

    Raises:
        CalibrationError: missing/empty directory, unreadable file, missing input names, dtypes or shapes that do
            not match the model's inputs, no sample at all.
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
            parts[n].append(arrays[n])
    data = {n: _concat_padded(n, v, what) for n, v in parts.items()}
    if len(next(iter(data.values()))) == 0:
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
    count = len(next(iter(data.values())))
    if count < 2:
        raise CalibrationError(f"calibration directory {str(path)!r} holds {count} sample(s)", "give at least 2 (more is better)")
    half = count // 2
    return {n: v[:half] for n, v in data.items()}, {n: v[half:] for n, v in data.items()}


def count_samples(arrays: dict[str, np.ndarray]) -> int:
    return int(len(next(iter(arrays.values()))))
