"""ONNX graph edits shared by the quantizers: find weight layers, write blockwise Q/DQ weights, insert AWQ scales.

A *weight layer* is a MatMul whose second input is a 2-D initializer ``[K, N]``, or a Gemm whose ``B`` is an
initializer (``[K, N]``, or ``[N, K]`` with ``transB=1``). Its weight is replaced by an integer initializer plus
float32 scales feeding ``DequantizeLinear`` (opset 21, ``block_size`` along K), the form ORT and TensorRT read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...runtime.errors import QuantizationError
from .blockwise import BlockwiseWeight

QDQ_OPSET = 21


@dataclass(frozen=True)
class WeightLayer:
    """One MatMul/Gemm with an initializer weight. ``k`` = input features, ``n`` = output features."""

    node: str           # node name (unique; unnamed nodes are named by :func:`name_nodes`)
    op_type: str        # "MatMul" | "Gemm"
    activation: str     # the activation input tensor (x in y = x @ W)
    weight: str         # initializer name
    k: int
    n: int
    transposed: bool    # Gemm transB=1: the initializer is [N, K]


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every unnamed node a unique name ``{op_type}_{index}`` (in place; returns the model)."""
    seen: set[str] = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in seen:
                name += "_"
            node.name = name
            seen.add(name)
    return model


INT8_QDQ_OPSET = 13  # per-channel DequantizeLinear (its ``axis``) since opset 13; TensorRT 8.5 (Xavier) reads <= 17


def ensure_qdq_opset(model: onnx.ModelProto, minimum: int = 21) -> onnx.ModelProto:
    """Model at default-domain opset >= ``minimum``; a model already there is returned as it is.

    ``minimum=21`` (INT4): blockwise DequantizeLinear and INT4 need opset 21 and IR >= 10 (``onnx.version_converter``
    leaves IR 8 behind, so the IR version is raised explicitly). ``minimum=INT8_QDQ_OPSET`` (INT8 Q/DQ, SmoothQuant):
    per-channel DequantizeLinear needs 13, and a model at 13–20 keeps its opset, so an INT8 variant still fits a
    target that reads opset <= 17 (raising an opset-17 BERT to 21 could not come back down: the converter has no
    ConstantOfShape adapter from 21 to 20).
    """
    if minimum >= 21:
        from .int4 import ensure_opset21

        return ensure_opset21(model)
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if version >= minimum:
        return model
    from onnx import version_converter

    return version_converter.convert_version(model, minimum)


def initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def weight_layers(model: onnx.ModelProto) -> list[WeightLayer]:
    """Every MatMul/Gemm whose weight is a float 2-D initializer, in graph order (nodes must be named)."""
    inits = initializers(model)
    out: list[WeightLayer] = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        t = inits[node.input[1]]
        if len(t.dims) != 2 or t.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and attrs.get("transA", 0):
            continue
        trans = node.op_type == "Gemm" and bool(attrs.get("transB", 0))
        k, n = (t.dims[1], t.dims[0]) if trans else (t.dims[0], t.dims[1])
        out.append(WeightLayer(node.name, node.op_type, node.input[0], node.input[1], int(k), int(n), trans))
    return out


# Ops only a quantized graph holds: ONNX Q/DQ and integer ops, ORT's com.microsoft quantized kernels.
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
                           "ConvInteger", "MatMulNBits", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QGemm",
                           "QAttention", "QOrderedMatMul"})
WEIGHT_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})


def quantized_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of the main graph that show ``model`` is quantized already: ``QUANTIZED_OPS`` and ``QLinear*``
    (their integer initializers feed nothing else). A ``DequantizeLinear`` counts only where it feeds a
    MatMul/Gemm/Conv (a quantized weight layer): one feeding a ``Gather`` is an INT4 embedding table
    (``weight_only.quantize_embedding_tables``, which ``dsedge build`` applies before a gated INT4 search), which the
    weight quantizers never touch, so the model's layers are still float."""
    readers: dict[str, list[str]] = {}
    for n in model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n.op_type)
    found = []
    for n in model.graph.node:
        if n.op_type not in QUANTIZED_OPS and not n.op_type.startswith("QLinear"):
            continue
        if n.op_type == "DequantizeLinear" and not any(r in WEIGHT_OPS for o in n.output for r in readers.get(o, [])):
            continue
        found.append(n)
    return found


QUANTIZED_COMPUTE_OPS = QUANTIZED_OPS - {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def layer_coverage(model: onnx.ModelProto) -> tuple[int, dict[str, int]]:
    """How much of ``model``'s main graph a quantizer converted: ``(converted, float_layers)``.

    ``converted`` counts the integer compute nodes (``QUANTIZED_COMPUTE_OPS``, ``QLinear*``), the
    MatMul/Gemm/Conv/ConvTranspose nodes whose weight (input 1) a ``DequantizeLinear`` produces, and the ``Gather``
    nodes reading a dequantized (INT4) table. ``float_layers`` counts by op type the MatMul/Gemm/Conv/ConvTranspose
    nodes whose weight is still a float initializer, e.g. ``{"Conv": 2}`` after INT4 (which converts MatMul/Gemm
    weights only) of a CNN. A weight that is a graph input (no initializer) is no layer either way.
    """
    floats = {t.name for t in model.graph.initializer
              if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)}
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    converted, float_layers = 0, {}
    for n in model.graph.node:
        if n.op_type in QUANTIZED_COMPUTE_OPS or n.op_type.startswith("QLinear"):
            converted += 1
        elif n.op_type in WEIGHT_OPS and len(n.input) > 1:
            if n.input[1] in dequantized:
                converted += 1
            elif n.input[1] in floats:
                float_layers[n.op_type] = float_layers.get(n.op_type, 0) + 1
        elif n.op_type == "Gather" and n.input and n.input[0] in dequantized:
            converted += 1
    return converted, float_layers


def half_weights(model: onnx.ModelProto) -> tuple[list[onnx.TensorProto], int]:
    """The fp16/bf16 weight tensors of ``model`` (float initializers of 2 or more dims) and how many float weight
    tensors it has in all: an fp16 model is not a source to compress or to build from (its layers are read as
    weights, and the Q/DQ graph written around fp16 activations does not load in ONNX Runtime)."""
    floats = [t for t in model.graph.initializer if len(t.dims) >= 2 and t.data_type in
              (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)]
    return [t for t in floats if t.data_type != TensorProto.FLOAT], len(floats)


def describe_half(half: list[onnx.TensorProto], total: int) -> str:
    """``"fp16 weights (2 of 2 float weight tensors, e.g. 'w1')"``."""
    kinds = sorted({"fp16" if t.data_type == TensorProto.FLOAT16 else "bf16" for t in half})
    return f"{'/'.join(kinds)} weights ({len(half)} of {total} float weight tensors, e.g. {half[0].name!r})"


def refuse_quantized(model: onnx.ModelProto) -> None:
    """Raises QuantizationError when ``model`` is quantized already (:func:`quantized_nodes`), naming the ops found:
    compressing it again would quantize quantized weights, or silently skip the layers it could no longer read; or
    when its weights are fp16/bf16 (:func:`half_weights`)."""
    found = quantized_nodes(model)
    if found:
        counts: dict[str, int] = {}
        for n in found:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        ops = ", ".join(f"{c} {op}" for op, c in ranked)
        first = next(n for n in found if n.op_type == ranked[0][0])
        raise QuantizationError(f"the model is already quantized ({ops} node{'s' * (len(found) > 1)}, e.g. "
                                f"{first.name or first.op_type!r}): compressing it again would double-quantize it",
                                "quantize the fp32 source model it was made from")
    half, total = half_weights(model)
    if half:
        raise QuantizationError(f"the model holds {describe_half(half, total)}: compression reads fp32 weights",
                                "compress the fp32 model it was made from (the fp16 preset makes the fp16 model "
                                "from it)")


def select_layers(model: onnx.ModelProto, nodes: list[str] | None) -> list[WeightLayer]:
    """The weight layers named in ``nodes`` (all when None). Raises QuantizationError for an unknown or
    unsupported node name, naming it."""
    layers = weight_layers(name_nodes(model))
    if nodes is None:
        return layers
    by_name = {layer.node: layer for layer in layers}
    all_nodes = {n.name: n.op_type for n in model.graph.node}
    for name in nodes:
        if name not in by_name:
            if name in all_nodes:
                raise QuantizationError(
                    f"layer {name!r} ({all_nodes[name]}) has no initializer weight to quantize",
                    "only MatMul/Gemm with a constant 2-D weight can be weight-quantized")
            names = [layer.node for layer in layers]
            raise QuantizationError(f"no node named {name!r} in the model",
                                    f"its MatMul/Gemm weight layers: {', '.join(names[:6]) or 'none'}"
                                    + (f" (… {len(names)} in all)" if len(names) > 6 else ""))
    return [by_name[name] for name in nodes]


def weight_kn(model: onnx.ModelProto, layer: WeightLayer) -> np.ndarray:
    """The layer's weight as float32 ``[K, N]``."""
    w = numpy_helper.to_array(initializers(model)[layer.weight]).astype(np.float32)
    return w.T if layer.transposed else w


def _int_tensor(codes: np.ndarray, bits: int, signed: bool, name: str) -> onnx.TensorProto:
    import ml_dtypes

    if bits == 4:
        dtype = ml_dtypes.int4 if signed else ml_dtypes.uint4
    elif bits == 8:
        dtype = np.int8 if signed else np.uint8
    else:
        raise QuantizationError(f"{bits}-bit weights are not supported", "use 4 or 8 bits")
    return numpy_helper.from_array(np.ascontiguousarray(codes).astype(dtype), name)


def _unique(model: onnx.ModelProto, base: str) -> str:
    taken = {t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output} \
        | {n.name for n in model.graph.node}
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def write_blockwise_weight(model: onnx.ModelProto, layer: WeightLayer, bw: BlockwiseWeight) -> None:
    """Replace ``layer``'s float weight by ``DequantizeLinear(codes, scales[, zero_points], axis, block_size)``.

    Symmetric weights are signed (INT4 [-8, 7] / INT8) with no zero point; asymmetric ones are unsigned with a
    zero point of the same type. A block size >= K writes a per-channel DQ (no ``block_size`` attribute). The
    old initializer is removed when nothing else reads it. In place; the model must be at opset >= 21.
    """
    codes, scales, zps = bw.codes, bw.scales, bw.zero_points
    per_channel = bw.block_size >= layer.k
    signed = zps is None
    if per_channel:
        scales = scales.reshape(-1)                         # [N]
        zps = None if zps is None else zps.reshape(-1)
    if layer.transposed:                                     # stored [N, K]; blocks along axis 1
        codes = codes.T
        if not per_channel:
            scales = scales.T
            zps = None if zps is None else zps.T
        axis = 0 if per_channel else 1
    else:
        axis = 1 if per_channel else 0
    base = layer.weight.replace("/", "_").strip("_") or "w"
    q_name = _unique(model, f"{base}_q{bw.bits}")
    s_name = _unique(model, f"{base}_scale")
    inits = [_int_tensor(codes, bw.bits, signed, q_name), numpy_helper.from_array(scales.astype(np.float32), s_name)]
    dq_inputs = [q_name, s_name]
    if zps is not None:
        z_name = _unique(model, f"{base}_zero_point")
        inits.append(_int_tensor(zps.astype(np.int16).clip(0, 255), bw.bits, False, z_name))
        dq_inputs.append(z_name)
    out_name = _unique(model, f"{base}_dequantized")
    attrs = {"axis": axis}
    if not per_channel:
        attrs["block_size"] = bw.block_size
    dq = helper.make_node("DequantizeLinear", dq_inputs, [out_name], name=_unique(model, f"{layer.node}_weight_dq"),
                          **attrs)
    model.graph.initializer.extend(inits)
    nodes = list(model.graph.node)
    idx = next(i for i, n in enumerate(nodes) if n.name == layer.node)
    target = nodes[idx]
    old = target.input[1]
    target.input[1] = out_name
    model.graph.node.insert(idx, dq)
    drop_unused_initializer(model, old)


def drop_unused_initializer(model: onnx.ModelProto, name: str) -> None:
    """Remove initializer ``name`` when no node input or graph output reads it."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    if name not in used:
        idx = next((i for i, t in enumerate(model.graph.initializer) if t.name == name), None)
        if idx is not None:
            del model.graph.initializer[idx]          # in place: no copy of the other tensors
        for i, vi in enumerate(model.graph.input):    # older exporters also list initializers as inputs
            if vi.name == name:
                del model.graph.input[i]
                break


def insert_input_scale(model: onnx.ModelProto, layers: list[WeightLayer], inv_scale: np.ndarray) -> str:
    """Insert ``Mul(x, inv_scale)`` (float32 ``[K]``) before every layer in ``layers`` (all read the same ``x``).

    This is AWQ's activation division ``X / s`` (arXiv:2306.00978, Sec. 3.2) kept as an explicit node when it
    cannot be folded into the producer. Returns the Mul node's name.
    """
    x = layers[0].activation
    if any(layer.activation != x for layer in layers):
        raise QuantizationError("AWQ scale group mixes layers with different inputs",
                                "group layers by their activation tensor")
    s_name = _unique(model, f"{layers[0].node}_awq_inv_scale")
    out = _unique(model, f"{layers[0].node}_awq_scaled_input")
    mul = helper.make_node("Mul", [x, s_name], [out], name=_unique(model, f"{layers[0].node}_awq_mul"))
    model.graph.initializer.append(numpy_helper.from_array(inv_scale.astype(np.float32), s_name))
    names = {layer.node for layer in layers}
    nodes = list(model.graph.node)
    first = min(i for i, n in enumerate(nodes) if n.name in names)
    for n in nodes:
        if n.name in names:
            n.input[0] = out
    model.graph.node.insert(first, mul)
    return mul.name


def set_weight(model: onnx.ModelProto, layer: WeightLayer, w_kn: np.ndarray) -> None:
    """Overwrite the layer's float initializer with ``w_kn`` (float32 ``[K, N]``), keeping its layout."""
    t = initializers(model)[layer.weight]
    arr = w_kn.T if layer.transposed else w_kn
    t.CopyFrom(numpy_helper.from_array(arr.astype(numpy_helper.to_array(t).dtype), layer.weight))


def materialize_constants(model: onnx.ModelProto) -> int:
    """Turn, in place, ``Identity(initializer)`` and tensor-valued ``Constant`` nodes into initializers.

    The TorchScript exporter shares equal weights through Identity nodes (e.g. equal folded Conv biases), and ORT's
    static quantizer only quantizes a Conv bias that is an initializer (otherwise the Conv cannot run as
    QLinearConv). Returns the number of nodes replaced.
    """

    inits = {t.name: t for t in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    replaced = []
    for n in model.graph.node:
        if n.output[0] in graph_outputs:
            continue
        if n.op_type == "Identity" and n.input[0] in inits:
            t = onnx.TensorProto()
            t.CopyFrom(inits[n.input[0]])
        elif n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(n.attribute[0].t)
        else:
            continue
        t.name = n.output[0]
        model.graph.initializer.append(t)
        inits[t.name] = t
        replaced.append(n)
    for n in replaced:
        model.graph.node.remove(n)
    return len(replaced)
