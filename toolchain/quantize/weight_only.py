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
from .graph import (WeightLayer, ensure_qdq_opset, insert_input_scale, name_nodes, select_layers, weight_kn,
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


@dataclass
class QuantizedLayer:
    """One layer's quantized weight, ready to write. ``input_scale``: AWQ's ``s`` (float32 ``[K]``; the graph
    multiplies the layer's input by ``1/s``) or None."""

    layer: WeightLayer
    weight: BlockwiseWeight
    input_scale: np.ndarray | None
    result: LayerResult


def quantize_layers(model: onnx.ModelProto, layers: list[WeightLayer], activations: dict[str, np.ndarray] | None,
                    *, bits: int = 4, algorithm: str = "awq", block_size: int = 32, symmetric: bool = True,
                    act_order: bool = True, clip_search: bool = True) -> dict[str, QuantizedLayer]:
    """Quantize each layer's weight (no graph change): ``{node name: QuantizedLayer}``.

    INT8 is per output channel with RTN + output-aware clip (``algorithm`` applies to INT4 only). ``activations``
    maps each layer's input tensor to calibration rows ``[rows, K]`` (None: RTN on weights alone).
    ``clip_search=False``: plain absmax scales for RTN (what QAT's fake quantizer uses).
    """
    if algorithm not in ALGORITHMS:
        raise QuantizationError(f"unknown algorithm {algorithm!r}", f"choose one of {', '.join(ALGORITHMS)}")
    if bits not in (4, 8):
        raise QuantizationError(f"{bits}-bit weights are not supported", "use 4 or 8 bits")
    if algorithm != "rtn" and bits == 4 and activations is None:
        raise CalibrationError(f"{algorithm.upper()} needs calibration data", "pass --calib DIR_OR_NPZ")
    out: dict[str, QuantizedLayer] = {}

    def act(layer: WeightLayer) -> np.ndarray | None:
        return None if activations is None else activations[layer.activation]

    if bits == 8 or algorithm in ("rtn", "gptq"):
        for layer in layers:
            x, w = act(layer), weight_kn(model, layer)
            if bits == 4 and algorithm == "gptq":
                bw = gptq_quantize(w, x, bits=4, block_size=block_size, symmetric=symmetric, act_order=act_order,
                                   name=layer.node)
            else:
                bw = quantize_blockwise(w, bits=bits, block_size=layer.k if bits == 8 else block_size,
                                        symmetric=symmetric, clip_search=clip_search, name=layer.node,
                                        importance=None if x is None else (x * x).mean(axis=0))
            res = LayerResult(layer.node, bits, bw.block_size, "rtn" if bits == 8 else algorithm, symmetric,
                              _rel_error(x, w, bw.dequantize()))
            out[layer.node] = QuantizedLayer(layer, bw, None, res)
        return out
    groups: dict[str, list[WeightLayer]] = defaultdict(list)      # AWQ: layers sharing an input share s
    for layer in layers:
        groups[layer.activation].append(layer)
    for tensor, members in groups.items():
        x = activations[tensor]
        ws = [weight_kn(model, m) for m in members]
        r = awq_search(ws, x, bits=4, block_size=block_size, symmetric=symmetric, names=[m.node for m in members])
        s = r.scale
        scaled = bool(np.any(np.abs(s - 1.0) > 1e-6))
        for m, w, bw in zip(members, ws, r.weights):
            if algorithm == "awq+gptq":
                bw = gptq_quantize(w * s[:, None], x / s, bits=4, block_size=block_size, symmetric=symmetric,
                                   act_order=act_order, name=m.node)
            res = LayerResult(m.node, 4, bw.block_size, algorithm, symmetric,
                              _rel_error(x, w, bw.dequantize() / s[:, None]), r.alpha)
            out[m.node] = QuantizedLayer(m, bw, s if scaled else None, res)
    return out


def assemble(model: onnx.ModelProto, chosen: list[QuantizedLayer]) -> onnx.ModelProto:
    """A copy of ``model`` (opset 21, IR 10) with the chosen layers' weights written as Q/DQ; layers that read the
    same input with the same AWQ scale share one ``Mul``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    name_nodes(out)
    out = ensure_qdq_opset(out)
    for q in chosen:
        write_blockwise_weight(out, q.layer, q.weight)
    groups: dict[tuple[str, int], list[QuantizedLayer]] = defaultdict(list)
    for q in chosen:
        if q.input_scale is not None:
            groups[(q.layer.activation, id(q.input_scale))].append(q)
    for members in groups.values():
        insert_input_scale(out, [q.layer for q in members], 1.0 / members[0].input_scale)
    return out


def quantize_weight_only(model: onnx.ModelProto, calibration: CalibrationSource | list | None = None, *,
                         algorithm: str = "awq", bits: int = 4, block_size: int = 32, symmetric: bool = True,
                         nodes: list[str] | None = None, layer_bits: dict[str, int] | None = None,
                         act_order: bool = True, activations: dict[str, np.ndarray] | None = None,
                         clip_search: bool = True) -> tuple[onnx.ModelProto, dict]:
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
        clip_search: RTN only; False = absmax scales, matching :mod:`dsedge.toolchain.qat`'s fake quantizer.
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
    work = onnx.ModelProto()
    work.CopyFrom(model)
    layers = select_layers(work, nodes)
    layer_bits = dict(layer_bits or {})
    for node, b in layer_bits.items():
        if b not in (4, 8, 16, 32):
            raise QuantizationError(f"layer {node!r}: {b} bits is not a supported precision", "use 4, 8, 16 or 32")
    plan = {layer.node: layer_bits.get(layer.node, bits) for layer in layers}
    todo = [layer for layer in layers if plan[layer.node] in (4, 8)]
    if activations is None and (calibration is not None or (algorithm != "rtn" and 4 in plan.values())):
        if calibration is None:
            raise CalibrationError(f"{algorithm.upper()} needs calibration data", "pass --calib DIR_OR_NPZ")
        activations = layer_activations(work, calibration, todo)
    done: dict[str, QuantizedLayer] = {}
    for b in (4, 8):
        members = [layer for layer in todo if plan[layer.node] == b]
        if members:
            done.update(quantize_layers(work, members, activations, bits=b, algorithm=algorithm,
                                        block_size=block_size, symmetric=symmetric, act_order=act_order,
                                        clip_search=clip_search))
    out = assemble(work, [done[layer.node] for layer in todo])
    report = {"algorithm": algorithm, "bits": bits, "block_size": block_size, "symmetric": symmetric,
              "layers": [asdict(done[layer.node].result) for layer in todo],
              "kept_float": [layer.node for layer in layers if plan[layer.node] not in (4, 8)]}
    return out, report


def quantize_embedding_tables(model: onnx.ModelProto, *, block_size: int = 32, symmetric: bool = True,
                              min_vocab: int = 1024) -> tuple[onnx.ModelProto, list[dict]]:
    """INT4 blockwise (along the hidden dim) word-embedding tables: Gather tables with >= ``min_vocab`` rows.

    RTN with an MSE-searched scale per block (``int4.quantize_site``), written by ``int4.write_int4_dq`` (the
    DequantizeLinear output keeps the table's name). In place; returns (model, one dict per table). ``symmetric``:
    signed INT4 without zero points, the only 4-bit form TensorRT's ONNX parser takes (TensorRT runs INT4 weights
    only in GEMMs, so its engine holds such a table dequantized); else UINT4 + zero points (ONNX Runtime).
    """
    from onnx import numpy_helper

    from .int4 import dequantize_site, find_weight_sites, quantize_site, write_int4_dq

    model = ensure_qdq_opset(model)
    inits = {t.name: t for t in model.graph.initializer}
    done = []
    for site in find_weight_sites(model, embeddings=True, min_vocab=min_vocab):
        if site.op != "Gather" or site.name not in inits:
            continue
        w = numpy_helper.to_array(inits[site.name]).astype(np.float32)
        if not np.isfinite(w).all():
            raise QuantizationError(f"embedding table {site.name!r} holds NaN/Inf values", "fix the checkpoint")
        codes, scales, zp = quantize_site(w, site.axis, block_size, symmetric)
        err = float(np.sqrt(np.mean((dequantize_site(codes, scales, site.axis, block_size, zp) - w) ** 2))
                    / (np.sqrt(np.mean(w ** 2)) + 1e-12))
        write_int4_dq(model, site, codes, scales, block_size, zp)
        done.append({"name": site.name, "node": site.node, "shape": list(site.shape), "bits": 4,
                     "block_size": block_size, "rel_rms_error": round(err, 5)})
    return model, done


def tensorrt_int4_fit(model: onnx.ModelProto, block_size: int, *, tables: bool = True,
                      min_vocab: int = 1024) -> tuple[list[str], list[dict]]:
    """Which weights TensorRT's INT4 can take at ``block_size``: its INT4 is weight-only and blockwise along K
    (TensorRT docs, "Quantization Schemes"), so K must be a whole number of blocks. A layer with K < ``block_size``
    would be written per-channel (one scale per output channel, no ``block_size``: ``graph.write_blockwise_weight``)
    and one with a partial last block has a scale shape TensorRT does not take.

    Args:
        model: the float model, its nodes named (``graph.name_nodes``).
        tables: judge the word-embedding tables too (Gather tables of >= ``min_vocab`` rows; K = the hidden dim,
            the axis their blocks run along).
    Returns:
        (names of the MatMul/Gemm nodes whose weight fits, in graph order; one dict per weight that does not:
        ``{"node", "weight", "op", "k", "reason"}``, ``op`` "Gather" for a table).
    """
    from .graph import weight_layers
    from .int4 import find_weight_sites

    fit, unfit = [], []
    for layer in weight_layers(model):
        if layer.k % block_size == 0:
            fit.append(layer.node)
        else:
            unfit.append({"node": layer.node, "weight": layer.weight, "op": layer.op_type, "k": layer.k,
                          "reason": f"K {layer.k} < block {block_size}: it would be per-channel INT4"
                          if layer.k < block_size else f"K {layer.k} is not a multiple of block {block_size}"})
    for site in find_weight_sites(model, embeddings=True, min_vocab=min_vocab) if tables else ():
        k = int(site.shape[site.axis])
        if site.op == "Gather" and k % block_size:
            unfit.append({"node": site.node, "weight": site.name, "op": "Gather", "k": k,
                          "reason": f"hidden dim {k} is not a multiple of block {block_size}"})
    return fit, unfit


def tensorrt_int4_plan(model: onnx.ModelProto, block_size: int, *, tables: bool, target: str, name: str,
                       offered: tuple[str, ...] = ()) -> tuple[tuple[str, ...] | None, bool, dict]:
    """INT4 for a TensorRT target (``dsedge build``): only the weights ``tensorrt_int4_fit`` passes. A layer whose K
    is not a multiple of the block stays float, and so do the word-embedding tables when one's hidden dim is not
    (``quantize_embedding_tables`` takes every table or none). Names ``model``'s unnamed nodes (in place), so the
    layers picked here are the ones the quantizer sees.

    Args:
        target, name: the target's and the model's names, for the error. offered: the target's precisions (hint).
    Returns:
        (the nodes to quantize, None for all; whether to quantize the tables; the record for the report:
        ``block_size``, ``float`` (each weight kept float, with its reason), ``note`` (one line, "" when none)).
    Raises:
        QuantizationError: the model has MatMul/Gemm layers and none fits: an int4 variant would hold no INT4 layer
            TensorRT can run (``--precision auto`` moves on to its next precision).
    """
    from collections import Counter

    from .graph import name_nodes

    fit, unfit = tensorrt_int4_fit(name_nodes(model), block_size, tables=tables)
    layers = [u for u in unfit if u["op"] != "Gather"]
    gathers = [u for u in unfit if u["op"] == "Gather"]
    ks = ", ".join(f"{k}" + (f" ×{c}" if c > 1 else "") for k, c in sorted(Counter(u["k"] for u in layers).items()))
    # TensorRT's other block size (build_settings.INT4_BLOCKS: 64, 128): 64 takes the layers of K 64, 192, …
    smaller = sum(1 for u in unfit if block_size > 64 and u["k"] % 64 == 0)
    if layers and not fit:
        others = [p for p in ("fp16", "int8") if p in offered]
        raise QuantizationError(
            f"int4 for {target} has no layer of {name} to convert: TensorRT's INT4 is blockwise along K with blocks "
            f"of {block_size}, and none of its {len(layers)} MatMul/Gemm layers has K a multiple of {block_size} "
            f"(K: {ks})",
            ("--block-size 64 fits some; or " if any(block_size > 64 and u["k"] % 64 == 0 for u in layers) else "")
            + (f"build --precision {' or '.join(others)}" if others else "build another precision")
            + " (or --precision auto, which skips int4)")
    said = ([f"{len(layers)} MatMul/Gemm layer{'s' if len(layers) > 1 else ''} (K {ks})"] if layers else []) + (
        ["the word-embedding table" + ("s" if len(gathers) > 1 else "") + " ("
         + ", ".join(f"{u['weight']}: hidden dim {u['k']}" for u in gathers) + ")"] if gathers else [])
    note = (f"TensorRT's INT4 is blockwise along K, K a multiple of the block ({block_size}): kept float "
            + " and ".join(said) + (f"; --block-size 64 fits {smaller} of them" if smaller else "")) if said else ""
    return (tuple(fit) if layers else None), tables and not gathers, {"block_size": block_size, "float": unfit,
                                                                      "note": note}
