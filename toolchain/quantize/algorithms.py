"""The compression algorithms, registered in one place: ``(precision, name) → function``.

An algorithm is ``fn(model, preset, calibration) -> (model, report)`` (``onnx.ModelProto`` in and out, the report a
JSON-able dict). Adding one is one new module plus one call::

    from dsedge.toolchain.quantize.algorithms import register_algorithm
    from dsedge.toolchain.quantize.presets import Preset, register_preset

    register_algorithm("int4", "hqq", my_hqq, needs_calibration=False, description="…")
    register_preset(Preset("int4-hqq", "int4", "hqq"))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ...runtime.errors import ConfigError

if TYPE_CHECKING:
    from .compress import Calibration
    from .presets import Preset

AlgorithmFn = Callable[[Any, "Preset", "Calibration"], "tuple[Any, dict[str, Any]]"]


@dataclass(frozen=True)
class Algorithm:
    precision: str
    name: str
    fn: AlgorithmFn
    needs_calibration: bool
    description: str = ""


_ALGORITHMS: dict[tuple[str, str], Algorithm] = {}


def register_algorithm(precision: str, name: str, fn: AlgorithmFn, *, needs_calibration: bool = False,
                       description: str = "", replace: bool = False) -> Algorithm:
    """Register ``fn`` as algorithm ``name`` for ``precision``. Raises ConfigError when taken (unless ``replace``)."""
    key = (precision, name)
    if key in _ALGORITHMS and not replace:
        raise ConfigError(f"{precision} algorithm {name!r} is registered already", "pick another name or replace=True")
    _ALGORITHMS[key] = Algorithm(precision, name, fn, needs_calibration, description)
    return _ALGORITHMS[key]


def get_algorithm(precision: str, name: str) -> Algorithm:
    """Raises ConfigError naming the algorithms registered for ``precision``."""
    try:
        return _ALGORITHMS[(precision, name)]
    except KeyError:
        known = sorted(n for p, n in _ALGORITHMS if p == precision)
        raise ConfigError(f"no {precision} algorithm {name!r}",
                          f"{precision} algorithms: {', '.join(known) or 'none'}") from None


def list_algorithms(precision: str | None = None) -> list[Algorithm]:
    return [a for k, a in sorted(_ALGORITHMS.items()) if precision is None or a.precision == precision]


def _int4_weight_only(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    """INT4 W4A16 with ``preset.algorithm``; under ``accuracy_gate`` mixed precision (:mod:`.mixed`)."""
    nodes = list(preset.nodes) if preset.nodes is not None else None
    if preset.accuracy_gate:
        from .mixed import quantize_mixed

        return quantize_mixed(model, calib.data, gate=preset.accuracy_gate, heldout=calib.heldout,
                              algorithm=preset.algorithm, block_size=preset.block_size, symmetric=preset.symmetric,
                              nodes=nodes, on_step=calib.on_step, output=calib.output, reference=calib.reference,
                              top1=calib.top1, tables=calib.float_tables)
    from .weight_only import quantize_weight_only

    return quantize_weight_only(model, calib.data, algorithm=preset.algorithm, block_size=preset.block_size,
                                symmetric=preset.symmetric, nodes=nodes,
                                **({} if preset.clip_search else {"clip_search": False}))


def _int8_static(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    """W8A8 explicit Q/DQ; under ``accuracy_gate`` the most sensitive layers stay float (:mod:`.int8_gate`)."""
    if preset.accuracy_gate:
        from .int8_gate import quantize_int8_gated

        return quantize_int8_gated(model, calib.data, gate=preset.accuracy_gate, heldout=calib.heldout,
                                   method=preset.method, smooth_alpha=preset.smooth_alpha, output=calib.output,
                                   on_step=calib.on_step, reference=calib.reference, top1=calib.top1,
                                   quantize_bias=preset.quantize_bias)
    from .int8 import quantize_int8_static

    exclude = {"nodes_to_exclude": list(preset.exclude)} if preset.exclude is not None else {}
    return quantize_int8_static(model, calib.data, method=preset.method, smooth_alpha=preset.smooth_alpha,
                                quantize_bias=preset.quantize_bias, **exclude)


def _int8_dynamic(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    from .int8 import quantize_int8_dynamic

    return quantize_int8_dynamic(model, fuse=preset.fuse)


def _int8_rowwise(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    """Dynamic INT8 with one activation scale per row: batch-invariant (:mod:`.int8_rowwise`)."""
    from .int8_rowwise import quantize_int8_rowwise

    return quantize_int8_rowwise(model, fuse=preset.fuse)


def _int8_weight_only(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    from .weight_only import quantize_weight_only

    return quantize_weight_only(model, None, algorithm="rtn", bits=8)


def _float16(model: Any, preset: "Preset", calib: "Calibration") -> tuple[Any, dict[str, Any]]:
    from .fp16 import convert_float16

    return convert_float16(model, dtype=preset.precision)


for _name, _needs, _desc in (("rtn", False, "round to nearest, MSE-searched scales"),
                             ("awq", True, "activation-aware weight quantization (arXiv:2306.00978)"),
                             ("gptq", True, "GPTQ (arXiv:2210.17323)"),
                             ("awq+gptq", True, "AWQ scaling then GPTQ")):
    register_algorithm("int4", _name, _int4_weight_only, needs_calibration=_needs, description=_desc)
register_algorithm("int8", "static", _int8_static, needs_calibration=True, description="W8A8 Q/DQ, calibrated")
register_algorithm("int8", "dynamic", _int8_dynamic, description="ORT dynamic INT8 (CPU), per-tensor: batch-variant")
register_algorithm("int8", "rowwise", _int8_rowwise,
                   description="ORT dynamic INT8 (CPU), one activation scale per row: batch-invariant")
register_algorithm("int8", "weight-only", _int8_weight_only, description="W8A16 per-channel Q/DQ")
register_algorithm("fp16", "float16", _float16, description="16-bit float with FP32 islands")
register_algorithm("bf16", "float16", _float16, description="16-bit bfloat with FP32 islands")
