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
        top1: what a gate's ``top1`` measures on that output: ``"argmax"`` (classifier logits) or ``"neighbour"``
            (nearest-neighbour agreement of embeddings; see ``mixed.cosine_metric``).
        on_step: called with one line per gate measurement (progress).
        float_tables: ``{name: float32 TensorProto}`` of the INT4 word-embedding tables already in the model, which
            the built-in INT4 gate may raise back to float like a weight layer (``compress_int4_with_tables``).
    """

    data: Any = None
    heldout: Any = None
    reference: Any = None
    output: int | str = 0
    top1: str = "argmax"
    on_step: Callable[[str], None] | None = None
    float_tables: dict[str, Any] | None = None


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


def compress_int4_with_tables(model: Any, preset: Preset, calibration: Calibration, tables: bool = True,
                              symmetric_tables: bool = False) -> Compressed:
    """``compress`` for an INT4 ``preset`` and, with ``tables``, the word-embedding tables INT4 too
    (``weight_only.quantize_embedding_tables``: asymmetric UINT4 + zero points, or with ``symmetric_tables`` signed
    INT4 without them, the only form TensorRT's ONNX parser takes; the preset's block size), in the order ``dsedge build``
    and ``dsedge quantize`` share: before a gated search (``preset.accuracy_gate``), so the gate measures the final
    model, against ``calibration.reference`` or else the float model given here; otherwise after the weight
    quantizer, whose calibration then runs on the float tables. Under the built-in INT4 gate (``mixed.quantize_mixed``)
    each table is a candidate the gate can raise back to float, like a weight layer. ``details["embeddings"]`` lists
    the tables that stayed INT4 (``details["tables"]``: each table's final precision, under that gate).

    Raises:
        as ``compress``.
    """
    import dataclasses

    import onnx

    from .weight_only import quantize_embedding_tables

    done: list = []
    if tables and preset.accuracy_gate:
        base = onnx.ModelProto()
        base.CopyFrom(model)
        base, done = quantize_embedding_tables(base, block_size=preset.block_size, symmetric=symmetric_tables)
        if calibration.reference is None:
            calibration = dataclasses.replace(calibration, reference=model)
        if done:  # the gate may raise a table back to float, like a weight layer
            floats = {t.name: t for t in model.graph.initializer}
            calibration = dataclasses.replace(calibration, float_tables={d["name"]: floats[d["name"]] for d in done})
        out = compress(base, preset, calibration)
        if "tables" in out.details:  # the built-in gate said which tables stayed INT4
            done = [d for d in done if out.details["tables"].get(d["name"]) == "int4"]
    else:
        out = compress(model, preset, calibration)
        if tables:
            out.model, done = quantize_embedding_tables(out.model, block_size=preset.block_size, symmetric=symmetric_tables)
    out.details["embeddings"] = done
    return out

