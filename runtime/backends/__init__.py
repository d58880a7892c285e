"""Execution backends and their registry: ``open_backend(variant, preferences)`` opens a bundle variant on the
backend its target names, falling back to ONNX Runtime where that backend cannot run here.

A backend is any object with ``name``, ``providers`` (list of str) and ``run(inputs: dict[str, np.ndarray]) ->
dict[str, np.ndarray]``. Adding one is one new module plus one call (no entry points)::

    from dsedge.runtime.backends import register_backend

    def open_mine(variant, preferences):           # -> a backend, or None: "not on this machine"
        return MyBackend(variant.onnx_path) if mine_is_installed() else None

    register_backend("mine", open_mine)             # targets with backend = "mine" now build and load

Built in: ``onnxruntime`` (:mod:`.ort`, always available) and ``tensorrt`` (:mod:`.tensorrt`: a prebuilt, cached or
freshly built engine when TensorRT and a GPU are here). Heavy modules are imported only when a backend is opened.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class VariantFiles:
    """What a backend opens: the verified bundle directory, its manifest and one of its variants."""

    bundle: Path
    manifest: Any
    variant: Any

    @property
    def onnx_path(self) -> Path:
        return self.bundle / self.variant.file


@dataclass(frozen=True)
class Preferences:
    """How the caller wants it run.

    Attributes:
        providers: ONNX Runtime provider names; given, they force ONNX Runtime (default: the target's backend, then
            ORT's TensorRT → CUDA → CPU chain).
        threads: intra-op CPU threads (None: the backend's default).
        backend: a registered backend name to use instead of the target's.
    """

    providers: Sequence[str] | None = None
    threads: int | None = None
    backend: str | None = None


Opener = Callable[[VariantFiles, Preferences], Any]
_OPENERS: dict[str, Opener] = {}


def register_backend(name: str, opener: Opener, *, replace: bool = False) -> None:
    """Register ``opener(variant, preferences) -> backend | None`` for targets whose ``backend`` is ``name``.

    Raises:
        ValueError: ``name`` is registered already (unless ``replace``).
    """
    if name in _OPENERS and not replace:
        raise ValueError(f"backend {name!r} is registered already")
    _OPENERS[name] = opener


def backend_names() -> list[str]:
    """The registered backends (what a target profile's ``backend`` may name)."""
    return list(_OPENERS)


def open_backend(variant: VariantFiles, preferences: Preferences = Preferences()) -> Any:
    """Open ``variant`` on the preferred backend: ``preferences.backend``, else the target's; ONNX Runtime when
    ORT providers are asked for, or when that backend returns None (not installed / no GPU here).

    Raises:
        BackendUnavailable: an unknown backend name or ORT provider. BundleError: the model cannot be loaded.
    """
    from ..errors import BackendUnavailable

    name = preferences.backend or (variant.manifest.target or {}).get("backend", "onnxruntime")
    if name not in _OPENERS:
        raise BackendUnavailable(f"no backend {name!r} is registered", f"registered: {', '.join(_OPENERS)}")
    found = None
    if name != "onnxruntime" and not preferences.providers:
        found = _OPENERS[name](variant, preferences)
    if found is None:
        found = _OPENERS["onnxruntime"](variant, preferences)
    return found


def _open_ort(variant: VariantFiles, preferences: Preferences) -> Any:
    from .ort import OrtBackend

    return OrtBackend(variant.onnx_path, providers=preferences.providers, threads=preferences.threads,
                      bundle=(variant.manifest, variant.variant))


def _open_tensorrt(variant: VariantFiles, preferences: Preferences) -> Any:
    from .tensorrt import open_engine_backend

    return open_engine_backend(variant.bundle, variant.manifest, variant.variant)


register_backend("onnxruntime", _open_ort)
register_backend("tensorrt", _open_tensorrt)
