"""Write a bundle directory atomically from ONNX files and metadata (the last stage of ``dsedge build``)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ..runtime.version import __version__
from .model_check import check_onnx_file
from ..runtime.errors import BundleError
from ..runtime.files import enclosing_bundle
from ..runtime.names import bundle_dir, inside
from ..runtime.schema import dumps
from ..runtime.storage import storage_errors
from ..runtime.bundle import BUNDLE_SUFFIX, IOSpec, Manifest, Variant, atomic_directory, write_manifest


def bundle_path(out_dir: str | os.PathLike, name: str, target: str) -> Path:
    """``OUT/NAME-TARGET.dse``."""
    return bundle_dir(out_dir, name, target, BUNDLE_SUFFIX)


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Refuse an output directory inside a bundle (``--out`` pointed into the bundle a build reads its model from):
    the new bundle and the build's scratch directory were written into it, files its manifest does not list.

    Raises:
        BundleError: ``out_dir`` is a bundle or lies inside one.
    """
    d = enclosing_bundle(out_dir)
    if d is not None:
        raise BundleError(f"--out {out_dir} is inside the bundle {d}; a build does not write into a bundle",
                          f"pass an output directory outside it, e.g. --out {d.parent}")


def check_replaceable(dest: str | os.PathLike) -> None:
    """Refuse a bundle destination that exists and is not a bundle (a file, or a directory without a manifest):
    a build replaces only a bundle.

    Raises:
        BundleError: ``dest`` exists and is not a dsedge bundle.
    """
    dest = Path(dest)
    if dest.exists() and not (dest / "manifest.json").is_file():
        raise BundleError(f"{dest} exists and is not a dsedge bundle; refusing to replace it",
                          "move it away or choose another --out directory")


@storage_errors("writing the bundle")
def write_bundle(
    dest: str | os.PathLike,
    *,
    name: str,
    target: dict[str, Any],
    inputs: list[IOSpec],
    outputs: list[IOSpec],
    models: dict[str, str | os.PathLike],
    variants: list[Variant],
    default_variant: str,
    shape_ranges: dict[str, dict[str, int]] | None = None,
    latency_budget_ms: float | None = None,
    source: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
    extra_files: dict[str, str | bytes] | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Assemble and atomically publish a bundle at ``dest``.

    Args:
        models: relative path in the bundle (``"models/int4.onnx"``) → ONNX file to copy there.
        variants: one per model; ``size_bytes`` is filled from the copied file.
        extra_files: relative path → text or bytes (``build/trtexec.sh``, …).
        before_commit: called with the temporary directory after all files are in place and before the rename
            (tests use it to simulate a crash).
    Returns:
        ``dest`` as a Path. Nothing exists at ``dest`` unless every file and the manifest were written.
    """
    dest = Path(dest)
    check_replaceable(dest)
    with atomic_directory(dest) as tmp:
        for rel, src in models.items():
            p = inside(tmp, rel, "bundle file", BundleError)
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, p)
            check_onnx_file(p, rel)
        for v in variants:
            v.size_bytes = (tmp / v.file).stat().st_size
        for rel, content in (extra_files or {}).items():
            p = inside(tmp, rel, "bundle file", BundleError)
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(content, encoding="utf-8")
            if rel.endswith(".sh"):
                p.chmod(0o755)
        if report is not None:
            (tmp / "report.json").write_text(dumps("build-report", report, BundleError, "report.json"), encoding="utf-8")
        manifest = Manifest(
            name=name, target=target, inputs=inputs, outputs=outputs, variants=variants,
            default_variant=default_variant, source=source or {}, shape_ranges=shape_ranges or {},
            latency_budget_ms=latency_budget_ms, dsedge_version=__version__,
        )
        write_manifest(tmp, manifest)
        if before_commit is not None:
            before_commit(tmp)
    return dest
