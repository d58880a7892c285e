"""A tiny ONNX model with a rank-0 (scalar) input FIRST, and ``.npz`` directories of its inputs, for the tests of
scalar inputs and outputs (tests/test_npz_scalar_inputs.py, tests/test_scalar_io_gaps.py).

y = (x @ W) / temperature, x float32 [batch, 4], temperature float32 [] (rank 0); total = ReduceSum(y) (keepdims=0,
rank 0). Rows are counted from the first batched input, not from the first input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.bundle import IOSpec

W = (np.random.default_rng(0).standard_normal((4, 4)) / 2).astype(np.float32)
SPECS = [IOSpec("temperature", "float32", ()), IOSpec("x", "float32", ("batch", 4))]


def scalar_model(path: Path, outputs: tuple[str, ...] = ("y",)) -> Path:
    """Save the model with ``outputs`` (names among "y" and "total", in that order) at ``path``."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Div", ["h", "temperature"], ["y"], name="div")]
    if "total" in outputs:
        nodes.append(helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0, name="sum"))
    info = {"y": helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            "total": helper.make_tensor_value_info("total", TensorProto.FLOAT, [])}
    g = helper.make_graph(nodes, "scalar_temperature",
                          [helper.make_tensor_value_info("temperature", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [info[o] for o in outputs], [numpy_helper.from_array(W, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def npz_dir(d: Path, rows: tuple[int, ...], temperatures: tuple[float, ...] | None = None, seed: int = 1) -> Path:
    """One ``.npz`` per entry of ``rows`` (x of that many rows, temperature 2.0 or ``temperatures[i]``) in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(rows):
        t = 2.0 if temperatures is None else temperatures[i]
        np.savez(d / f"{i}.npz", x=rng.standard_normal((n, 4)).astype(np.float32),
                 temperature=np.array(t, np.float32))
    return d


def stacked_x(d: Path) -> np.ndarray:
    """The x rows of every file of ``d``, in file order."""
    return np.concatenate([np.load(f)["x"] for f in sorted(d.glob("*.npz"))])
