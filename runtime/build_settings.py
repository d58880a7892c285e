"""TensorRT engine build settings for one bundle variant on one target — the single source both the ``trtexec`` recipe
(toolchain/recipe.py) and the on-device builder (runtime/backends/tensorrt.py) read, so they build the same engine.

Precision handling follows the TensorRT version the target ships:

- TensorRT 8.5 (Xavier, JetPack 5.1): weakly typed only. ``fp16`` → FP16 kernels allowed; ``int8`` (explicit Q/DQ)
  → INT8 + FP16 (non-quantized layers may use FP16). No BF16, no INT4, no strongly typed networks.
- TensorRT 10.x: weak typing (``--fp16``/``--int8``/``--bf16``) or strongly typed (``--stronglyTyped``: precision
  from the ONNX tensor types). dsedge writes FP16/BF16 variants as typed ONNX with listed FP32 islands, so those build
  strongly typed (weak ``--fp16`` could run the FP32 islands in FP16). INT4 weights come from DequantizeLinear on
  INT4 initializers (weight-only, W4A16: ``--fp16`` lets the GEMM activations run in FP16).
- TensorRT 11.x: strongly typed only; the precision flags were removed (TensorRT 10→11 trtexec migration guide).
  Precision is whatever the ONNX types say.

DLA (Jetson): INT8/FP16 only, static shapes (min = opt = max), weakly typed; layers DLA cannot run fall back to the
GPU (``allowGPUFallback``). A model whose compute layers (Conv/ConvTranspose) DLA cannot run at all — e.g. a
transformer, whose MatMul/Gather/LayerNormalization layers DLA lacks — is built for the GPU and the notes say why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .errors import TargetError

# ONNX ops TensorRT can place on DLA (TensorRT "DLA supported layers": convolution, deconvolution, activation,
# pooling, scale/batchnorm, element-wise, LRN, concatenation, resize, softmax, unary, shuffle/slice, Q/DQ).
DLA_OPS = frozenset({
    "Conv", "ConvTranspose", "Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu", "PRelu", "MaxPool", "AveragePool",
    "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization", "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow",
    "Equal", "Greater", "Less", "Concat", "Resize", "Upsample", "LRN", "Softmax", "Abs", "Sin", "Cos", "Slice",
    "Reshape", "Transpose", "Flatten", "Identity", "QuantizeLinear", "DequantizeLinear", "Constant",
})
_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
# ONNX ops the TensorRT ONNX parser has no importer for before a version (onnx-tensorrt docs/operators.md of
# release/8.5-GA: "LayerNormalization | N"; TensorRT 8.6 added INormalizationLayer and the importer).
PARSER_SINCE = {"LayerNormalization": (8, 6)}
DLA_PRECISIONS = ("int8", "fp16")
INT4_BLOCKS = (64, 128)  # TensorRT's INT4 block sizes ("Quantization Schemes")


@dataclass(frozen=True)
class EngineBuildSettings:
    """Everything that decides a TensorRT engine besides the ONNX bytes and the GPU.

    Attributes:
        variant / precision: the bundle variant (``"int4"``) and its model precision.
        onnx_file: path inside the bundle (``"models/int4.onnx"``).
        trt_version: ``(major, minor)`` of the target's TensorRT.
        precision_flags: weak-typing builder flags to set (subset of fp16, int8, bf16); empty when strongly typed.
        strongly_typed: build a strongly typed network (TensorRT ≥ 10; always on in 11).
        shapes: input name → ``(min, opt, max)`` shapes (tuples of ints) for the one optimization profile.
        workspace_mb: workspace memory-pool limit, MiB (0 = TensorRT's default).
        dla_core: DLA core to build for, or None for the GPU; gpu_fallback: allow GPU fallback for DLA layers.
        sparsity: enable 2:4 structured-sparsity tactics (variant marked ``sparsity = "2:4"`` on a target that has it).
        hardware_compatibility: ``"ampere+"`` or ``""``; version_compatible: TensorRT ≥ 8.6 version-compatible plan.
        notes: one line each, why a setting was chosen (written as comments in the recipe and to report.json).
    """

    variant: str
    precision: str
    onnx_file: str
    trt_version: tuple[int, int]
    precision_flags: tuple[str, ...] = ()
    strongly_typed: bool = False
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    workspace_mb: int = 0
    dla_core: int | None = None
    gpu_fallback: bool = False
    sparsity: bool = False
    hardware_compatibility: str = ""
    version_compatible: bool = False
    notes: tuple[str, ...] = ()

    def digest_fields(self) -> dict[str, Any]:
        """The fields that change the engine (for cache keys): all but ``notes``."""
        return {
            "variant": self.variant, "precision": self.precision, "trt_version": list(self.trt_version),
            "precision_flags": list(self.precision_flags), "strongly_typed": self.strongly_typed,
            "shapes": {k: [list(s) for s in v] for k, v in sorted(self.shapes.items())},
            "workspace_mb": self.workspace_mb, "dla_core": self.dla_core, "gpu_fallback": self.gpu_fallback,
            "sparsity": self.sparsity, "hardware_compatibility": self.hardware_compatibility,
            "version_compatible": self.version_compatible,
        }


def _get(target: Any, key: str, default: Any = None) -> Any:
    if isinstance(target, Mapping):
        return target.get(key, default)
    return getattr(target, key, default)


def parse_trt_version(v: Any) -> tuple[int, int]:
    """``"10.3"`` / ``"10.3.0.30"`` → ``(10, 3)``. Raises TargetError on anything else."""
    try:
        parts = str(v).split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1] else 0
    except (ValueError, IndexError):
        raise TargetError(f"TensorRT version {v!r} is not MAJOR.MINOR", "fix the target profile's tensorrt.version") from None


def resolve_shapes(inputs: Sequence[Mapping[str, Any]], shape_ranges: Mapping[str, Mapping[str, int]],
                   static: bool = False) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Min/opt/max shape per input from symbolic dims (``["batch", "sequence"]``) and ``shape_ranges``.

    ``static=True`` (DLA) pins every symbolic dim to its ``opt`` value (min = opt = max).
    Raises:
        TargetError: an input has a symbolic dim with no range, or a range that is not 1 ≤ min ≤ opt ≤ max.
    """
    out = {}
    for spec in inputs:
        lo, opt, hi = [], [], []
        for dim in spec["shape"]:
            if isinstance(dim, int) and dim >= 0:
                lo.append(dim), opt.append(dim), hi.append(dim)
                continue
            rng = shape_ranges.get(str(dim))
            if not rng:
                raise TargetError(f"input {spec['name']!r} has dynamic dim {dim!r} with no min/opt/max range",
                                  f"give shape_ranges[{str(dim)!r}] = {{min, opt, max}} (or a target profile shapes entry)")
            try:
                a, b, c = int(rng["min"]), int(rng["opt"]), int(rng["max"])
            except (KeyError, TypeError, ValueError):
                raise TargetError(f"range for {dim!r} must give integer min, opt and max, got {dict(rng)!r:.120}",
                                  f"give shape_ranges[{str(dim)!r}] = {{min, opt, max}}") from None
            if not 1 <= a <= b <= c:
                raise TargetError(f"range for {dim!r} must be 1 <= min <= opt <= max, got {a}/{b}/{c}",
                                  "fix the shape ranges")
            if static:
                a = c = b
            lo.append(a), opt.append(b), hi.append(c)
        out[str(spec["name"])] = (tuple(lo), tuple(opt), tuple(hi))
    return out


def dla_blockers(ops: Sequence[str]) -> list[str]:
    """Op types in ``ops`` that DLA cannot run, sorted, unique."""
    return sorted({o for o in ops if o not in DLA_OPS})


def engine_build_settings(target: Any, variant: Mapping[str, Any], inputs: Sequence[Mapping[str, Any]],
                          shape_ranges: Mapping[str, Mapping[str, int]] | None = None,
                          dla_core: int | None = None) -> EngineBuildSettings:
    """Derive the build settings for ``variant`` on ``target``.

    Args:
        target: a ``dsedge.targets.Target`` or its dict (``manifest.target``).
        variant: ``{"name", "precision", "file"}``; optional ``"ops"`` (ONNX op types in the graph, for the DLA
            decision), ``"strongly_typed"`` (override the default), ``"sparsity"`` (``"2:4"`` when pruned 2:4),
            ``"dq_gather"`` (a DequantizeLinear feeds a Gather), ``"dq_unparsable"`` (names of DequantizeLinear
            nodes TensorRT's parser refuses: UINT4/INT32 input or non-zero zero point), ``"int4_blocks"`` (block
            sizes of INT4 DequantizeLinear nodes, 0: per-channel), ``"conv_spatial"`` (the most
            spatial dims of a Conv/ConvTranspose weight: 3 for Conv3d, which DLA cannot run).
        inputs: ``[{"name", "dtype", "shape": [int | "symbol", …]}]``.
        shape_ranges: ``{"batch": {"min": 1, "opt": 8, "max": 32}, …}``; missing symbols come from the target's
            ``shapes``.
        dla_core: build for this DLA core (Jetson), or None for the GPU.
    Raises:
        TargetError: not a TensorRT target; precision the target's TensorRT cannot build (BF16/INT4 on 8.x);
            DLA requested on a target without DLA or with a core index it lacks; a dynamic dim without a range.
    """
    name = _get(target, "name", "?")
    if _get(target, "backend") != "tensorrt":
        raise TargetError(f"target {name} runs ONNX Runtime, not TensorRT", "no engine to build for this target")
    trt = parse_trt_version((_get(target, "tensorrt") or {}).get("version"))
    precision = str(variant["precision"])
    notes: list[str] = []
    ranges = dict(_get(target, "shapes") or {})
    ranges.update(shape_ranges or {})

    if trt[0] < 9 and precision in ("bf16", "int4"):
        raise TargetError(f"TensorRT {trt[0]}.{trt[1]} on {name} cannot build {precision}",
                          "build int8 or fp16 for this target")

    use_dla = False
    dla_cores = int(_get(target, "dla_cores", 0) or 0)
    if dla_core is not None:
        if dla_cores == 0:
            raise TargetError(f"DLA requested on {name}, which has no DLA cores", "drop the DLA option for this target")
        if not 0 <= int(dla_core) < dla_cores:
            raise TargetError(f"DLA core {dla_core} does not exist on {name} (it has {dla_cores})",
                              f"use a core in 0..{dla_cores - 1}")
        blockers = dla_blockers(variant.get("ops") or [])
        compute = [o for o in (variant.get("ops") or []) if o in _COMPUTE_OPS]
        if precision not in DLA_PRECISIONS:
            notes.append(f"DLA runs INT8/FP16 only; {precision} builds for the GPU instead of DLA core {dla_core}")
        elif int(variant.get("conv_spatial") or 0) > 2:  # DLA's convolution is 2-D ("DLA Supported Layers")
            notes.append(f"DLA runs 2-D convolutions only and the model's are {variant['conv_spatial']}-D; building "
                         f"for the GPU instead of DLA core {dla_core}")
        elif compute and not any(o in DLA_OPS for o in compute):
            notes.append(f"the model's compute layers cannot run on DLA (DLA lacks {', '.join(blockers[:6])}); "
                         f"building for the GPU instead of DLA core {dla_core}")
        else:
            use_dla = True
            notes.append(f"DLA core {dla_core} with GPU fallback; DLA needs static shapes, so min = opt = max")
            if blockers:
                notes.append(f"layers DLA cannot run fall back to the GPU: {', '.join(blockers[:8])}")

    shapes = resolve_shapes(inputs, ranges, static=use_dla)
    missing = sorted(o for o in set(variant.get("ops") or []) if trt < PARSER_SINCE.get(o, (0, 0)))
    if missing:
        notes.append(f"TensorRT {trt[0]}.{trt[1]}'s ONNX parser has no importer for {', '.join(missing)} (added in "
                     f"{'/'.join(sorted({'.'.join(map(str, PARSER_SINCE[o])) for o in missing}))}): trtexec and the "
                     "on-device build fail to parse this model until those ops are decomposed")

    typed_default = trt[0] >= 10 and precision in ("fp16", "bf16")
    strongly = trt[0] >= 11 or (trt[0] >= 10 and bool(variant.get("strongly_typed", typed_default)))
    if use_dla and trt[0] < 11:
        strongly = False  # DLA builds use weak typing and the INT8/FP16 flags
    flags: tuple[str, ...] = ()
    if trt[0] >= 11:
        notes.append(f"TensorRT {trt[0]}.{trt[1]} builds strongly typed networks only: precision comes from the ONNX "
                     "tensor types (no --fp16/--int8/--bf16 flags exist)")
    elif strongly:
        notes.append(f"strongly typed: the {precision} ONNX carries its types (FP32 islands stay FP32)")
    else:
        flags = {"fp32": (), "fp16": ("fp16",), "bf16": ("bf16",), "int8": ("int8", "fp16"),
                 "int4": ("fp16",)}[precision]
        if precision == "int8":
            notes.append("explicit quantization: INT8 where the graph has Q/DQ, FP16 allowed elsewhere")
        if flags and trt >= (10, 12):
            notes.append(f"weak typing (--{' --'.join(flags)}) is deprecated since TensorRT 10.12 (its trtexec "
                         "warns) and removed in 11.x, where this variant builds strongly typed")
    if precision == "int4":
        if "fp16" in flags:
            notes.append("INT4 is weight-only (W4A16): TensorRT reads DequantizeLinear(INT4, block_size) → MatMul "
                         "and runs the GEMMs with FP16 activations")
        else:  # strongly typed: no FP16 flag, the activations keep the ONNX's type
            notes.append("INT4 is weight-only: TensorRT reads DequantizeLinear(INT4, block_size) → MatMul; strongly "
                         "typed, the GEMMs run at the activation type the ONNX gives them (FP32 with FP32 scales), not "
                         "W4A16 — give the int4 variant FP16 activations and scales for W4A16")
        if variant.get("dq_gather", True):  # unknown (no graph facts given): said anyway
            notes.append("a 4-bit embedding (DequantizeLinear(INT4) → Gather) is not a GEMM: TensorRT's Gather takes "
                         "no INT4, so the table is dequantized to float and gathered — no speed-up, and the engine may "
                         "hold the table at 16/32 bit; check the engine size on the device")
    unparsable = list(variant.get("dq_unparsable") or ())
    if unparsable:
        notes.append(f"TensorRT's ONNX parser refuses {len(unparsable)} DequantizeLinear node(s) here (a UINT4 or INT32 "
                     f"input, or a non-zero zero point, e.g. {unparsable[0]}): TensorRT quantizes symmetrically and "
                     "only weights and activations, so trtexec and the on-device build fail on this variant; quantize "
                     "it symmetric (signed INT4/INT8, no zero points, biases float)")
    blocks = [b for b in variant.get("int4_blocks") or () if b not in INT4_BLOCKS]
    if blocks:
        notes.append(f"TensorRT's INT4 takes per-block scales with blocks of {' or '.join(map(str, INT4_BLOCKS))} only "
                     f"(\"Quantization Schemes\"); this variant has "
                     + ", ".join("per-channel INT4" if b == 0 else f"blocks of {b}" for b in blocks)
                     + ": rebuild it with --block-size 64 or 128")
    if precision == "fp32" and "tf32" in (_get(target, "engine_flags") or ()):
        notes.append("fp32 layers may use TF32 tensor cores (TensorRT's default on Ampere and later)")

    sparse = str(variant.get("sparsity", "")) == "2:4" and "sparsity" in (_get(target, "engine_flags") or ())
    hw = str(_get(target, "hardware_compatibility", "") or "") if trt >= (8, 6) and not use_dla else ""
    vc = bool(_get(target, "version_compatible", False)) and trt >= (8, 6)
    if vc:
        notes.append("version-compatible plan: it embeds TensorRT's lean runtime (host code), so its loader must allow "
                     "that (TensorRT runtime.engine_host_code_allowed = True; Triton: --backend-config=tensorrt,"
                     "version-compatible=true)")
    return EngineBuildSettings(
        variant=str(variant["name"]), precision=precision, onnx_file=str(variant["file"]), trt_version=trt,
        precision_flags=flags, strongly_typed=strongly, shapes=shapes,
        workspace_mb=int(_get(target, "workspace_mb", 0) or 0), dla_core=int(dla_core) if use_dla else None,
        gpu_fallback=use_dla, sparsity=sparse, hardware_compatibility=hw, version_compatible=vc, notes=tuple(notes))
