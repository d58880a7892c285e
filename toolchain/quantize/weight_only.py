"""Weight-only quantization of an ONNX model's MatMul/Gemm weights (W4A16 / W8A16) with RTN, AWQ or GPTQ.

ONNX in, ONNX out: each chosen layer's weight becomes an integer initializer + float32 scales feeding
``DequantizeLinear`` (opset 21, IR 10; INT4 blockwise along K, INT8 per output channel); AWQ adds one ``Mul`` by
``1/s`` in front of each group of layers sharing an input. Calibration activations are collected once by running
the fp32 model in ONNX Runtime (:mod:`.calibration`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np
import onnx

from ...runtime.errors import CalibrationError, QuantizationError
from .awq import awq_search
from .blockwise import BlockwiseWeight, quantize_blockwise
from .calibration import CalibrationSource, collect_activations, load_calibration
from .graph import (WeightLayer, ensure_qdq_opset, insert_input_scale, select_layers, weight_kn,
                    write_blockwise_weight)
from .gptq import gptq_quantize

ALGORITHMS = ("rtn", "awq", "gptq", "awq+gptq")
EVAL_ROWS = 512


@dataclass
class LayerResult:
    """What happened to one layer. ``rel_error`` = ||X(Wq-W)||² / ||XW||² on calibration rows (None without
    calibration data); ``awq_alpha`` only for AWQ."""

    node: str
    bits: int
    block_size: int
    algorithm: str
    symmetric: bool
    rel_error: float | None = None
    awq_alpha: float | None = None


def _rel_error(x: np.ndarray | None, w: np.ndarray, wq: np.ndarray) -> float | None:
    if x is None:
        return None
    xs = x[:EVAL_ROWS]
    y = xs @ w
    return float(np.sum((xs @ wq - y) ** 2) / max(float(np.sum(y * y)), 1e-30))


def layer_activations(model: onnx.ModelProto, calibration: CalibrationSource | list, layers: list[WeightLayer],
                      max_rows: int = 4096) -> dict[str, np.ndarray]:
    """Calibration activations ``[rows, K]`` of every distinct input tensor of ``layers`` (fp32 model, ORT)."""
    batches = load_calibration(model, calibration)
    tensors = sorted({layer.activation for layer in layers})
    return collect_activations(model, batches, tensors, max_rows=max_rows)


def quantize_weight_only(model: onnx.ModelProto, calibration: CalibrationSource | list | None = None, *,
                         algorithm: str = "awq", bits: int = 4, block_size: int = 32, symmetric: bool = True,
                         nodes: list[str] | None = None, layer_bits: dict[str, int] | None = None,
                         act_order: bool = True, activations: dict[str, np.ndarray] | None = None,
                         ) -> tuple[onnx.ModelProto, dict]:
    """Quantize the weights of MatMul/Gemm layers to INT4 (blockwise) or INT8 (per-channel), returning a copy.

    Args:
        model: fp32 ONNX model (not modified).
        calibration: batches (iterable of ``{input: array}``), a ``.npz`` or a directory of them; needed by
            ``awq``/``gptq``/``awq+gptq``; optional for ``rtn`` (then its clip search weights channels by mean x²).
        algorithm: ``rtn`` | ``awq`` (arXiv:2306.00978) | ``gptq`` (arXiv:2210.17323) | ``awq+gptq`` (AWQ's
            scaling, then GPTQ on the scaled weight).
        bits: 4 or 8 for every chosen layer; ``layer_bits`` overrides per node name (4, 8, or 16/32 = keep float).
        block_size: INT4 weights per scale along K (32/64/128). INT8 layers are per output channel.
        symmetric: signed codes, no zero point (TensorRT's INT4 needs this); False = unsigned + zero point.
        nodes: node names to quantize (default: every MatMul/Gemm with an initializer weight).
        activations: precomputed ``{tensor: [rows, K]}`` (skips running the calibration set again).
    Returns:
        (quantized model at opset 21 / IR 10, report dict with one entry per layer under ``"layers"``).
    Raises:
        QuantizationError (unknown/unsupported node, NaN/Inf weight, bad bits/algorithm),
        CalibrationError (missing/empty/mismatched calibration data).
    """
    if algorithm not in ALGORITHMS:
        raise QuantizationError(f"unknown algorithm {algorithm!r}", f"choose one of {', '.join(ALGORITHMS)}")
    if bits not in (4, 8):
        raise QuantizationError(f"{bits}-bit weights are not supported", "use --bits 4 or 8")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    layers = select_layers(out, nodes)
    layer_bits = dict(layer_bits or {})
    plan = [(layer, layer_bits.get(layer.node, bits)) for layer in layers]
    plan = [(layer, b) for layer, b in plan if b in (4, 8)]
    for layer, b in [(lay, layer_bits[lay.node]) for lay in layers if lay.node in layer_bits]:
        if b not in (4, 8, 16, 32):
            raise QuantizationError(f"layer {layer.node!r}: {b} bits is not a supported precision",
                                    "use 4, 8, 16 or 32")
    needs_calib = algorithm != "rtn"
    if activations is None and (calibration is not None or needs_calib):
        if calibration is None:
            raise CalibrationError(f"{algorithm.upper()} needs calibration data", "pass --calib DIR_OR_NPZ")
        activations = layer_activations(model, calibration, [layer for layer, _ in plan])
    weights = {layer.node: weight_kn(out, layer) for layer, _ in plan}
    results: list[LayerResult] = []
    written: list[tuple[WeightLayer, BlockwiseWeight]] = []
    scale_groups: list[tuple[list[WeightLayer], np.ndarray]] = []

    int4 = [layer for layer, b in plan if b == 4]
    int8 = [layer for layer, b in plan if b == 8]
    for layer in int8:                                   # per-channel INT8: RTN with output-aware clip
        x = None if activations is None else activations[layer.activation]
        w = weights[layer.node]
        bw = quantize_blockwise(w, bits=8, block_size=layer.k, symmetric=symmetric, clip_search=True,
                                name=layer.node, importance=None if x is None else (x * x).mean(axis=0))
        written.append((layer, bw))
        results.append(LayerResult(layer.node, 8, layer.k, "rtn", symmetric, _rel_error(x, w, bw.dequantize())))

    if algorithm in ("awq", "awq+gptq"):
        groups: dict[str, list[WeightLayer]] = defaultdict(list)
        for layer in int4:
            groups[layer.activation].append(layer)
        for act, members in groups.items():
            x = activations[act]
            r = awq_search([weights[m.node] for m in members], x, bits=4, block_size=block_size,
                           symmetric=symmetric, names=[m.node for m in members])
            s = r.scale
            scaled = any(abs(float(v) - 1.0) > 1e-6 for v in s)
            if scaled:
                scale_groups.append((members, 1.0 / s))
            for m, bw in zip(members, r.weights):
                if algorithm == "awq+gptq":
                    xs = x / s
                    bw = gptq_quantize(weights[m.node] * s[:, None], xs, bits=4, block_size=block_size,
                                       symmetric=symmetric, act_order=act_order, name=m.node)
                written.append((m, bw))
                wq = bw.dequantize() / s[:, None]
                results.append(LayerResult(m.node, 4, bw.block_size, algorithm, symmetric,
                                           _rel_error(x, weights[m.node], wq), r.alpha))
    else:
        for layer in int4:
            x = None if activations is None else activations[layer.activation]
            w = weights[layer.node]
            if algorithm == "gptq":
                bw = gptq_quantize(w, x, bits=4, block_size=block_size, symmetric=symmetric, act_order=act_order,
                                   name=layer.node)
            else:
                bw = quantize_blockwise(w, bits=4, block_size=block_size, symmetric=symmetric, clip_search=True,
                                        name=layer.node, importance=None if x is None else (x * x).mean(axis=0))
            written.append((layer, bw))
            results.append(LayerResult(layer.node, 4, bw.block_size, algorithm, symmetric,
                                       _rel_error(x, w, bw.dequantize())))

    out = ensure_qdq_opset(out)
    for layer, bw in written:
        write_blockwise_weight(out, layer, bw)
    for members, inv_s in scale_groups:
        insert_input_scale(out, members, inv_s)
    order = {layer.node: i for i, layer in enumerate(layers)}
    results.sort(key=lambda r: order[r.node])
    report = {"algorithm": algorithm, "bits": bits, "block_size": block_size, "symmetric": symmetric,
              "layers": [asdict(r) for r in results],
              "kept_float": [layer.node for layer in layers if layer_bits.get(layer.node, bits) not in (4, 8)]}
    return out, report
