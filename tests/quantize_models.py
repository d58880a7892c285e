"""Tiny real ONNX models and calibration data for the quantization tests (built with onnx.helper, run by ORT)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def mlp(k: int = 64, hidden: int = 96, n: int = 32, *, seed: int = 0, gemm_trans_b: bool = False,
        opset: int = 17) -> onnx.ModelProto:
    """x[B, S, k] → LayerNorm → MatMul(k×hidden) + b → Relu → {MatMul(hidden×n), MatMul(hidden×n)} → Add → y.

    The two last layers share their input (one AWQ scale group). With ``gemm_trans_b`` the input is 2-D
    ``[B, k]`` and the first layer is a ``Gemm`` with a ``[hidden, k]`` weight and transB=1.
    """
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((k, hidden)) / np.sqrt(k)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32)
    w3 = (rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32)
    inits = [numpy_helper.from_array(np.ones(k, np.float32), "ln_scale"),
             numpy_helper.from_array(np.zeros(k, np.float32), "ln_bias"),
             numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(w3, "w3")]
    nodes = [helper.make_node("LayerNormalization", ["x", "ln_scale", "ln_bias"], ["h0"], name="ln", axis=-1)]
    if gemm_trans_b:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w1.T), "w1"))
        nodes.append(helper.make_node("Gemm", ["h0", "w1", "b1"], ["h1b"], name="fc1", transB=1))
        shape = ["B", k]
    else:
        inits.append(numpy_helper.from_array(w1, "w1"))
        nodes += [helper.make_node("MatMul", ["h0", "w1"], ["h1"], name="fc1"),
                  helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1_bias")]
        shape = ["B", "S", k]
    nodes += [helper.make_node("Relu", ["h1b"], ["h2"], name="relu"),
              helper.make_node("MatMul", ["h2", "w2"], ["y2"], name="fc2"),
              helper.make_node("MatMul", ["h2", "w3"], ["y3"], name="fc3"),
              helper.make_node("Add", ["y2", "y3"], ["y"], name="sum")]
    out_shape = shape[:-1] + [n]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def inputs(n_batches: int = 4, batch: int = 8, seq: int = 6, k: int = 64, *, seed: int = 1,
           outliers: bool = True, two_d: bool = False) -> list[dict[str, np.ndarray]]:
    """Batches ``{"x": float32 [batch, seq, k]}`` (or ``[batch, k]``); a few channels carry large values, as the
    salient channels of transformer activations do."""
    rng = np.random.default_rng(seed)
    scale = np.ones(k, np.float32)
    if outliers:
        scale[rng.choice(k, 3, replace=False)] = 12.0
    shape = (batch, k) if two_d else (batch, seq, k)
    return [{"x": (rng.standard_normal(shape) * scale).astype(np.float32)} for _ in range(n_batches)]


def run(model: onnx.ModelProto, batch: dict[str, np.ndarray], *, exact_int4: bool = False) -> np.ndarray:
    """Output 0 of ``model`` on ``batch`` (ORT CPU). ``exact_int4``: ORT fuses DQ(INT4)+MatMul into MatMulNBits,
    which by default (accuracy level 4) also quantizes the activations to INT8; level 1 keeps them float."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if exact_int4:
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, batch)[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
