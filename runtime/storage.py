"""Turn the operating system's "the disk refused this write" (and "this path cannot be used") errors into a
one-line ``StorageError``."""
from __future__ import annotations

import contextlib
import errno
from typing import Mapping

from .errors import StorageError

# errno → (what happened, what to do)
_STORAGE = {
    errno.ENOSPC: ("the disk is full", "free space on the output disk (or choose another --out) and run again"),
    errno.EFBIG: ("a file grew past the size limit (ulimit -f or the filesystem's)",
                  "raise the file-size limit or write to another filesystem"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space under your quota or choose another --out"),
    errno.EROFS: ("the filesystem is read-only", "choose a writable --out"),
    errno.EACCES: ("permission denied", "choose a directory you can write to"),
    errno.EPERM: ("operation not permitted", "choose a directory you can write to"),
    errno.ENAMETOOLONG: ("a path is too long", "choose a shorter --out or model name"),
    # a path that cannot be what the command needs: still the user's input, not a crash
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "choose a path whose parents are directories"),
    errno.EISDIR: ("the path is a directory, where a file was expected", "give a file path, not a directory"),
    errno.EEXIST: ("a file is in the way of a directory to create", "choose another path, or move that file"),
    errno.ENOENT: ("no such file or directory", "check the path (relative paths count from where you run)"),
}


def storage_error(err: OSError, what: str = "writing", hints: Mapping[int, str] | None = None) -> StorageError | None:
    """The StorageError for ``err`` when it is a storage condition (see ``_STORAGE``); None for other OSErrors.
    ``hints``: errno → what to do, in place of ``_STORAGE``'s (a command whose output is not ``--out``)."""
    if err.errno not in _STORAGE:
        return None
    why, hint = _STORAGE[err.errno]
    hint = (hints or {}).get(err.errno, hint)
    # a rename names the temporary file first and the user's destination second: name the destination
    path = getattr(err, "filename2", None) or err.filename
    where = f" ({path})" if path else ""
    return StorageError(f"{what} failed: {why}{where}", f"{hint}; nothing half-written was published")


class storage_errors(contextlib.ContextDecorator):
    """Context manager and decorator: a storage OSError inside becomes a ``StorageError`` (others pass through).

    ``@storage_errors("dsedge build")`` on a function, or ``with storage_errors("writing the report"): …``.
    """

    def __init__(self, what: str = "writing") -> None:
        self.what = what

    def __enter__(self) -> "storage_errors":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, OSError):
            err = storage_error(exc, self.what)
            if err is not None:
                raise err from None
        return False


__all__ = ["storage_error", "storage_errors", "StorageError"]
