"""TensorRT engine files with metadata, and the on-device engine cache.

An engine is valid only on the GPU model and TensorRT version it was built with, for the exact ONNX and build
settings. Each ``.engine`` file therefore carries a header::

    b"DSEDGE-ENGINE\\0" | u32 little-endian header length | header JSON (UTF-8) | serialized TensorRT plan

The header holds the ``EngineKey`` (GPU name, compute capability, SM count, TensorRT version, model sha256, settings
sha256) and the plan's sha256. Reading checks magic, length and plan hash (corrupt → ``EngineError``); a readable
engine whose key differs from this machine's is stale or foreign and is never loaded: the caller rebuilds it and the
cache logs one line saying why. Files are written to a temporary name and renamed, so a crash leaves no half engine.

The cache lives in ``$DSEDGE_ENGINE_CACHE`` or ``~/.cache/dsedge/engines``; one slot per (variant, model hash,
GPU, device: the GPU itself or a DLA core), so a TensorRT upgrade on the same device overwrites the old engine instead
of piling up, and a DLA engine and a GPU engine of one variant are cached side by side.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import EngineError
from .files import write_bytes_atomic

log = logging.getLogger("dsedge.engine")

MAGIC = b"DSEDGE-ENGINE\x00"
FORMAT_VERSION = 1
SUFFIX = ".engine"
_MAX_HEADER = 1 << 20


def settings_digest(fields: dict[str, Any]) -> str:
    """sha256 hex of the build settings that change an engine (canonical JSON)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "gpu"


@dataclass(frozen=True)
class EngineKey:
    """What an engine is valid for. ``tensorrt`` is the full version string (``"10.3.0.30"``); engines are only
    loadable by the TensorRT that built them (unless built version-compatible, which dsedge still keys exactly)."""

    variant: str
    gpu: str
    compute_capability: str
    sm_count: int
    tensorrt: str
    model_sha256: str
    settings_sha256: str
    dla_core: int | None = None  # the DLA core the engine runs on (Jetson), None: the GPU

    def slot(self) -> str:
        """Cache file name: variant, model, GPU and DLA core, not the TensorRT version (an upgrade replaces the
        engine). A GPU engine's name has no device part (the name engines had before DLA engines got slots of their
        own, so prebuilt engines in bundles and cached ones still match); a DLA engine's ends in ``-dla0``/``-dla1``."""
        sm = "sm" + self.compute_capability.replace(".", "")
        dla = "" if self.dla_core is None else f"-dla{int(self.dla_core)}"
        return f"{_slug(self.variant)}-{self.model_sha256[:16]}-{_slug(self.gpu)}-{sm}-{self.sm_count}{dla}{SUFFIX}"

    def timing_cache_name(self) -> str:
        """TensorRT's timing cache is valid for one device and TensorRT version only: one file per GPU and version
        (a shared one would be refused by, or mislead, another GPU's or version's builder)."""
        sm = "sm" + self.compute_capability.replace(".", "")
        return f"timing-{_slug(self.gpu)}-{sm}-{self.sm_count}-trt{_slug(self.tensorrt)}.cache"

    def mismatch(self, other: dict[str, Any]) -> str | None:
        """Why an engine with header key ``other`` must not be loaded for this key (one line), or None."""
        o = other
        if (o.get("gpu"), o.get("compute_capability"), o.get("sm_count")) != (self.gpu, self.compute_capability,
                                                                              self.sm_count):
            return (f"built for GPU {o.get('gpu')!r} (sm{str(o.get('compute_capability', '?')).replace('.', '')}, "
                    f"{o.get('sm_count')} SMs), this is {self.gpu!r} (sm{self.compute_capability.replace('.', '')}, "
                    f"{self.sm_count} SMs)")
        if o.get("dla_core") != self.dla_core:  # a header written before the field: a GPU engine (None)
            def where(core: Any) -> str:
                return "the GPU" if core is None else f"DLA core {core}"
            return f"built for {where(o.get('dla_core'))}, this run is on {where(self.dla_core)}"
        if o.get("tensorrt") != self.tensorrt:
            return f"built with TensorRT {o.get('tensorrt')}, this is TensorRT {self.tensorrt}"
        if o.get("model_sha256") != self.model_sha256:
            return "built from another model file (bundle hash differs)"
        if o.get("settings_sha256") != self.settings_sha256:
            return "built with other settings (precision, shapes, DLA, workspace)"
        if o.get("variant") != self.variant:
            return f"built for variant {o.get('variant')!r}, not {self.variant!r}"
        return None


def write_engine(path: str | os.PathLike, plan: bytes, key: EngineKey, extra: dict[str, Any] | None = None) -> Path:
    """Write ``plan`` with its header to ``path`` atomically (temp file in the same folder, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT_VERSION, "key": asdict(key), "plan_sha256": hashlib.sha256(plan).hexdigest(),
              "plan_bytes": len(plan), **(extra or {})}
    blob = json.dumps(header, sort_keys=True).encode()
    return write_bytes_atomic(path, MAGIC + struct.pack("<I", len(blob)) + blob + plan, fsync=True)


def read_engine(path: str | os.PathLike) -> tuple[dict[str, Any], bytes]:
    """Return ``(header, plan)``.

    Raises:
        EngineError: not a dsedge engine file, truncated, malformed header, or plan sha256 mismatch (corrupt).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EngineError(f"cannot read engine {path.name}: {e.strerror}", "rebuild the engine") from None
    header, start = _parse_header(path.name, data)
    plan = data[start:]
    if len(plan) != header.get("plan_bytes") or hashlib.sha256(plan).hexdigest() != header.get("plan_sha256"):
        raise EngineError(f"engine {path.name} is corrupt or truncated (plan sha256 mismatch)", _HINT)
    return header, plan


def read_engine_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header alone, without reading or checking the plan (to choose among engine files; ``read_engine`` the
    chosen one).

    Raises:
        EngineError: unreadable, not a dsedge engine file, truncated or malformed header.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            n = struct.unpack_from("<I", head, len(MAGIC))[0] if len(head) == len(MAGIC) + 4 else 0
            data = head + f.read(min(n, _MAX_HEADER + 1))
    except OSError as e:
        raise EngineError(f"cannot read engine {path.name}: {e.strerror}", "rebuild the engine") from None
    return _parse_header(path.name, data)[0]


_HINT = "delete it; dsedge rebuilds the engine on the next load"


def _parse_header(name: str, data: bytes) -> tuple[dict[str, Any], int]:
    # (header, offset of the plan) from an engine file's leading bytes
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise EngineError(f"{name} is not a dsedge engine file (bad magic)", _HINT)
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if n > _MAX_HEADER or start + n > len(data):
        raise EngineError(f"engine {name} is truncated (header)", _HINT)
    try:
        header = json.loads(data[start:start + n])
        key = header["key"]
        if header.get("format") != FORMAT_VERSION or not isinstance(key, dict):
            raise ValueError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise EngineError(f"engine {name} has a malformed header", _HINT) from None
    return header, start + n


def load_matching(path: str | os.PathLike, key: EngineKey) -> tuple[bytes | None, str | None]:
    """``(plan, None)`` when ``path`` holds a sound engine for ``key``; else ``(None, reason)``; ``(None, None)`` when
    there is no file."""
    if not Path(path).is_file():
        return None, None
    try:
        header, plan = read_engine(path)
    except EngineError as e:
        return None, str(e)
    reason = key.mismatch(header["key"])
    return (None, reason) if reason else (plan, None)


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSEDGE_ENGINE_CACHE") or Path.home() / ".cache" / "dsedge" / "engines")


class EngineCache:
    """Engines built on this device, one file per slot (see ``EngineKey.slot``).

    ``get_or_build(key, build)`` returns a plan for ``key``: the cached one when sound and matching, else
    ``build()``'s result, stored for next time. A stale, foreign or corrupt file is replaced, with a log line on
    ``dsedge.engine`` saying why.
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def path_for(self, key: EngineKey) -> Path:
        return self.root / key.slot()

    def get(self, key: EngineKey) -> bytes | None:
        plan, reason = load_matching(self.path_for(key), key)
        if reason:
            log.warning("engine cache: %s %s; rebuilding", self.path_for(key).name, reason)
        return plan

    def put(self, key: EngineKey, plan: bytes, extra: dict[str, Any] | None = None) -> Path:
        return write_engine(self.path_for(key), plan, key, extra)

    def store(self, key: EngineKey, plan: bytes) -> Path | None:
        """``put``, but a cache that cannot be written (read-only, a file in the way, disk full) only costs the
        next load a rebuild: logged on ``dsedge.engine``, never raised (the engine in hand is still used)."""
        try:
            return self.put(key, plan)
        except OSError as e:
            log.warning("engine cache: cannot write %s (%s); the engine is used but not cached, so the next load "
                        "rebuilds it (set $DSEDGE_ENGINE_CACHE to a writable folder)", self.path_for(key),
                        e.strerror or type(e).__name__)
            return None

    def get_or_build(self, key: EngineKey, build: Callable[[], bytes],
                     verify: Callable[[bytes], Any] | None = None) -> tuple[bytes, bool]:
        """``(plan, built)``: ``built`` is True when ``build()`` ran.

        ``verify(plan)`` runs on a freshly built plan before it is stored (dsedge runs the bundle's golden inputs on
        it); if it raises, nothing is cached and the error propagates, so a wrong engine is never reused.
        A cache that cannot be written is logged and skipped (see ``store``).
        Raises what ``build`` or ``verify`` raise.
        """
        plan = self.get(key)
        if plan is not None:
            log.info("engine cache: using %s", self.path_for(key))
            return plan, False
        log.info("engine cache: building %s engine for %s (%s, TensorRT %s); this takes minutes once", key.variant,
                 key.gpu, key.compute_capability, key.tensorrt)
        plan = build()
        if verify is not None:
            verify(plan)
        self.store(key, plan)
        return plan, True
