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


def read_npz(path: str | os.PathLike, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file ``path`` (``numpy.savez`` / ``savez_compressed``), loaded with
    ``allow_pickle=False``, name → array.

    ``max_bytes``: the most the arrays may take in memory together, as their ``.npy`` headers declare it, checked
    before any is read (a few MB of zip can declare gigabytes); None: no limit.

    Raises:
        NpzReadError: an empty file, a ``.npy`` file (one unnamed array), anything else that is not a zip archive,
            a damaged or truncated archive, a member that is not a ``.npy`` array, object arrays (pickled Python
            objects, never loaded), or arrays past ``max_bytes``.
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
            if max_bytes is not None:
                declared = sum(_declared_bytes(z.zip, member) for member in z.zip.namelist())
                if declared > max_bytes:
                    raise NpzReadError(f"its arrays declare {declared} bytes, more than the {max_bytes} allowed here")
            out = {}
            for k in z.files:
                value = z[k]
                if not isinstance(value, np.ndarray):  # numpy hands back a member that is not .npy as raw bytes
                    raise NpzReadError(f"member {k!r} is not a .npy array")
                out[k] = value
            return out
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise NpzReadError(f"the archive is damaged or cut short ({e})") from None
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise NpzReadError("it holds object arrays (pickled Python objects), which are never loaded") from None
        raise NpzReadError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _declared_bytes(archive: zipfile.ZipFile, member: str) -> int:
    """Bytes the ``.npy`` member's header says its array takes (0 for a member that is not ``.npy``: reading
    refuses it)."""
    with archive.open(member) as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
        except ValueError:
            return 0
    return int(np.prod(shape, dtype=object)) * dtype.itemsize
