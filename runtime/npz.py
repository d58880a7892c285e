"""Read a ``.npz`` file of named arrays without ever unpickling, and say plainly why a file is not one.

``numpy.load`` guesses the format from the first bytes: anything that is neither a zip archive nor a ``.npy``
header is taken for a pickle ("This file contains pickled (object) data" for a file of garbage), a ``.npy`` comes
back as one bare array, and a zip cut short raises ``zipfile.BadZipFile``, which is not a ``ValueError``."""
from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")   # a local file header, or the end record of an empty archive
_NPY_MAGIC = b"\x93NUMPY"


class NpzReadError(ValueError):
    """``path`` is not a readable ``.npz`` of plain arrays; the message says why, in a few words."""


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file ``path`` (``numpy.savez`` / ``savez_compressed``), loaded with
    ``allow_pickle=False``, name → array.

    Raises:
        NpzReadError: an empty file, a ``.npy`` file (one unnamed array), anything else that is not a zip archive,
            a damaged or truncated archive, or object arrays (pickled Python objects, never loaded).
        OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        head = f.read(6)
    if not head:
        raise NpzReadError("the file is empty")
    if head.startswith(_NPY_MAGIC):
        raise NpzReadError("it is a .npy file (one unnamed array, numpy.save), not a .npz of named arrays")
    if not head.startswith(_ZIP_MAGIC):
        raise NpzReadError("it is not a .npz file (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise NpzReadError(f"the archive is damaged or cut short ({e})") from None
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise NpzReadError("it holds object arrays (pickled Python objects), which are never loaded") from None
        raise NpzReadError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
