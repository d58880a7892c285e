"""Batch-invariant dynamic INT8 for ONNX Runtime CPU: activations quantized per row, not per tensor.

ORT's ``quantize_dynamic`` inserts ``DynamicQuantizeLinear`` before each ``MatMulInteger``: one scale and zero point
for the whole activation tensor, i.e. for the whole batch, so a row's answer depends on its batch-mates (its scale
is set by the largest value of any row). Here each such node becomes a per-row symmetric quantizer over the last
axis (one scale per token row, ``max|x| / 127``; uint8 with the fixed zero point 128, so ORT's U8S8 integer GEMM
kernels run it), which makes every row's integer product, and so the answer, independent of the other rows. The
rest of ORT's graph (``MatMulInteger`` → ``Cast`` → ``Mul`` by activation scale × per-channel weight scale) reads
the per-row scale by broadcasting. ``QAttention`` (the fused attention of ``quantize_dynamic``) needs a scalar
scale, so attention is not quantized: ``Attention`` stays float (QKV projection included).

Per-token dynamic activation quantization is the form of LLM.int8() (Dettmers et al., NeurIPS 2022) and of
ZeroQuant (Yao et al., NeurIPS 2022).
"""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def rowwise_activation_quant(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Replace every ``DynamicQuantizeLinear`` that feeds only ``MatMulInteger`` (and its scale ``Mul``) by a
    per-row quantizer with the same output names. Returns (model, nodes replaced); ``model`` is changed in place.

    The replaced outputs: quantized uint8 ``[..., K]``, scale float ``[..., 1]`` (was a scalar), zero point uint8
    scalar 128.
    """
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outs = {o.name for o in graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    zp_name, inv_name, lo_name, hi_name, eps_name, off_name = ("rowq_zero_point", "rowq_inv127", "rowq_lo",
                                                               "rowq_hi", "rowq_eps", "rowq_offset")
    graph.initializer.extend([
        numpy_helper.from_array(np.array(128, dtype=np.uint8), zp_name),
        numpy_helper.from_array(np.array(1.0 / 127.0, dtype=np.float32), inv_name),
        numpy_helper.from_array(np.array(-127.0, dtype=np.float32), lo_name),
        numpy_helper.from_array(np.array(127.0, dtype=np.float32), hi_name),
        numpy_helper.from_array(np.array(1e-12, dtype=np.float32), eps_name),
        numpy_helper.from_array(np.array(128.0, dtype=np.float32), off_name),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "rowq_axes"),
    ])
    new_nodes, replaced = [], 0
    for n in graph.node:
        if n.op_type != "DynamicQuantizeLinear" or any(o in outs for o in n.output):
            new_nodes.append(n)
            continue
        q, s, z = n.output
        ok = all(c.op_type == "MatMulInteger" and c.input[0] == q for c in consumers.get(q, []))
        ok &= all(c.op_type == "MatMulInteger" and len(c.input) > 2 and c.input[2] == z for c in consumers.get(z, []))
        ok &= all(c.op_type == "Mul" for c in consumers.get(s, []))
        if not ok:
            new_nodes.append(n)
            continue
        x, p = n.input[0], f"{n.name or q}_rowq"
        new_nodes += [
            helper.make_node("Abs", [x], [f"{p}_abs"], name=f"{p}_Abs"),
            (helper.make_node("ReduceMax", [f"{p}_abs", "rowq_axes"], [f"{p}_max"], name=f"{p}_ReduceMax", keepdims=1)
             if opset >= 18 else
             helper.make_node("ReduceMax", [f"{p}_abs"], [f"{p}_max"], name=f"{p}_ReduceMax", keepdims=1, axes=[-1])),
            helper.make_node("Max", [f"{p}_max", eps_name], [f"{p}_maxe"], name=f"{p}_Max"),
            helper.make_node("Mul", [f"{p}_maxe", inv_name], [s], name=f"{p}_Scale"),
            helper.make_node("Div", [x, s], [f"{p}_div"], name=f"{p}_Div"),
            helper.make_node("Round", [f"{p}_div"], [f"{p}_round"], name=f"{p}_Round"),
            helper.make_node("Clip", [f"{p}_round", lo_name, hi_name], [f"{p}_clip"], name=f"{p}_Clip"),
            helper.make_node("Add", [f"{p}_clip", off_name], [f"{p}_u"], name=f"{p}_Shift"),
            helper.make_node("Cast", [f"{p}_u"], [q], name=f"{p}_Cast", to=TensorProto.UINT8),
            helper.make_node("Identity", [zp_name], [z], name=f"{p}_ZeroPoint"),
        ]
        replaced += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    # the scale outputs changed rank: drop stale value infos so shape inference does not contradict them
    stale = {o for n in new_nodes if n.name.endswith("_rowq_Scale") for o in n.output}
    keep = [vi for vi in graph.value_info if vi.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    return model, replaced


def quantize_int8_rowwise(model: onnx.ModelProto, *, fuse: str | None = "bert", per_channel: bool = True,
                          nodes_to_exclude: list[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """Batch-invariant dynamic INT8 for ORT CPU (see the module doc); optional transformer fusion first.

    Weights INT8 per output channel (``quantize_dynamic``), embedding tables (Gather) UINT8, activations INT8 per
    row at run time. Returns (model, report) with the same keys as ``quantize_int8_dynamic`` plus
    ``"batch_invariant": True`` and ``"activation_scales": "per-row"``. Raises QuantizationError on NaN/Inf weights.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from .int8 import _save, check_initializers_finite, fuse_transformer, without_preprocess_hint

    check_initializers_finite(model)
    fused: dict = {}
    if fuse:
        model, fused = fuse_transformer(model, model_type=fuse)
    with tempfile.TemporaryDirectory(prefix="dsedge-rowq-") as tmp, without_preprocess_hint():
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        _save(model, src)
        quantize_dynamic(str(src), str(dst), per_channel=per_channel, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gemm", "Gather"],
                         nodes_to_exclude=list(nodes_to_exclude or []),
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        out = onnx.load(str(dst))
    out, replaced = rowwise_activation_quant(out)
    left = sum(n.op_type == "DynamicQuantizeLinear" for n in out.graph.node)
    if left:
        from ...runtime.errors import QuantizationError

        raise QuantizationError(f"{left} per-tensor dynamic quantizer(s) could not be made per-row",
                                "use quantize_int8_dynamic (batch-variant) for this graph")
    counts = Counter(n.op_type for n in out.graph.node)
    report = {"precision": "int8", "mode": "dynamic", "per_channel": per_channel, "fused": fused,
              "activation_scales": "per-row", "batch_invariant": True, "rowwise_quantizers": replaced,
              "ops": {k: v for k, v in counts.items() if k in ("MatMulInteger", "Attention", "QAttention")}}
    return out, report
