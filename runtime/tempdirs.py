"""Temporary directories whose owner is certain: an owner record plus an advisory lock held by the live process.

Each temporary directory ``D`` (``.NAME.tmp-PID-xxxx`` beside a bundle, ``.dsedge-build-PID-xxxx`` in ``--out``)
has a sibling lock file ``D.lock``, created *before* ``D`` and holding the owner record (pid, host, start time,
command). The owner keeps an exclusive ``fcntl.flock`` on it for the directory's whole life; the kernel drops the
lock when the process dies, however it dies (``kill -9`` included). Clean-up of stale directories
(``remove_stale``) removes ``D`` only after taking that lock itself, so it can never delete a live build's
directory, whatever digits the names hold (a model called ``resnet-7777`` is not process 7777). A directory with no
lock file was left by a process killed between creating the two (or by an older dsedge): nobody can own it.

The lock lives outside ``D`` so that ``D`` can be renamed into place (``os.replace``) with nothing extra inside.
``flock`` locks are per open file: a second open of the same lock file, even in the owner process, cannot take it
(so a process never removes its own live directory either). On network filesystems without ``flock`` support the
lock may not hold across machines: keep ``--out`` on a local disk when several hosts build into it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

LOCK_SUFFIX = ".lock"
INIT_PREFIX = ".dsedge-new-"   # a lock file being made: never matched by is_temp_name
_held: dict[str, int] = {}          # directory path → fd of its locked lock file
_held_lock = threading.Lock()


def is_temp_name(name: str) -> bool:
    """True for the names dsedge gives temporary directories (and their lock files)."""
    return name.startswith(".") and (".tmp-" in name or name.startswith(".dsedge-build-"))


def owned_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """Create a fresh directory ``parent/PREFIXxxxx`` owned by this process (see the module docstring).

    The lock file is made and locked under a name no clean-up looks at (``.dsedge-new-…``), then linked to
    ``D.lock``, then ``D`` is made: whenever a clean-up can see ``D.lock`` it is already locked, and ``D`` never
    exists without it. Returns ``D``; release it with ``release`` (remove) or ``disown`` (after renaming it away).
    """
    parent = Path(parent)
    fd, init = tempfile.mkstemp(prefix=INIT_PREFIX, dir=parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # a brand-new file: always free
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": round(time.time(), 3),
                  "argv": sys.argv[:4]}
        os.write(fd, (json.dumps(record) + "\n").encode())
        for _ in range(100):
            d = parent / f"{prefix}{secrets.token_hex(5)}"
            lock = os.fspath(d) + LOCK_SUFFIX
            try:
                os.link(init, lock)
            except FileExistsError:
                continue
            except OSError:                      # a filesystem without hard links
                if os.path.exists(lock):
                    continue
                os.rename(init, lock)
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                os.unlink(lock)
                continue
            break
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary directory name", os.fspath(parent))
    except BaseException:
        os.close(fd)
        raise
    finally:
        with _suppress():
            os.unlink(init)
    with _held_lock:
        _held[os.fspath(d)] = fd
    return d


def owner(path: str | os.PathLike) -> dict | None:
    """The owner record of a temporary directory (``{"pid", "host", "started_unix", "argv"}``), or None."""
    try:
        return json.loads(Path(os.fspath(path) + LOCK_SUFFIX).read_text())
    except (OSError, ValueError):
        return None


def disown(path: str | os.PathLike) -> None:
    """Drop this process's ownership of ``path`` (already renamed away or removed): unlink its lock file, unlock."""
    key = os.fspath(path)
    with _held_lock:
        fd = _held.pop(key, None)
    if fd is None:
        return
    with _suppress():
        os.unlink(key + LOCK_SUFFIX)
    os.close(fd)


def release(path: str | os.PathLike) -> None:
    """Remove the owned directory ``path`` and its lock file."""
    shutil.rmtree(path, ignore_errors=True)
    disown(path)


def remove_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove temporary directories in ``parent`` whose owner is gone; returns what was removed.

    For each temporary directory: if its lock file exists, try to take the lock without waiting; held → the owner
    lives, skip; taken → the owner died, remove the directory, then the lock file. Without a lock file the directory
    has no owner: remove it. Orphan lock files (owner died before making its directory) are removed the same way.
    """
    removed: list[Path] = []
    parent = Path(parent)
    try:
        entries = [p for p in parent.iterdir() if is_temp_name(p.name)]
    except (FileNotFoundError, NotADirectoryError):
        return removed
    names = {p.name for p in entries}
    for p in entries:
        if p.name.endswith(LOCK_SUFFIX):
            if p.name[: -len(LOCK_SUFFIX)] not in names:   # orphan lock file: taken (and removed) if unowned
                _take(p)
            continue
        lock = p.with_name(p.name + LOCK_SUFFIX)
        if p.name + LOCK_SUFFIX in names:
            if _take(lock, p):
                removed.append(p)
        elif p.is_dir() and not p.is_symlink() and not lock.exists():
            # the lock file is made before the directory and removed after it is gone or renamed: a directory
            # without one has no owner (e.g. an older dsedge's, whose names carried only a pid)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _take(lock: Path, directory: Path | None = None) -> bool:
    """Lock ``lock`` without waiting; on success remove ``directory`` and ``lock``. False when someone holds it."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        if not os.path.exists(lock) or os.stat(lock).st_ino != os.fstat(fd).st_ino:
            return False   # removed (and maybe re-created) by another cleaner meanwhile
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        with _suppress():
            os.unlink(lock)
        return True
    finally:
        os.close(fd)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        return exc_type is not None and issubclass(exc_type, FileNotFoundError)


class publish_lock:
    """Exclusive ``flock`` on a directory while a bundle is renamed into it, so concurrent writers of one
    destination publish one after the other (the last one wins) instead of failing on each other's rename."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self.fd = -1

    def __enter__(self) -> "publish_lock":
        self.fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)   # closing the only descriptor drops the lock


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``). False when the system or the
    filesystem cannot (then the caller falls back to two renames)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a))
