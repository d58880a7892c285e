"""Compression presets: named recipes as plain data (the ModelOpt habit) — listable, copyable, editable.

    >>> from dsedge.toolchain.quantize.presets import get_preset, list_presets
    >>> [p.name for p in list_presets()]
    >>> mine = get_preset("int4-awq").replace(name="int4-awq-64", block_size=64)
    >>> register_preset(mine)          # now `dsedge quantize --preset int4-awq-64` works too

A preset names its precision and the registered algorithm that produces it (:mod:`.algorithms`); the other fields
are that algorithm's settings. ``dsedge quantize`` and ``dsedge build`` both compress through one preset and
:func:`dsedge.toolchain.quantize.compress.compress`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...runtime.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One compression recipe.

    Attributes:
        name: how users ask for it (``--preset NAME``).
        precision: ``int4`` | ``int8`` | ``fp16`` | ``bf16``.
        algorithm: the registered algorithm for ``precision`` (``dsedge quantize --list-presets`` shows them).
        block_size: INT4 weights per scale along K (16, 32, 64, 128).
        symmetric: weights without zero points (TensorRT's INT4 needs symmetric).
        accuracy_gate: ``METRIC:THRESHOLD[,…]``: INT4 raises the most sensitive layers, INT8 static keeps them
            float, until it passes on held-out data.
        method: INT8 activation calibration (minmax | entropy | percentile).
        smooth_alpha: INT8 static: SmoothQuant (arXiv:2211.10438) with this migration strength first.
        nodes: only these node names (None: every MatMul/Gemm weight).
        exclude: INT8 static: node names kept float.
        quantize_bias: INT8 static: Conv/Gemm biases as INT32 DequantizeLinear (ORT CPU's QLinearConv needs them);
            False keeps them float, as TensorRT's ONNX parser requires (``dsedge build`` sets it for TensorRT targets).
        clip_search: INT4: per-block MSE clip search of the scales (False: plain absmax, what QAT trained for).
        fuse: INT8 dynamic: ORT transformer fusion applied first (``bert`` or None).
        description: one line for ``--list-presets``.
    """

    name: str
    precision: str
    algorithm: str
    block_size: int = 32
    symmetric: bool = True
    accuracy_gate: str | None = None
    method: str = "minmax"
    smooth_alpha: float | None = None
    nodes: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    quantize_bias: bool = True
    clip_search: bool = True
    fuse: str | None = "bert"
    description: str = ""

    def replace(self, **changes: Any) -> "Preset":
        """A copy with ``changes`` (presets never change in place)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset, *, replace: bool = False) -> Preset:
    """Make ``preset`` available by name. Raises ConfigError when the name is taken (unless ``replace``)."""
    if preset.name in _PRESETS and not replace:
        raise ConfigError(f"a compression preset named {preset.name!r} exists", "pick another name or replace=True")
    _PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    """The preset called ``name``. Raises ConfigError naming the known ones."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown compression preset {name!r}",
                          f"known presets: {', '.join(sorted(_PRESETS))}") from None


def list_presets() -> list[Preset]:
    """Every registered preset, by name."""
    return [_PRESETS[n] for n in sorted(_PRESETS)]


for _p in (
    Preset("int4-rtn", "int4", "rtn", description="W4A16 round-to-nearest, MSE-searched block scales; no data"),
    Preset("int4-awq", "int4", "awq", description="W4A16 AWQ (arXiv:2306.00978): activation-aware scales"),
    Preset("int4-gptq", "int4", "gptq", description="W4A16 GPTQ (arXiv:2210.17323): second-order error updates"),
    Preset("int4-awq+gptq", "int4", "awq+gptq", description="W4A16 AWQ scaling, then GPTQ"),
    Preset("int8-static", "int8", "static", description="W8A8 explicit Q/DQ, activations calibrated (MinMax)"),
    Preset("int8-smoothquant", "int8", "static", smooth_alpha=0.5,
           description="W8A8 Q/DQ after SmoothQuant (alpha 0.5; arXiv:2211.10438)"),
    Preset("int8-dynamic", "int8", "dynamic",
           description="INT8 weights, activations quantized per tensor at run time (ORT CPU; batch-variant)"),
    Preset("int8-rowwise", "int8", "rowwise",
           description="INT8 weights, activations quantized per row at run time (ORT CPU; batch-invariant)"),
    Preset("int8-weight-only", "int8", "weight-only", description="W8A16 per-channel Q/DQ; no data"),
    Preset("fp16", "fp16", "float16", description="FP16 with FP32 islands (LayerNorm, Softmax, reductions)"),
    Preset("bf16", "bf16", "float16", description="BF16 with FP32 islands (LayerNorm, Softmax, reductions)"),
):
    register_preset(_p)
