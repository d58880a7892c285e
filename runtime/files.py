"""File helpers used across dsedge: one chunked ``sha256_file`` (``hashlib.file_digest`` needs Python 3.11 and
JetPack 6 ships 3.10) and atomic writes — a temporary file in the destination's folder, then ``os.replace``, so a
reader sees the old file or the new one, never half of one."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike, chunk: int = CHUNK) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte blocks (1 MiB), so memory stays flat for GB-sized models."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def usual_mode(bits: int = 0o666) -> int:
    """``bits`` less the process umask: the mode ``open()`` would give, for files made by ``mkstemp`` (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return bits & ~umask


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest`` to write; on success it is renamed to ``dest`` (with the mode a plain
    ``open()`` would give), on any exception removed and ``dest`` left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, usual_mode())               # mkstemp makes 0600
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_output_file(dest: str | os.PathLike, option: str = "-o/--output", example: str = "model.onnx") -> Path:
    """Refuse an output file path that can never be written, before any work is done: an existing directory, a
    parent that is a file, or a nearest existing parent folder this process may not write (``os.access``, then an
    empty temporary file made there and removed: as root ``os.access`` says yes to ``/proc`` and ``/sys``, which
    refuse every new file) (``example`` names a file in the hint). Returns ``dest`` as a Path.

    Raises:
        StorageError: naming ``option`` and the path.
    """
    from .errors import StorageError

    dest = Path(dest)
    if dest.is_dir():
        raise StorageError(f"{option} {str(dest)!r}: the path is a directory, where a file was expected",
                           f"give a file path, e.g. {str(dest / example)!r}")
    sealed = _sealing_bundle(dest)
    if sealed is not None:
        bundle, rel = sealed
        if rel == _MANIFEST:
            raise StorageError(f"{option} {str(dest)!r} is a file of the bundle {str(bundle)!r} (its manifest, "
                               "which holds every file's sha256: the bundle would no longer load)",
                               "write elsewhere: only `dsedge build` writes a bundle's manifest")
        if rel == _SIGNATURE:
            raise StorageError(f"{option} {str(dest)!r} is a file of the bundle {str(bundle)!r} (the signature of "
                               "its manifest: the bundle's signature would no longer verify)",
                               "write elsewhere: only `dsedge sign` writes a bundle's manifest.sig")
        raise StorageError(f"{option} {str(dest)!r} is a file of the bundle {str(bundle)!r} (its manifest holds the "
                           "file's sha256: the bundle would no longer load)",
                           "write elsewhere, then rebuild the bundle with `dsedge build`")
    for parent in dest.parents:
        if parent.exists():
            if not parent.is_dir():
                raise StorageError(f"{option} {str(dest)!r}: a file is in the way ({str(parent)!r} is a file, "
                                   "not a directory)",
                                   "choose a path whose parents are directories")
            # the nearest folder that exists must take a new entry (the temporary file, or a folder to hold it)
            if not os.access(parent, os.W_OK | os.X_OK) or not _takes_new_files(parent):
                raise StorageError(f"{option} {str(dest)!r}: the folder {str(parent)!r} is not writable",
                                   "write somewhere you may create files, or change the folder's permissions")
            break
    return dest


def _takes_new_files(folder: Path) -> bool:
    """An empty temporary file can be made in ``folder`` (it is removed at once)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dsedge-write-check-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def check_report_file(report: str | os.PathLike, output: str | os.PathLike,
                      model: str | os.PathLike | None = None) -> Path:
    """``check_output_file`` for a ``--report`` path, and refuse one that is the ``output`` model or the source
    ``model``: the JSON report would replace it (and the command said it wrote a model).

    Raises:
        StorageError: naming the two options and the path.
    """
    from .errors import StorageError

    report = check_output_file(report, "--report", "report.json")
    for option, other in (("-o/--output", output), ("MODEL", model)):
        if other is not None and os.path.abspath(report) == os.path.abspath(other):
            raise StorageError(f"--report {str(report)!r} is the same file as {option}: the JSON report would "
                               "replace the model", "give the report its own path, e.g. --report report.json")
    return report


def enclosing_bundle(path: str | os.PathLike) -> Path | None:
    """The bundle directory (``NAME.dse`` holding a ``manifest.json``) that ``path`` is or lies inside, by its
    absolute and its resolved path; None if there is none."""
    here = Path(os.path.abspath(path))
    for p in (here, here.resolve()):
        for d in (p, *p.parents):
            if d.name.endswith(".dse") and (d / "manifest.json").is_file():
                return d
    return None


# bundle.MANIFEST and bundle.SIGNATURE (bundle imports this module): a bundle's own files, never in manifest["files"]
_MANIFEST = "manifest.json"
_SIGNATURE = "manifest.sig"


def _sealing_bundle(dest: Path) -> tuple[Path, str] | None:
    """The bundle directory that seals ``dest``, with ``dest``'s path inside it: its ``manifest.json`` lists ``dest``
    among its hashed files, or ``dest`` is that ``manifest.json`` or its ``manifest.sig`` (not hash-listed, yet
    replacing either breaks the bundle). A folder counts as a bundle when its ``manifest.json`` holds a ``files``
    table or its name ends in ``.dse``, so a bench report once written as ``out/manifest.json`` may be rewritten.
    Checked for the path the write replaces (``dest``'s name in its resolved folder) and for ``dest`` resolved."""
    dest = Path(os.path.abspath(dest))
    for path in dict.fromkeys((dest.parent.resolve() / dest.name, dest.resolve())):
        sealed = _sealing_bundle_of(path)
        if sealed is not None:
            return sealed
    return None


def _sealing_bundle_of(path: Path) -> tuple[Path, str] | None:
    for parent in path.parents:
        manifest = parent / _MANIFEST
        if manifest.is_file():
            rel = path.relative_to(parent).as_posix()
            try:
                doc = json.loads(manifest.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError):
                doc = None
            files = doc.get("files") if isinstance(doc, dict) else None
            if isinstance(files, dict) and rel in files:
                return parent, rel
            if rel in (_MANIFEST, _SIGNATURE) and (isinstance(files, dict) or parent.name.endswith(".dse")):
                return parent, rel
            return None
    return None


def write_bytes_atomic(dest: str | os.PathLike, data: bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` to ``dest`` atomically; ``fsync`` flushes it to disk before the rename. Returns ``dest``."""
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return Path(dest)


def write_text_atomic(dest: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``dest`` atomically; returns ``dest``."""
    return write_bytes_atomic(dest, text.encode(encoding))
