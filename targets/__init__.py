"""Target profiles: what a device can run, as data files (``profiles/*.toml``).

Adding a device means adding a profile file — in this folder, in ``$DSEDGE_TARGETS_DIR`` (or
``~/.config/dsedge/targets``), or passed as a path (``--target ./my-device.toml``) — not code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..runtime.errors import TargetError
from ..runtime.schema import validate

PROFILE_DIR = Path(__file__).parent / "profiles"
MODEL_PRECISIONS = ("int4", "int8", "fp16", "bf16", "fp32")
ENGINE_FLAGS = ("tf32", "fp8", "sparsity")  # builder modes, not model precisions
BACKENDS = ("tensorrt", "onnxruntime")


@dataclass(frozen=True)
class Target:
    """A deployment target.

    Attributes:
        name: canonical name (``jetson-orin``); ``aliases`` also resolve to it (``jetson``).
        backend: ``"tensorrt"`` (GPU targets; ORT is the fallback) or ``"onnxruntime"``.
        compute_capability: e.g. ``"8.7"``; None for CPU.
        precisions: model precisions the target runs (subset of int4, int8, fp16, bf16, fp32).
        precision_order: preference for ``--precision auto``, best first.
        engine_flags: builder-only modes (``tf32``, ``fp8``, ``sparsity``) — not model precisions.
        dla_cores: number of DLA cores (0 = none).
        memory_gb: device memory, GiB.
        tensorrt: ``{"version": "10.3", "min": "10.3"}``; opset: ``{"min": 13, "max": 21}``.
        workspace_mb: default TensorRT workspace memory pool, MiB.
        default_budget_ms: latency budget used when neither request nor bundle gives one.
        shapes: ``{"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {...}}`` for optimization profiles.
        hardware_compatibility: TensorRT hardware-compatibility level the engine may be built with
            (``"ampere+"`` on x86 data-center GPUs; ``""`` = engine tied to this exact GPU, e.g. Jetson).
        version_compatible: build version-compatible engines (run on newer TensorRT of the same major).
        auto_by_latency: ``--precision auto`` builds every precision in ``precision_order``, measures each, and keeps
            the fastest that stays accurate (ORT CPU: INT8 Conv3d can be slower than fp32).
    """

    name: str
    description: str = ""
    aliases: tuple[str, ...] = ()
    backend: str = "onnxruntime"
    gpu: str = ""
    compute_capability: str | None = None
    precisions: tuple[str, ...] = ("fp32",)
    precision_order: tuple[str, ...] = ("fp32",)
    engine_flags: tuple[str, ...] = ()
    dla_cores: int = 0
    memory_gb: float = 0.0
    tensorrt: dict[str, Any] = field(default_factory=dict)
    opset: dict[str, int] = field(default_factory=lambda: {"min": 13, "max": 21})
    workspace_mb: int = 0
    default_budget_ms: float = 50.0
    shapes: dict[str, dict[str, int]] = field(default_factory=dict)
    hardware_compatibility: str = ""
    version_compatible: bool = False
    auto_by_latency: bool = False
    notes: tuple[str, ...] = ()
    source: str = ""

    def supports(self, precision: str) -> bool:
        return precision in self.precisions

    @property
    def trt_version(self) -> tuple[int, int] | None:
        """TensorRT version the target's software stack ships, as ``(major, minor)``; None for ORT-only targets."""
        v = self.tensorrt.get("version")
        if not v:
            return None
        major, _, rest = str(v).partition(".")
        return int(major), int(rest.partition(".")[0] or 0)

    @property
    def sm(self) -> str:
        """``"sm87"`` for compute capability ``"8.7"``; ``""`` for CPU targets."""
        return "sm" + self.compute_capability.replace(".", "") if self.compute_capability else ""

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        if Path(self.source).parent == PROFILE_DIR:  # a bundle names dsedge's own profile, not this machine's path
            d["source"] = f"builtin:{Path(self.source).name}"
        return d


_FIELDS = set(Target.__dataclass_fields__) - {"source"}


def _user_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("DSEDGE_TARGETS_DIR"):
        dirs.append(Path(os.environ["DSEDGE_TARGETS_DIR"]))
    dirs.append(Path.home() / ".config" / "dsedge" / "targets")
    return [d for d in dirs if d.is_dir()]


def _profile_files() -> list[Path]:
    files: dict[str, Path] = {}
    for d in [PROFILE_DIR, *_user_dirs()]:  # user profiles override built-ins of the same file name
        for p in sorted(d.glob("*.toml")):
            files[p.stem] = p
    return list(files.values())


def load_profile(path: str | os.PathLike) -> Target:
    """Parse one profile file and check it against ``dsedge.target-profile/1`` (``runtime/schemas/``) and its
    consistency rules (``runtime.schema.check_consistency``). Raises TargetError naming the file and the bad field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TargetError(f"target profile {str(path)!r} does not exist", "pass a .toml profile or a target name") from None
    except IsADirectoryError:
        raise TargetError(f"target profile {str(path)!r} is a directory", "pass a .toml profile or a target name") from None
    except RecursionError:
        raise TargetError(f"target profile {path.name} nests too deeply", "compare with a built-in profile") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as e:
        raise TargetError(f"target profile {path} is not valid TOML: {e}", "fix the file's syntax") from None
    unknown = sorted(set(data) - _FIELDS - {"schema"})
    if unknown:
        raise TargetError(f"target profile {path.name} has unknown key {unknown[0]!r}",
                          f"allowed keys: {', '.join(sorted(_FIELDS))}")
    if "name" not in data:
        raise TargetError(f"target profile {path.name} has no 'name'", "add name = \"my-device\"")
    validate("target-profile", data, TargetError, f"target profile {path.name}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "schema"}
    kwargs.setdefault("precision_order", kwargs.get("precisions", ("fp32",)))
    target = Target(source=str(path), **kwargs)
    from ..runtime.backends import backend_names

    if target.backend not in backend_names():  # registered backends (register_backend), not a fixed list
        raise TargetError(f"target profile {path.name}: backend is {target.backend!r}",
                          f"use one of {', '.join(backend_names())}, or register yours first")
    return target


def list_targets() -> list[Target]:
    """All profiles: built-in ones and the user's, sorted by name; a user profile overrides a built-in one of the
    same file name or the same ``name`` (with a warning naming both files), so each name lists once.

    A malformed user profile is skipped with a warning naming its path (one bad file must not hide every target);
    a malformed built-in profile raises TargetError. A user profile's alias that is another target's name or a
    built-in target's alias (it would never resolve to this profile, or would break the built-in alias) is dropped
    from it with a warning; the rest of the profile stays usable.
    """
    import dataclasses
    import logging

    out = []
    for path in _profile_files():
        try:
            out.append(load_profile(path))
        except TargetError as e:
            if path.parent == PROFILE_DIR:
                raise
            logging.getLogger("dsedge").warning("skipping target profile %s: %s", path, e)
    by_name: dict[str, Target] = {}
    for t in out:  # in _profile_files' order: a user profile overrides a built-in (or earlier) one of its name too
        if t.name in by_name:
            logging.getLogger("dsedge").warning("target profile %s overrides %s, of the same name %r", t.source,
                                                by_name[t.name].source, t.name)
        by_name[t.name] = t
    out = list(by_name.values())
    names = {t.name: t for t in out}
    builtin = {a: t for t in out if Path(t.source).parent == PROFILE_DIR for a in t.aliases}
    for i, t in enumerate(out):
        if Path(t.source).parent == PROFILE_DIR:
            continue
        clash = {a: names.get(a) or builtin[a] for a in t.aliases if a != t.name and (a in names or a in builtin)}
        for alias, other in clash.items():
            logging.getLogger("dsedge").warning(
                "target profile %s: dropping alias %r, it is %s target %s", t.source, alias,
                "the name of" if alias == other.name else "an alias of the built-in", other.name)
        if clash:
            out[i] = dataclasses.replace(t, aliases=tuple(a for a in t.aliases if a not in clash))
    return sorted(out, key=lambda t: t.name)


def get_target(name_or_path: str | os.PathLike) -> Target:
    """Resolve a target by name, alias, or profile file path (``./my-device.toml``).

    Raises:
        TargetError: no such target (the hint lists the known ones), or a malformed profile (also a user profile
            named like the target, which ``list_targets`` skips).
    """
    s = os.fspath(name_or_path)
    if s.endswith(".toml") or os.sep in s:
        return load_profile(s)
    key = s.strip().lower()
    targets = list_targets()
    for t in targets:
        if key == t.name:
            return t
    claimed = [t for t in targets if key in t.aliases]
    if len(claimed) > 1:
        raise TargetError(f"target alias {s!r} is claimed by {claimed[0].source} and {claimed[1].source}",
                          "use the full target name, or remove the alias from one profile")
    if claimed:
        return claimed[0]
    for path in _profile_files():  # a profile of that name that list_targets skipped: say why, not "unknown"
        if path.stem.lower() == key:
            load_profile(path)
    names = ", ".join(t.name + (f" ({'/'.join(t.aliases)})" if t.aliases else "") for t in targets)
    raise TargetError(f"unknown target {s!r}", f"known targets: {names}; or pass a profile file ./my-device.toml")
