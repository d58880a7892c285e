"""``dsedge.load`` and ``Session``: a verified bundle bound to the best backend this machine has."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .runtime.backends.ort import OrtBackend
from .runtime.bundle import IOSpec, Manifest, Variant, verify_bundle
from .runtime.io import validate_inputs

log = logging.getLogger("dsedge")


class Session:
    """A loaded bundle variant, ready to run.

    Attributes:
        manifest: the verified manifest.
        variant: the variant being served (``Variant``: name, precision, file …).
        inputs / outputs: ``IOSpec`` lists (``.name``, ``.dtype``, ``.shape`` with symbolic dims as strings).
        providers: ORT providers really in use, e.g. ``["CPUExecutionProvider"]`` for a Jetson bundle on a laptop.
        backend_name: ``"onnxruntime"`` (or ``"tensorrt"`` where a TensorRT engine serves it).
    """

    def __init__(self, path: str | os.PathLike, manifest: Manifest, variant: Variant, backend: Any) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.variant = variant
        self._backend = backend
        self.inputs: list[IOSpec] = list(manifest.inputs)
        self.outputs: list[IOSpec] = list(manifest.outputs)

    @property
    def providers(self) -> list[str]:
        return list(getattr(self._backend, "providers", []))

    @property
    def backend_name(self) -> str:
        return getattr(self._backend, "name", type(self._backend).__name__)

    @property
    def target(self) -> str:
        return str(self.manifest.target.get("name", "?"))

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run one batch synchronously.

        Args:
            inputs: numpy arrays keyed by input name, dtypes and shapes as in ``self.inputs``.
        Returns:
            numpy arrays keyed by output name.
        Raises:
            InputError: a missing/unknown name, wrong dtype or shape (checked before the backend runs).
        """
        checked = validate_inputs(self.inputs, inputs, self.manifest.shape_ranges)
        return self._backend.run(checked)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: bundle, target, variant, backend and providers in use."""
        return {
            "bundle": str(self.path), "name": self.manifest.name, "target": self.target,
            "variant": self.variant.name, "precision": self.variant.precision,
            "backend": self.backend_name, "providers": self.providers,
        }

    def close(self) -> None:
        self._backend = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Session({self.manifest.name!r}, target={self.target!r}, variant={self.variant.name!r}, "
                f"providers={self.providers})")


def load(path: str | os.PathLike, variant: str | None = None, providers: Sequence[str] | None = None,
         threads: int | None = None) -> Session:
    """Verify a bundle (manifest and every sha256) and open a variant on the best available backend.

    Args:
        path: the ``NAME-TARGET.dse`` directory.
        variant: variant name (default: the manifest's ``default_variant``).
        providers: ORT providers to use (default: TensorRT EP → CUDA EP → CPU EP, whichever exist).
        threads: intra-op CPU threads (default: ORT's choice).
    Raises:
        BundleError / BundleIntegrityError: missing, malformed, truncated or tampered bundle.
        BackendUnavailable: a requested provider is not installed.
    """
    manifest = verify_bundle(path)
    v = manifest.variant(variant)
    backend = None
    if not providers:  # a TensorRT engine when this machine has TensorRT and a GPU; else None
        from .runtime.backends.tensorrt import open_engine_backend

        backend = open_engine_backend(path, manifest, v)
    if backend is None:
        backend = OrtBackend(Path(path) / v.file, providers=providers, threads=threads)
        if manifest.target.get("backend") == "tensorrt" and backend.providers[:1] == ["CPUExecutionProvider"]:
            log.info("bundle for %s runs on ONNX Runtime's CPU provider here (no TensorRT/CUDA found)",
                     manifest.target.get("name"))
    return Session(path, manifest, v, backend)
