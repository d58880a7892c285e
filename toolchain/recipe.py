"""``build/trtexec.sh``: the exact ``trtexec`` command per variant for the bundle's target, so a user can build the
engines by hand on the device. Flags are spelled as the trtexec of the target's TensorRT version spells them:

- TensorRT 8.5: ``--memPoolSize=workspace:N`` (``--workspace`` deprecated), ``--buildOnly``; no ``--stronglyTyped``,
  ``--bf16``, ``--versionCompatible`` or ``--hardwareCompatibilityLevel`` (those came with 8.6–9.x).
- TensorRT 10.x: ``--workspace`` and implicit batch removed; ``--skipInference``; weak (``--fp16``/``--int8``/
  ``--bf16``) or ``--stronglyTyped`` builds.
- TensorRT 11.x: all precision flags (``--fp16 --int8 --bf16 --fp8 --int4 --best``) removed; networks are always
  strongly typed (TensorRT 10.x→11.x trtexec migration guide).

The settings come from ``dsedge.runtime.build_settings``, the same the on-device builder uses.
"""
from __future__ import annotations

import shlex
from typing import Any, Mapping

from ..runtime.version import __version__
from ..runtime.build_settings import EngineBuildSettings, engine_build_settings
from ..runtime.errors import TargetError
from ..targets import Target

_COMMON = {"onnx", "saveEngine", "minShapes", "optShapes", "maxShapes", "memPoolSize", "timingCacheFile",
           "useDLACore", "allowGPUFallback", "sparsity", "noTF32", "verbose", "loadEngine"}
# trtexec options per TensorRT major version (from each version's `trtexec --help` and NVIDIA's migration guides).
TRTEXEC_FLAGS: dict[int, frozenset[str]] = {
    8: frozenset(_COMMON | {"fp16", "int8", "best", "workspace", "buildOnly", "explicitBatch"}),
    10: frozenset(_COMMON | {"fp16", "int8", "bf16", "fp8", "int4", "best", "stronglyTyped", "skipInference",
                             "versionCompatible", "hardwareCompatibilityLevel"}),
    11: frozenset(_COMMON | {"stronglyTyped", "skipInference", "versionCompatible", "hardwareCompatibilityLevel"}),
}
ENGINE_DIR = "engines"
TIMING_CACHE = "build/timing.cache"


def _flag_set(trt: tuple[int, int]) -> frozenset[str]:
    return TRTEXEC_FLAGS[8 if trt[0] < 10 else (10 if trt[0] == 10 else 11)]


def _shape_arg(shapes: Mapping[str, tuple], idx: int) -> str:
    parts = []
    for name, triple in shapes.items():
        dims = "x".join(str(d) for d in triple[idx]) or "1"
        # trtexec splits on ',' and ':'; names holding them must be single-quoted inside the value
        parts.append(f"'{name}':{dims}" if any(c in name for c in ",:'") else f"{name}:{dims}")
    return ",".join(parts)


def trtexec_args(s: EngineBuildSettings, engine_dir: str = ENGINE_DIR, timing_cache: str = TIMING_CACHE) -> list[str]:
    """trtexec arguments (without the program name) for one variant's settings, in the target version's spelling.

    Raises:
        TargetError: a flag this TensorRT version's trtexec does not have (a bug in the settings, never silent).
    """
    args = [f"--onnx={s.onnx_file}", f"--saveEngine={engine_dir}/{s.variant}.plan"]
    if s.shapes and any(lo != hi for lo, _, hi in s.shapes.values()) or s.dla_core is not None:
        args += [f"--minShapes={_shape_arg(s.shapes, 0)}", f"--optShapes={_shape_arg(s.shapes, 1)}",
                 f"--maxShapes={_shape_arg(s.shapes, 2)}"]
    args += [f"--{f}" for f in s.precision_flags]
    if s.strongly_typed and s.trt_version[0] == 10:
        args.append("--stronglyTyped")  # 11.x: always on, the flag is a no-op
    if s.workspace_mb:
        args.append(f"--memPoolSize=workspace:{s.workspace_mb}")  # MiB in 8.5 and 10.x
    args.append(f"--timingCacheFile={timing_cache}")
    if s.dla_core is not None:
        args += [f"--useDLACore={s.dla_core}", "--allowGPUFallback"]
    if s.sparsity:
        args.append("--sparsity=enable")
    if s.version_compatible:
        args.append("--versionCompatible")
    if s.hardware_compatibility:
        args.append(f"--hardwareCompatibilityLevel={s.hardware_compatibility}")
    args.append("--buildOnly" if s.trt_version[0] < 10 else "--skipInference")
    allowed = _flag_set(s.trt_version)
    for a in args:
        flag = a[2:].split("=", 1)[0]
        if flag not in allowed:
            raise TargetError(f"trtexec {s.trt_version[0]}.{s.trt_version[1]} has no --{flag}",
                              "report this: the recipe chose a flag this TensorRT version lacks")
    return args


# the recipe builds for DLA; the runtime's own engine does not (yet): said beside the recipe's DLA line
RUNTIME_GPU_NOTE = ("dsedge.load builds and runs the GPU engine of this bundle's dynamic shapes on the device, not "
                    "this DLA engine (the runtime does not run DLA engines yet): deploy the DLA engine this recipe "
                    "builds with your own loader")


def _notes(s: Any, dla_core: int | None) -> list[str]:
    # the settings' notes, and where the recipe builds for DLA, what the runtime builds instead
    return list(s.notes) + ([RUNTIME_GPU_NOTE] if dla_core is not None and s.dla_core is not None else [])


def trtexec_script(target: Target, variants: list[dict], inputs: list[dict], shape_ranges: dict,
                   dla_core: int | None = None) -> str:
    """Text of ``build/trtexec.sh``: one trtexec command per variant, with comments saying why each flag is there.

    Args:
        target: the target profile.
        variants: ``[{"name": "int4", "precision": "int4", "file": "models/int4.onnx"}, …]``; optional ``"ops"``
            (ONNX op types, decides DLA), ``"strongly_typed"``, ``"sparsity"`` (``"2:4"``).
        inputs: ``[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}, …]``.
        shape_ranges: ``{"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {…}}`` → ``--min/opt/maxShapes``.
        dla_core: build for this DLA core with GPU fallback (Jetson targets), or None for the GPU.
    Returns:
        a bash script run from anywhere (it ``cd``s to the bundle root); ``$TRTEXEC`` overrides the binary.
        For an ONNX Runtime target the script only says there is nothing to build.
    Raises:
        TargetError: precision the target's TensorRT cannot build, DLA on a target without DLA, a dynamic dim
            without a range.
    """
    head = ["#!/usr/bin/env bash",
            f"# dsedge {__version__} engine recipe for target {target.name}: {target.description}"]
    if target.backend != "tensorrt":
        return "\n".join(head + [f"# {target.name} runs ONNX Runtime: there is no TensorRT engine to build.",
                                 "exit 0", ""])
    trt = target.trt_version
    stack = f"TensorRT {trt[0]}.{trt[1]}" + (f" (JetPack {target.tensorrt['jetpack']})"
                                            if target.tensorrt.get("jetpack") else "")
    head += [f"# Device: {target.gpu or target.name} ({target.sm}), {stack}. Flags are spelled for trtexec {trt[0]}.{trt[1]}.",
             "# Run on the device from anywhere: bash build/trtexec.sh   (TRTEXEC=/path/to/trtexec to override)",
             "# Engines are tied to the GPU model and TensorRT version they were built with.",
             "set -euo pipefail",
             'cd "$(dirname "$0")/.."',
             'TRTEXEC="${TRTEXEC:-trtexec}"',
             f"mkdir -p {ENGINE_DIR} build", ""]
    body = []
    for v in variants:
        s = engine_build_settings(target, v, inputs, shape_ranges, dla_core=dla_core)
        body.append(f"# --- variant {s.variant} ({s.precision}): {s.onnx_file}")
        body += [f"# {n}" for n in _notes(s, dla_core)]
        if s.workspace_mb:
            body.append(f"# workspace pool: {s.workspace_mb} MiB (target default)")
        args = trtexec_args(s)
        body.append('"$TRTEXEC" \\')
        body += [f"    {shlex.quote(a)} \\" for a in args[:-1]] + [f"    {shlex.quote(args[-1])}", ""]
    return "\n".join(head + body)


def recipe_notes(target: Target, variants: list[dict], inputs: list[dict], shape_ranges: dict,
                 dla_core: int | None = None) -> dict[str, list[str]]:
    """Variant name → the recipe's decisions as lines for report.json (the same text as the script's comments).
    Empty for ONNX Runtime targets. Raises what ``trtexec_script`` raises."""
    if target.backend != "tensorrt":
        return {}
    return {v["name"]: _notes(engine_build_settings(target, v, inputs, shape_ranges, dla_core=dla_core), dla_core)
            for v in variants}
