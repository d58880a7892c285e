"""Run a BF16 model on a host whose ONNX Runtime has no BF16 kernels: its FP32 emulation.

ORT's CPU provider casts to and from BFLOAT16 but computes almost nothing in it (``Add``, ``MatMul`` and ``Gemm``
are NOT_IMPLEMENTED), so a BF16 variant could never be validated, timed or given golden outputs at build time. The
build runs its *host twin* instead: the same graph with every BF16 tensor made FP32, its values unchanged (BF16
weights are exact in FP32), and every ``Cast`` to BF16 followed by a ``Cast`` back to FP32, so what the BF16 model
rounds at its casts (graph inputs, FP32 islands' outputs) is rounded the same way. Arithmetic between casts runs in
FP32, as TensorRT's BF16 GEMMs accumulate; intermediate elementwise results are not rounded to BF16, so the twin's
error is a lower bound of the engine's (the report says the variant was emulated).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

_BF16 = TensorProto.BFLOAT16
_FLOAT = TensorProto.FLOAT


def has_bf16(model: onnx.ModelProto) -> bool:
    """Whether ``model``'s main graph computes in BF16: a BF16 initializer or value type, or a Cast to BF16 whose
    result goes anywhere but straight back to FP32 (the rounding a host twin keeps)."""
    g = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}

    def computes(cast: onnx.NodeProto) -> bool:
        uses = consumers.get(cast.output[0], [])
        return cast.output[0] in outputs or any(u.op_type != "Cast" or _cast_to(u) != _FLOAT for u in uses)

    return (any(t.data_type == _BF16 for t in g.initializer)
            or any(v.type.tensor_type.elem_type == _BF16 for v in [*g.input, *g.output, *g.value_info])
            or any(n.op_type == "Cast" and _cast_to(n) == _BF16 and computes(n) for n in g.node))


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _to_float(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def host_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """The FP32 emulation of BF16 ``model`` (module doc); a model without BF16 comes back unchanged (a copy)."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    g = twin.graph
    for i, t in enumerate(g.initializer):
        if t.data_type == _BF16:
            g.initializer[i].CopyFrom(_to_float(t))
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == _BF16:
            v.type.tensor_type.elem_type = _FLOAT
    nodes = []
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == _BF16:  # Constant, ConstantOfShape
                a.t.CopyFrom(_to_float(a.t))
        if n.op_type == "Cast" and _cast_to(n) == _BF16:
            rounded = n.output[0] + "__bf16"
            back = onnx.helper.make_node("Cast", [rounded], [n.output[0]], to=_FLOAT,
                                         name=(n.name or rounded) + "__to_fp32")
            n.output[0] = rounded
            nodes += [n, back]
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return twin


@contextlib.contextmanager
def host_model_file(path: str | os.PathLike) -> Iterator[Path]:
    """``path``, or for a model with BF16 in it a temporary file holding its host twin, removed on exit (open the
    ONNX Runtime session inside the block: it reads the whole file when it is created)."""
    path = Path(path)
    if not has_bf16(onnx.load(os.fspath(path), load_external_data=False)):
        yield path
        return
    fd, tmp = tempfile.mkstemp(prefix="dsedge-bf16-host-", suffix=".onnx")
    os.close(fd)
    try:
        onnx.save(host_twin(onnx.load(os.fspath(path))), tmp)
        yield Path(tmp)
    finally:
        os.unlink(tmp)
