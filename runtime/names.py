"""Names that become parts of paths (model, target, variant, bundle file names) and paths read from a bundle.

A name is 1–128 characters of ``[A-Za-z0-9._-]`` that does not start with a dot or a dash: it can never hold a
separator, be ``.``/``..``, hide a file, or read as a command-line option. A relative path inside a bundle is such
names joined by ``/``; after resolving links it must stay under its root.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import DsedgeError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")


def check_name(value: object, what: str, error: type[DsedgeError] = DsedgeError) -> str:
    """``value`` if it is a safe name; else raise ``error`` naming ``what`` (e.g. ``"target name"``)."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise error(f"{what} {value!r} is not a safe name",
                    "use 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or digit")
    return value


def safe_model_name(raw: str) -> str:
    """A safe name made from a file or directory name (``"My Model (v2)"`` → ``"my-model-v2"``).

    Raises:
        DsedgeError: nothing usable is left (e.g. ``"..."``).
    """
    from .errors import SourceError

    slug = re.sub(r"[^a-z0-9._-]+", "-", raw.lower().replace("_", "-"))
    slug = re.sub(r"-{2,}", "-", slug).strip(".-")[:128].rstrip(".-")
    if not NAME_RE.match(slug):
        raise SourceError(f"cannot make a bundle name from {raw!r}", "rename the model file or directory to letters and digits")
    return slug


def check_relpath(rel: object, what: str, error: type[DsedgeError] = DsedgeError) -> str:
    """``rel`` if it is a relative POSIX path of safe parts (no ``..``, no absolute path, no backslash)."""
    if not isinstance(rel, str) or not rel or len(rel) > 1024 or not all(
            _PART_RE.match(part) and part not in (".", "..") for part in rel.split("/")):
        raise error(f"{what} {rel!r} is not a safe relative path inside the bundle",
                    "paths in a bundle are relative, '/'-separated, without '..'")
    return rel


def inside(root: str | os.PathLike, rel: str, what: str, error: type[DsedgeError] = DsedgeError) -> Path:
    """``root / rel`` after checking ``rel`` (see ``check_relpath``) and that it resolves (links followed) under
    ``root``. Raises ``error`` otherwise."""
    check_relpath(rel, what, error)
    base = Path(root).resolve()
    p = (Path(root) / rel).resolve()
    if base != p and base not in p.parents:
        raise error(f"{what} {rel!r} resolves outside {Path(root).name}", "a bundle must not point outside itself")
    return Path(root) / rel


def bundle_dir(out_dir: str | os.PathLike, name: str, target: str, suffix: str = ".dse") -> Path:
    """``OUT/NAME-TARGET.dse`` after checking both names, so the bundle lands directly in ``out_dir``.

    Raises:
        BundleError: an unsafe model or target name.
    """
    from .errors import BundleError

    check_name(name, "model name", BundleError)
    check_name(target, "target name", BundleError)
    path = Path(out_dir) / f"{name}-{target}{suffix}"
    if path.resolve().parent != Path(out_dir).resolve():
        raise BundleError(f"bundle {path.name!r} would not land in {str(out_dir)!r}", "choose another --out")
    return path
