"""Write the ONNX at an opset the target's TensorRT / ONNX Runtime reads (``target.opset``), with a matching IR version.

Facts used: INT4 block DequantizeLinear (``block_size``, 4-bit types) exists only from opset 21 (ONNX operators spec),
so it cannot be converted down for TensorRT 8.5 (opset ≤ 17); ``onnx.version_converter`` keeps the old IR version
(e.g. IR 8 at opset 21), so the IR version is set from ``onnx.helper.find_min_ir_version_for``.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, version_converter

from ..runtime.errors import TargetError
from ..targets import Target

INT4_OPSET = 21
_FOUR_BIT = {TensorProto.INT4, TensorProto.UINT4}
_DEFAULT_DOMAINS = ("", "ai.onnx")


def model_opset(model: onnx.ModelProto) -> int:
    """The ``ai.onnx`` opset the model imports. Raises TargetError when it imports none."""
    for op in model.opset_import:
        if op.domain in _DEFAULT_DOMAINS:
            return int(op.version)
    raise TargetError("the ONNX model imports no ai.onnx opset", "re-export the model")


def uses_int4(model: onnx.ModelProto) -> bool:
    """True when the graph holds 4-bit tensors or a blocked DequantizeLinear (both opset ≥ 21)."""
    g = model.graph
    if any(t.data_type in _FOUR_BIT for t in g.initializer):
        return True
    for n in g.node:
        if n.op_type == "DequantizeLinear" and any(a.name == "block_size" and a.i for a in n.attribute):
            return True
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in _FOUR_BIT:
                    return True
    return False


def custom_ops(model: onnx.ModelProto) -> list[str]:
    """``domain::op_type`` of nodes outside ai.onnx (e.g. ``com.microsoft::MatMulNBits``), sorted, unique."""
    return sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in _DEFAULT_DOMAINS})


def _tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    # each named value's tensor type (element type, shape) after ONNX shape inference
    g = onnx.shape_inference.infer_shapes(model).graph
    return {v.name: v.type.tensor_type for v in [*g.input, *g.value_info, *g.output]}


def lower_gelu(model: onnx.ModelProto) -> int:
    """Rewrite each ai.onnx ``Gelu`` (opset 20, no earlier version) in place into the ops older parsers read:
    ``0.5·x·(1 + erf(x/√2))``, or for ``approximate="tanh"`` ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``
    (the Gelu definition in the ONNX operators spec; Hendrycks & Gimpel 2016). Returns how many were rewritten."""
    gelus = [n for n in model.graph.node if n.op_type == "Gelu" and n.domain in _DEFAULT_DOMAINS]
    if not gelus:
        return 0
    types = {k: t.elem_type for k, t in _tensor_types(model).items()}
    out_nodes, inits = [], []
    for i, n in enumerate(model.graph.node):
        if n not in gelus:
            out_nodes.append(n)
            continue
        x, y = n.input[0], n.output[0]
        approx = next((a.s.decode() for a in n.attribute if a.name == "approximate"), "none")
        dtype = helper.tensor_dtype_to_np_dtype(types.get(x) or TensorProto.FLOAT)
        p = f"{n.name or 'gelu'}_{i}_lowered"

        def const(name: str, value: float) -> str:
            inits.append(numpy_helper.from_array(np.array(value, dtype=dtype), f"{p}/{name}"))
            return f"{p}/{name}"

        def node(op: str, ins: list[str], out: str) -> str:
            out_nodes.append(helper.make_node(op, ins, [out], name=f"{p}/{out.rsplit('/', 1)[-1]}"))
            return out

        if approx == "tanh":
            x3 = node("Mul", [node("Mul", [x, x], f"{p}/x2"), x], f"{p}/x3")
            inner = node("Add", [x, node("Mul", [x3, const("c", 0.044715)], f"{p}/cx3")], f"{p}/inner")
            t = node("Tanh", [node("Mul", [inner, const("k", math.sqrt(2 / math.pi))], f"{p}/kin")], f"{p}/tanh")
        else:
            t = node("Erf", [node("Div", [x, const("sqrt2", math.sqrt(2.0))], f"{p}/xs")], f"{p}/erf")
        one_plus = node("Add", [t, const("one", 1.0)], f"{p}/onep")
        out_nodes.append(helper.make_node("Mul", [node("Mul", [x, one_plus], f"{p}/xm"), const("half", 0.5)], [y],
                                          name=f"{p}/out"))
    del model.graph.node[:]
    model.graph.node.extend(out_nodes)
    model.graph.initializer.extend(inits)
    return len(gelus)


def lower_layernorm(model: onnx.ModelProto, opset: int) -> int:
    """Rewrite each ai.onnx ``LayerNormalization`` (opset 17) in place into ops TensorRT 8.5's ONNX parser imports
    (it has no importer for LayerNormalization: onnx-tensorrt release/8.5-GA docs/operators.md; 8.6 added one):
    ``mean = ReduceMean(x)``, ``d = x − mean``, ``y = d / √(ReduceMean(d²) + ε) · scale (+ bias)`` over the axes from
    ``axis`` to the last (the LayerNormalization definition in the ONNX operators spec; Ba et al. 2016), computed in
    float32 as its default ``stash_type`` says (a float16 input is cast up and back). ``opset``: the model's opset
    (ReduceMean takes its axes as an attribute before 18, as an input from 18). Nodes whose Mean / InvStdDev outputs
    are used, or whose normalized axes cannot be told (a non-negative ``axis`` on an input of unknown rank), are left
    as they are. Returns how many were rewritten."""
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization" and n.domain in _DEFAULT_DOMAINS]
    if not norms:
        return 0
    info = _tensor_types(model)
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    out_nodes, inits, done = [], [], 0
    for i, n in enumerate(model.graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        x = n.input[0] if n.input else ""
        tt = info.get(x)
        rank = len(tt.shape.dim) if tt is not None and tt.HasField("shape") else None
        axis = int(attrs.get("axis", -1))
        if (n not in norms or any(o and o in used for o in n.output[1:])
                or (axis >= 0 and rank is None) or int(attrs.get("stash_type", 1)) != 1):
            out_nodes.append(n)
            continue
        axes = list(range(axis, 0)) if axis < 0 else list(range(axis - rank, 0))
        eps = float(attrs.get("epsilon", 1e-5))
        elem = tt.elem_type if tt is not None and tt.elem_type else TensorProto.FLOAT
        p = f"{n.name or 'layernorm'}_{i}_lowered"

        def node(op: str, ins: list[str], out: str, **kw) -> str:
            out_nodes.append(helper.make_node(op, ins, [out], name=f"{p}/{out.rsplit('/', 1)[-1]}", **kw))
            return out

        def mean(v: str, out: str) -> str:
            if opset >= 18:
                if f"{p}/axes" not in {t.name for t in inits}:
                    inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"{p}/axes"))
                return node("ReduceMean", [v, f"{p}/axes"], out, keepdims=1)
            return node("ReduceMean", [v], out, axes=axes, keepdims=1)

        xf = x if elem == TensorProto.FLOAT else node("Cast", [x], f"{p}/x32", to=TensorProto.FLOAT)
        inits.append(numpy_helper.from_array(np.array(eps, np.float32), f"{p}/eps"))
        d = node("Sub", [xf, mean(xf, f"{p}/mean")], f"{p}/d")
        var = mean(node("Mul", [d, d], f"{p}/d2"), f"{p}/var")
        normed = node("Div", [d, node("Sqrt", [node("Add", [var, f"{p}/eps"], f"{p}/vareps")], f"{p}/std")],
                      f"{p}/normed")
        if elem != TensorProto.FLOAT:
            normed = node("Cast", [normed], f"{p}/normed_back", to=elem)
        y = n.output[0]
        has_bias = len(n.input) > 2 and bool(n.input[2])
        scaled = node("Mul", [normed, n.input[1]], f"{p}/scaled" if has_bias else y)
        if has_bias:
            node("Add", [scaled, n.input[2]], y)
        done += 1
    del model.graph.node[:]
    model.graph.node.extend(out_nodes)
    model.graph.initializer.extend(inits)
    return done


# Reduce ops that gained ``noop_with_empty_axes`` (and ``axes`` as an input) in opset 18; ReduceSum had both from 13
_REDUCE_18 = frozenset({"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
                        "ReduceLogSumExp", "ReduceSumSquare"})


def drop_reduce_noop_attribute(model: onnx.ModelProto, opset: int) -> int:
    """Remove, in place, ``noop_with_empty_axes`` from the Reduce ops that have no such attribute before opset 18,
    when ``model`` was moved below 18: ``onnx.version_converter`` puts ``axes`` back as an attribute but keeps the
    opset-18 attribute, so the model fails ``onnx.checker`` ("Unrecognized attribute: noop_with_empty_axes for
    operator ReduceMean"; torch's dynamo exporter writes it on every ReduceMean, e.g. a global average pool).

    With ``axes`` given, or at its default 0, the attribute changes nothing. A node with ``noop_with_empty_axes=1``
    and no axes is the identity (ONNX spec) and becomes an Identity node. Returns the number of nodes changed.
    """
    if opset >= 18:
        return 0
    changed = 0
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in _REDUCE_18:
            continue
        noop = next((a for a in node.attribute if a.name == "noop_with_empty_axes"), None)
        if noop is None:
            continue
        axes = next((a for a in node.attribute if a.name == "axes"), None)
        if noop.i and (axes is None or not axes.ints) and len(node.input) < 2:
            node.op_type = "Identity"
            del node.attribute[:]
        else:
            node.attribute.remove(noop)
        changed += 1
    return changed


def convert_for_target(model: onnx.ModelProto, target: Target) -> onnx.ModelProto:
    """Return ``model`` at an opset within ``target.opset`` (unchanged opset when already inside) and the lowest
    IR version that opset allows, so an older parser (TensorRT 8.5 ships ONNX 1.12, IR 8) can read it.

    Args:
        model: an ONNX model (not modified).
        target: the profile; ``target.opset = {"min": 13, "max": 17}``.
    Returns:
        a new ModelProto, checked with ``onnx.checker``.
    Raises:
        TargetError: the model needs INT4 (opset ≥ 21) and the target reads less; a TensorRT target and the model
            holds non-standard ops (ORT contrib ops such as MatMulNBits, which TensorRT cannot parse); or the
            version converter cannot move an op to the wanted opset.
    """
    lo, hi = int(target.opset["min"]), int(target.opset["max"])
    current = model_opset(model)
    backend = "TensorRT " + str(target.tensorrt.get("version")) if target.backend == "tensorrt" else "ONNX Runtime"
    if uses_int4(model) and hi < INT4_OPSET:
        raise TargetError(
            f"the model uses INT4 block DequantizeLinear (opset {INT4_OPSET}), but {target.name}'s {backend} "
            f"reads opset ≤ {hi}",
            f"build int8 or fp16 for {target.name} (--precision int8, or --fallback)")
    if target.backend == "tensorrt":
        foreign = custom_ops(model)
        if foreign:
            raise TargetError(f"the model holds {foreign[0]} ({len(foreign)} non-standard op type(s)), which "
                              f"TensorRT's ONNX parser cannot read",
                              "write standard Q/DQ (DequantizeLinear + MatMul) instead of ONNX Runtime contrib ops")
    want = min(max(current, lo), hi)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if want != current:
        if want < 20:
            lower_gelu(out)  # Gelu has no version before 20: the converter cannot move it down
        try:
            out = version_converter.convert_version(out, want)
        except Exception as e:  # the converter raises RuntimeError / ConvertError with multi-line text
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise TargetError(f"cannot convert the model from opset {current} to {want} for {target.name}: {first}",
                              f"{target.name} reads opset {lo}–{hi}; re-export the model at an opset in that range"
                              ) from None
        drop_reduce_noop_attribute(out, want)
    trt = target.trt_version if target.backend == "tensorrt" else None
    if trt is not None and trt < (8, 6):  # no LayerNormalization importer before TensorRT 8.6 (lower_layernorm)
        lower_layernorm(out, want)
    ids = [helper.make_opsetid(op.domain, op.version) for op in out.opset_import]
    out.ir_version = helper.find_min_ir_version_for(ids, ignore_unknown=True)
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as e:
        first = (str(e).strip().splitlines() or ["invalid"])[0][:200]
        raise TargetError(f"the model is not valid at opset {want} / IR {out.ir_version}: {first}",
                          "re-export the model at an opset the target reads") from None
    return out


def upgrade_opset(model, opset: int = 21):  # type: ignore[no-untyped-def]
    """Convert ``model`` to ``opset`` with onnx.version_converter and raise the IR version to at least 10.

    version_converter leaves IR version 8, which ORT rejects for opset 21 models.
    """
    converted = version_converter.convert_version(model, opset)
    converted.ir_version = max(converted.ir_version, 10)
    onnx.checker.check_model(converted)
    return converted
