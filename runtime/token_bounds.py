"""Valid ranges of integer inputs read from the graph itself: an id that indexes an embedding table must be below
the table's size.

A model from an ONNX file carries no tokenizer or config, so nothing says how large its vocabulary is. The graph
does: an integer graph input that reaches the indices of a ``Gather`` over a constant table (an initializer, or a
DequantizeLinear/Cast of one, as quantized embeddings are) through shape-only ops can hold only ``0 … n-1`` where
``n`` is the table's size along the gathered axis (ONNX also allows negative indices; a token id never is).
Out-of-range ids make ORT's fp32 Gather fail and a block-quantized Gather return finite garbage.
"""
from __future__ import annotations

from typing import Any

_PASS_THROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand"}
_TABLE_OPS = {"DequantizeLinear", "Cast", "Identity"}
_INT_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}   # onnx TensorProto uint8/int8/uint16/int16/int32/int64/uint32/uint64


def graph_value_ranges(model: Any) -> dict[str, tuple[int, int]]:
    """``{input name: (0, n - 1)}`` for every integer graph input of ``model`` (an ``onnx.ModelProto``) that indexes
    constant tables; ``n`` is the smallest such table's size. Inputs that index nothing are absent."""
    graph = model.graph
    inits = {t.name: list(t.dims) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def table_shape(name: str, depth: int = 0) -> list[int] | None:
        if name in inits:
            return inits[name]
        node = producers.get(name)
        if node is None or depth > 4 or node.op_type not in _TABLE_OPS:
            return None
        return table_shape(node.input[0], depth + 1)

    out: dict[str, tuple[int, int]] = {}
    for vi in graph.input:
        if vi.name in inits or vi.type.tensor_type.elem_type not in _INT_TYPES:
            continue
        sizes = []
        frontier, seen = [vi.name], set()
        while frontier:
            t = frontier.pop()
            if t in seen:
                continue
            seen.add(t)
            for node in consumers.get(t, []):
                if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == t:
                    shape = table_shape(node.input[0])
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    if shape and -len(shape) <= axis < len(shape) and shape[axis] > 0:
                        sizes.append(int(shape[axis]))
                elif node.op_type in _PASS_THROUGH and node.input[0] == t:
                    frontier.extend(node.output)
        if sizes:
            out[vi.name] = (0, min(sizes) - 1)
    return out


def traced_input(graph: Any, tensor: str) -> str | None:
    """The graph input that ``tensor`` of ``graph`` is, reached back through value-keeping ops only (Cast, Reshape,
    Unsqueeze, …: what :func:`graph_value_ranges` follows forward), or None (computed from several tensors, sliced,
    offset, …): only then does a check of that input's values bound ``tensor``'s."""
    producers = {o: n for n in graph.node for o in n.output}
    inputs = {vi.name for vi in graph.input} - {t.name for t in graph.initializer}
    for _ in range(64):
        if tensor in inputs:
            return tensor
        node = producers.get(tensor)
        if node is None or node.op_type not in _PASS_THROUGH or not node.input:
            return None
        tensor = node.input[0]
    return None


def graph_token_bounds(model: Any) -> dict[str, Any]:
    """``{"value_ranges": graph_value_ranges(model), "vocab_size": n}`` for a ``Source``: ``vocab_size`` is the
    bound of an input named like token ids (``input_ids``/``ids``), else of the only bounded input, else None."""
    ranges = graph_value_ranges(model)
    named = [n for n in ranges if n.lower() in ("input_ids", "ids", "tokens", "token_ids")]
    pick = named[0] if named else (next(iter(ranges)) if len(ranges) == 1 else None)
    return {"value_ranges": ranges, "vocab_size": ranges[pick][1] + 1 if pick else None}
