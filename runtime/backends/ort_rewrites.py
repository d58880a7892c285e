"""Load-time graph rewrites for ONNX Runtime, applied in memory (the bundle's files stay the standard Q/DQ form).

ORT does not constant-fold DequantizeLinear, so a 4-bit embedding table written as DequantizeLinear → Gather would
be dequantized whole on every run (30522 × 384 values for MiniLM). ORT's contrib op ``GatherBlockQuantized``
(com.microsoft) gathers the 4-bit rows first and dequantizes only those; this pass swaps the pattern for it.
"""
from __future__ import annotations

from typing import Any


def gather_block_quantized(model: Any) -> int:
    """Rewrite ``DequantizeLinear(int4/uint4 initializer, axis=1, block_size) → Gather(axis=0)`` in place.

    Returns the number of rewritten Gathers. Tables whose DequantizeLinear output feeds anything but Gathers (tied
    weights) are left alone, and so are tables a Gather reads with indices that are not a graph input (through
    value-keeping ops: ``token_bounds.traced_input``): ``GatherBlockQuantized`` does not check its indices (an id
    past the table gives finite numbers where ``Gather`` fails), so the session checks them at its input instead,
    which it can only do for ids that are an input (ids + per-field offsets into one shared table are not).
    """
    from onnx import TensorProto, helper

    from ..token_bounds import traced_input

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}
    rewritten = 0
    for dq in list(g.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        data = inits[dq.input[0]]
        if data.data_type not in (TensorProto.INT4, TensorProto.UINT4) or len(data.dims) != 2:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        users = consumers.get(dq.output[0], [])
        if (attrs.get("axis") != 1 or not attrs.get("block_size") or dq.output[0] in outputs or not users
                or any(u.op_type != "Gather" or u.input[0] != dq.output[0] for u in users)
                or any(traced_input(g, u.input[1]) is None for u in users)):
            continue
        for u in users:
            gattrs = {a.name: helper.get_attribute_value(a) for a in u.attribute}
            if gattrs.get("axis", 0) != 0:
                break
        else:
            for u in users:
                inputs = [dq.input[0], u.input[1], dq.input[1]] + ([dq.input[2]] if len(dq.input) > 2 else [])
                new = helper.make_node("GatherBlockQuantized", inputs, list(u.output), name=u.name + "_gbq",
                                       domain="com.microsoft", gather_axis=0, quantize_axis=1,
                                       block_size=int(attrs["block_size"]), bits=4)
                g.node.insert(list(g.node).index(u), new)
                g.node.remove(u)
                rewritten += 1
            g.node.remove(dq)
    if rewritten and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return rewritten


def int4_block_sizes(model: Any) -> set[int]:
    """The ``block_size`` of every DequantizeLinear of an INT4/UINT4 initializer (0 for one without blocks)."""
    from onnx import TensorProto, helper

    four = {t.name for t in model.graph.initializer if t.data_type in (TensorProto.INT4, TensorProto.UINT4)}
    return {next((helper.get_attribute_value(a) for a in n.attribute if a.name == "block_size"), 0)
            for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input and n.input[0] in four}


def int4_blocks_over(model: Any, size: int) -> bool:
    """True when a DequantizeLinear of an INT4/UINT4 initializer has a ``block_size`` over ``size``."""
    return any(b > size for b in int4_block_sizes(model))
