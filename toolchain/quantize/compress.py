"""The one verb for compression: ``compress(model, preset, calibration) -> Compressed``, used by ``dsedge quantize``
and by ``dsedge build``'s compressors.

    >>> import onnx
    >>> from dsedge.toolchain.quantize.compress import Calibration, compress
    >>> out = compress(onnx.load("model.onnx"), "int4-awq", Calibration("calib/"))
    >>> onnx.save(out.model, "model-int4.onnx"); out.details["layers"]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..artifacts import Compressed
from .algorithms import get_algorithm
from .graph import refuse_quantized
from .presets import Preset, get_preset


@dataclass(frozen=True)
class Calibration:
    """What an algorithm may read besides the model.

    Attributes:
        data: calibration inputs: a ``.npz`` file, a directory of them, or a list of ``{input: array}`` batches
            (batch axis 0); None when there are none.
        heldout: held-out inputs for an accuracy gate (same forms), never calibrated on.
        reference: the fp32 ``onnx.ModelProto`` a gate compares with (default: the model being compressed).
        output: the output (index or name) a gate's cosine compares.
        on_step: called with one line per gate measurement (progress).
    """

    data: Any = None
    heldout: Any = None
    reference: Any = None
    output: int | str = 0
    on_step: Callable[[str], None] | None = None


def compress(model: Any, preset: Preset | str, calibration: Calibration | Any = None) -> Compressed:
    """Compress an ``onnx.ModelProto`` with a preset (a ``Preset`` or a registered preset's name).

    Returns:
        ``Compressed`` with ``model`` (the compressed ``onnx.ModelProto``; ``path`` None until saved),
        ``precision`` and ``details`` (the algorithm's report: layers, bytes, gate values, …).
    Raises:
        ConfigError: unknown preset or algorithm. QuantizationError: the model is quantized already (Q/DQ,
            MatMulNBits, QLinear*/MatMulInteger/DynamicQuantizeLinear nodes; ``graph.quantized_nodes``), before any
            work. CalibrationError (the algorithm needs calibration data and there is none) / QuantizationError /
            AccuracyGateError: from the algorithm.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    calib = calibration if isinstance(calibration, Calibration) else Calibration(data=calibration)
    algorithm = get_algorithm(p.precision, p.algorithm)
    refuse_quantized(model)
    out, details = algorithm.fn(model, p, calib)
    return Compressed(path=None, precision=p.precision, details=details, model=out)
