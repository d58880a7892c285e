"""Batch-invariant dynamic INT8 for ONNX Runtime CPU: activations quantized per row, not per tensor.

ORT's ``quantize_dynamic`` inserts ``DynamicQuantizeLinear`` before each ``MatMulInteger``: one scale and zero point
for the whole activation tensor, i.e. for the whole batch, so a row's answer depends on its batch-mates (its scale
is set by the largest value of any row). Here each such node becomes a per-row quantizer over the last axis (one
centre and scale per token row, covering the row's [min, max] with 255 levels like an asymmetric quantizer; uint8
with the fixed zero point 128, so ORT's U8S8 integer GEMM kernels run it; the centre's share is added back after the
GEMM from the weights' column sums), which makes every row's integer product, and so the answer, independent of
the other rows. The
rest of ORT's graph (``MatMulInteger`` → ``Cast`` → ``Mul`` by activation scale × per-channel weight scale) reads
the per-row scale by broadcasting. ``QAttention`` (the fused attention of ``quantize_dynamic``) needs a scalar
scale, so a fused ``Attention`` stays float, its QKV projection included; fused as ``MultiHeadAttention``
(``fuse_transformer(attention="MultiHeadAttention")``, as the cpu target builds it) the Q, K and V projections are
MatMuls and are quantized per row like the others (one quantizer for the three), and only the attention itself
(scores, softmax, weighted sum) runs in float.

Weights are quantized per output channel to **7 bits** by default (``weight_type="int7"``: ORT's ``reduce_range``,
signed values in [-64, 63]). ORT's U8S8 GEMM on AVX2 adds pairs of u8 × s8 products in int16 (``vpmaddubsw``),
which saturates with 8-bit weights once activations span their full range, as per-row scales make common; 7-bit
weights keep every pair sum within int16, so the fast U8S8 path is exact on AVX2 and VNNI hosts alike.
``"uint8"`` weights (ORT's U8U8 path, also exact) were the default before: on the reference model (all-MiniLM-L6-v2,
2-core AMD host with AVX-512/VNNI, ORT 1.32, intra-op spinning off as dsedge runs it, forms alternating), p50 b1×32
/ b32×64 was 3.62 / 137.8 ms with int7, 4.25 / 158.8 ms with uint8 and 4.35 / 162.5 ms for the fused fp32; mean
cosine to fp32 on the bundle's golden sentences 0.9983 (int7) and 0.9992 (uint8). ``"int8"`` can saturate on AVX2.

Per-token dynamic activation quantization is the form of LLM.int8() (Dettmers et al., NeurIPS 2022) and of
ZeroQuant (Yao et al., NeurIPS 2022).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper


def rowwise_activation_quant(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Replace every ``DynamicQuantizeLinear`` that feeds only ``MatMulInteger`` → ``Cast`` → ``Mul`` chains by a
    per-row quantizer with the same output names. Returns (model, nodes replaced); ``model`` is changed in place.

    Each row is centred first (``c = (max + min) / 2``, ``s = (max − min) / 254``) so all 255 levels cover the row's
    range, as an asymmetric quantizer's would; the centre's share of the product, ``c · Σ_k W[k, n]``, is added back
    after the float rescale (the column sums of the dequantized weights are constants). The replaced outputs:
    quantized uint8 ``[..., K]`` (zero point 128), scale float ``[..., 1]`` (was a scalar), zero point uint8 128.
    """
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    inits = {t.name: t for t in graph.initializer}
    outs = {o.name for o in graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    consts = {"rowq_zero_point": np.array(128, dtype=np.uint8), "rowq_inv127": np.array(1.0 / 127.0, np.float32),
              "rowq_eps": np.array(1e-12, np.float32), "rowq_half": np.array(0.5, np.float32),
              "rowq_zero_points": np.array([128], dtype=np.uint8), "rowq_flat": np.array([-1], np.int64)}
    if opset >= 18:  # Reduce* take their axes as an input from opset 18 on (an attribute before)
        consts["rowq_axes"] = np.array([-1], np.int64)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())

    def reduce(op: str, x: str, y: str, name: str) -> onnx.NodeProto:
        if opset >= 18:
            return helper.make_node(op, [x, "rowq_axes"], [y], name=name, keepdims=1)
        return helper.make_node(op, [x], [y], name=name, keepdims=1, axes=[-1])

    def chain(mm: onnx.NodeProto) -> tuple[onnx.NodeProto, np.ndarray] | None:
        # MatMulInteger → Cast → Mul: the Mul whose output is the float product, and Σ_k of the dequantized weight
        casts = consumers.get(mm.output[0], [])
        if len(casts) != 1 or casts[0].op_type != "Cast":
            return None
        muls = consumers.get(casts[0].output[0], [])
        if len(muls) != 1 or muls[0].op_type != "Mul" or mm.input[1] not in inits:
            return None
        wq = numpy_helper.to_array(inits[mm.input[1]]).astype(np.float64)
        wz = numpy_helper.to_array(inits[mm.input[3]]).astype(np.float64) if len(mm.input) > 3 and mm.input[3] else 0.0
        scale_src = [i for i in muls[0].input if i != casts[0].output[0]]
        comb = next((c for c in graph.node if c.output and c.output[0] in scale_src and c.op_type == "Mul"), None)
        ws = [i for i in (comb.input if comb is not None else []) if i in inits]
        if not ws:
            return None
        w_scale = numpy_helper.to_array(inits[ws[0]]).astype(np.float64)
        colsum = ((wq - wz) * w_scale).sum(axis=0).astype(np.float32)
        return muls[0], colsum

    new_nodes, replaced, tails = [], 0, {}
    for n in graph.node:
        if n.op_type != "DynamicQuantizeLinear" or any(o in outs for o in n.output):
            new_nodes.append(n)
            continue
        q, s, z = n.output
        mms = consumers.get(q, [])
        ok = bool(mms) and all(c.op_type == "MatMulInteger" and c.input[0] == q for c in mms)
        ok &= all(c.op_type == "MatMulInteger" and len(c.input) > 2 and c.input[2] == z for c in consumers.get(z, []))
        ok &= all(c.op_type == "Mul" for c in consumers.get(s, []))
        found = [chain(c) for c in mms] if ok else []
        if not ok or any(f is None for f in found):
            new_nodes.append(n)
            continue
        x, p = n.input[0], f"{n.name or q}_rowq"
        new_nodes += [
            reduce("ReduceMax", x, f"{p}_max", f"{p}_ReduceMax"),
            reduce("ReduceMin", x, f"{p}_min", f"{p}_ReduceMin"),
            helper.make_node("Add", [f"{p}_max", f"{p}_min"], [f"{p}_sum"], name=f"{p}_Sum"),
            helper.make_node("Mul", [f"{p}_sum", "rowq_half"], [f"{p}_center"], name=f"{p}_Center"),
            helper.make_node("Sub", [f"{p}_max", f"{p}_center"], [f"{p}_halfrange"], name=f"{p}_HalfRange"),
            helper.make_node("Max", [f"{p}_halfrange", "rowq_eps"], [f"{p}_hr"], name=f"{p}_Eps"),
            helper.make_node("Mul", [f"{p}_hr", "rowq_inv127"], [s], name=f"{p}_Scale"),
            helper.make_node("Sub", [x, f"{p}_center"], [f"{p}_centred"], name=f"{p}_Centre"),
            # q = saturate(round(centred / s) + 128) in one per-axis QuantizeLinear over the [rows, K] view (the
            # same codes as Div → Round → Clip → Add → Cast, in one pass over the tensor instead of five)
            helper.make_node("Shape", [f"{p}_centred"], [f"{p}_shape"], name=f"{p}_Shape"),
            helper.make_node("Flatten", [f"{p}_centred"], [f"{p}_rows"], name=f"{p}_Rows", axis=-1),
            helper.make_node("Reshape", [s, "rowq_flat"], [f"{p}_scale_rows"], name=f"{p}_ScaleRows"),
            helper.make_node("Shape", [f"{p}_scale_rows"], [f"{p}_nrows"], name=f"{p}_NRows"),
            helper.make_node("Expand", ["rowq_zero_points", f"{p}_nrows"], [f"{p}_zp_rows"], name=f"{p}_ZpRows"),
            helper.make_node("QuantizeLinear", [f"{p}_rows", f"{p}_scale_rows", f"{p}_zp_rows"], [f"{p}_q_rows"],
                             name=f"{p}_Quantize", axis=0),
            helper.make_node("Reshape", [f"{p}_q_rows", f"{p}_shape"], [q], name=f"{p}_Unflatten"),
            helper.make_node("Identity", ["rowq_zero_point"], [z], name=f"{p}_ZeroPoint"),
        ]
        for k, (mul, colsum) in enumerate(found):
            tails[id(mul)] = (f"{p}_center", colsum, f"{p}_{k}")
        replaced += 1
    final = []
    for n in new_nodes:
        final.append(n)
        if id(n) in tails:  # add the centre's share back: y = y_centred + c · colsum(W)
            center, colsum, p = tails[id(n)]
            y = n.output[0]
            n.output[0] = f"{p}_ycentred"
            graph.initializer.append(numpy_helper.from_array(colsum, f"{p}_colsum"))
            final += [helper.make_node("Mul", [center, f"{p}_colsum"], [f"{p}_shift_out"], name=f"{p}_CenterShare"),
                      helper.make_node("Add", [f"{p}_ycentred", f"{p}_shift_out"], [y], name=f"{p}_AddCenter")]
    del graph.node[:]
    graph.node.extend(final)
    # the scale outputs changed rank: drop stale value infos so shape inference does not contradict them
    stale = {o for n in final if n.name.endswith("_rowq_Scale") for o in n.output}
    keep = [vi for vi in graph.value_info if vi.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    return model, replaced


def quantize_int8_rowwise(model: onnx.ModelProto, *, fuse: str | None = "bert", per_channel: bool = True,
                          nodes_to_exclude: list[str] | None = None,
                          weight_type: str = "int7") -> tuple[onnx.ModelProto, dict]:
    """Batch-invariant dynamic INT8 for ORT CPU (see the module doc); optional transformer fusion first.

    Weights per output channel (``quantize_dynamic``; ``weight_type`` "int7" (default), "uint8" or "int8": see the
    module doc), embedding tables (Gather) likewise, activations 8-bit per row at run time. Returns (model, report)
    with the same keys as ``quantize_int8_dynamic`` plus ``"batch_invariant": True`` and ``"activation_scales":
    "per-row"``. Raises QuantizationError on NaN/Inf weights.
    """
    from .int8 import quantize_int8_dynamic

    out, dynamic = quantize_int8_dynamic(model, per_channel=per_channel, fuse=fuse,
                                         op_types=("MatMul", "Gemm", "Gather"), nodes_to_exclude=nodes_to_exclude,
                                         weight_type=weight_type)
    out, replaced = rowwise_activation_quant(out)
    left = sum(n.op_type == "DynamicQuantizeLinear" for n in out.graph.node)
    if left:
        from ...runtime.errors import QuantizationError

        raise QuantizationError(f"{left} per-tensor dynamic quantizer(s) could not be made per-row",
                                "use quantize_int8_dynamic (batch-variant) for this graph")
    counts = Counter(n.op_type for n in out.graph.node)
    report = {"precision": "int8", "mode": "dynamic", "per_channel": per_channel, "fused": dynamic["fused"],
              "activation_scales": "per-row", "batch_invariant": True, "rowwise_quantizers": replaced,
              "weight_type": weight_type,
              "ops": {k: v for k, v in counts.items() if k in ("MatMulInteger", "Attention", "MultiHeadAttention",
                                                                 "QAttention")}}
    return out, report
