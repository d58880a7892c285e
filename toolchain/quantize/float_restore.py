"""Put a float initializer back into a Q/DQ graph without defining any tensor name twice."""
from __future__ import annotations

import onnx


def restore_float_initializer(model: onnx.ModelProto, tensor: onnx.TensorProto, have: set[str]) -> str:
    """Add ``tensor`` (a float weight or bias of the model that was quantized) to ``model``'s initializers unless it
    is there already, and return the name a node input should use.

    The quantizer may keep the float name for a node output (e.g. a bias ``b2`` becomes ``b2_quantized`` →
    DequantizeLinear → ``b2``). Adding the float ``b2`` as an initializer then defines ``b2`` twice (ONNX Runtime:
    "Duplicate definition of name"), so in that case the copy gets a fresh name (``b2_float``). ``have`` is the set
    of initializer names of ``model``; it is updated.
    """
    graph = model.graph
    defined = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    name = tensor.name
    if name not in defined:
        if name not in have:
            graph.initializer.append(tensor)
            have.add(name)
        return name
    taken = defined | have | {i for n in graph.node for i in n.input}
    fresh, k = f"{name}_float", 1
    while fresh in taken and fresh not in have:
        fresh, k = f"{name}_float_{k}", k + 1
    if fresh not in have:
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.name = fresh
        graph.initializer.append(copy)
        have.add(fresh)
    return fresh
