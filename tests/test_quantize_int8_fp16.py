"""INT8 W8A8 (static Q/DQ via ORT's quantizer, dynamic) and FP16/BF16 with FP32 islands, on tiny real ONNX models."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.errors import CalibrationError, QuantizationError
from dsedge.toolchain.quantize.fp16 import convert_float16
from dsedge.toolchain.quantize.int8 import pad_to_common_shape, quantize_int8_dynamic, quantize_int8_static

from quantize_models import cosine, inputs, mlp, run


@pytest.fixture(scope="module")
def tiny():
    return mlp(), inputs(outliers=False)


def _dq_of(model, node_name):
    producers = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == node_name)
    return [producers.get(i) for i in node.input[:2]]


def test_static_w8a8_is_per_channel_weights_per_tensor_activations(tiny):
    model, calib = tiny
    q, report = quantize_int8_static(model, calib, method="minmax")
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    act_dq, w_dq = _dq_of(q, "fc2")
    assert act_dq.op_type == w_dq.op_type == "DequantizeLinear"
    assert inits[w_dq.input[0]].dtype == np.int8 and inits[w_dq.input[1]].shape == (32,)   # one scale per column
    assert inits[act_dq.input[1]].shape == ()                                             # per-tensor
    assert inits[act_dq.input[2]].dtype == np.int8 and int(inits[act_dq.input[2]]) == 0     # symmetric (TensorRT)
    assert report["quantize_linear"] >= 3 and report["calibration_batches"] == 4
    assert cosine(run(model, calib[0]), run(q, calib[0])) > 0.995


def test_static_calibration_methods_and_ragged_batches(tiny):
    model, calib = tiny
    ragged = [{"x": c["x"][:, : 3 + i]} for i, c in enumerate(calib)]          # different sequence lengths
    padded = pad_to_common_shape(ragged)
    assert {b["x"].shape for b in padded} == {(8, 6, 64)} and np.all(padded[0]["x"][:, 3:] == 0)
    for method in ("entropy", "percentile"):
        q, report = quantize_int8_static(model, ragged, method=method, symmetric_activations=False)
        assert report["method"] == method
        assert cosine(run(model, calib[0]), run(q, calib[0])) > 0.99


def test_static_calibration_from_npz_files_and_errors(tiny, tmp_path):
    model, calib = tiny
    for i, b in enumerate(calib):
        np.savez(tmp_path / f"batch{i}.npz", **b)
    q, report = quantize_int8_static(model, tmp_path)
    assert report["calibration_batches"] == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="holds no .npz"):
        quantize_int8_static(model, tmp_path / "empty")
    with pytest.raises(CalibrationError, match="empty"):
        quantize_int8_static(model, iter([]))
    with pytest.raises(CalibrationError, match="does not exist"):
        quantize_int8_static(model, tmp_path / "missing")
    with pytest.raises(QuantizationError, match="unknown calibration method"):
        quantize_int8_static(model, calib, method="mse")


def test_dynamic_int8_runs_integer_matmuls(tiny):
    model, calib = tiny
    q, report = quantize_int8_dynamic(model, fuse=None)
    assert report["ops"].get("MatMulInteger", 0) + report["ops"].get("DynamicQuantizeMatMul", 0) >= 3
    assert cosine(run(model, calib[0]), run(q, calib[0])) > 0.995


def _softmax_model() -> onnx.ModelProto:
    """x → MatMul → LayerNorm → Softmax → ReduceSum → y, with values that overflow fp16 inside LayerNorm."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) * 30).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], name="ln", axis=-1),
             helper.make_node("Softmax", ["n"], ["s"], name="sm", axis=-1),
             helper.make_node("Mul", ["s", "h"], ["p"], name="mul"),
             helper.make_node("ReduceSum", ["p", "axes"], ["y"], name="sum", keepdims=0)]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(16, np.float32), "g"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    g = helper.make_graph(nodes, "sm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B"])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def test_fp16_keeps_islands_in_fp32_and_the_io_contract():
    model = _softmax_model()
    x = {"x": (np.random.default_rng(1).standard_normal((4, 16)) * 20).astype(np.float32)}
    q, report = convert_float16(model)
    onnx.checker.check_model(q)
    assert report["fp32_nodes"] == ["ln", "sm", "sum"]
    assert report["fp32_initializers"] == ["b", "g"]                    # LayerNorm gamma/beta stay fp32
    inits = {t.name: t.data_type for t in q.graph.initializer}
    assert inits["w"] == TensorProto.FLOAT16 and inits["g"] == TensorProto.FLOAT
    assert q.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert q.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    nodes = {n.name: n for n in q.graph.node}
    assert nodes["mm"].input[0] == "x_fp16"
    ref, got = run(model, x), run(q, x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def _l2_normalize_model() -> onnx.ModelProto:
    """y = h / sqrt(sum(h^2)) with h = x @ w: the sum of squares exceeds 65504 for activations of a few hundred."""
    w = (np.random.default_rng(2).standard_normal((16, 16)) * 30).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Pow", ["h", "two"], ["sq"], name="pow"),
             helper.make_node("ReduceSum", ["sq", "axes"], ["ss"], name="sum", keepdims=1),
             helper.make_node("Sqrt", ["ss"], ["norm"], name="sqrt"),
             helper.make_node("Div", ["h", "norm"], ["y"], name="div")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    g = helper.make_graph(nodes, "l2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def test_fp32_islands_prevent_fp16_overflow_in_l2_normalize():
    model = _l2_normalize_model()
    x = {"x": (np.random.default_rng(3).standard_normal((4, 16)) * 10).astype(np.float32)}
    ref = run(model, x)
    q, report = convert_float16(model)
    assert report["fp32_nodes"] == ["pow", "sqrt", "sum"]
    np.testing.assert_allclose(run(q, x), ref, atol=2e-3)
    h = x["x"] @ numpy_helper.to_array(model.graph.initializer[0])
    assert not np.isfinite((h.astype(np.float16) ** 2).sum(-1)).all()    # in fp16 the sum of squares overflows
    # the island chain Pow → ReduceSum → Sqrt stays fp32 end to end: one Cast in, one Cast out
    casts = [n for n in q.graph.node if n.op_type == "Cast"]
    assert [c.name for c in casts if c.input[0].startswith(("sq", "ss"))] == []
    assert report["casts_inserted"] == 4          # x → fp16, h → fp32 for pow, norm → fp16, y → fp32


def test_bf16_and_bad_precision():
    model = _softmax_model()
    q, report = convert_float16(model, dtype="bf16", keep_fp32_nodes=["mul"])
    onnx.checker.check_model(q)
    assert {t.name: t.data_type for t in q.graph.initializer}["w"] == TensorProto.BFLOAT16
    assert "mul" in report["fp32_nodes"]
    with pytest.raises(QuantizationError, match="unknown float precision"):
        convert_float16(model, dtype="fp8")


def test_a_bf16_model_runs_on_the_host_as_its_fp32_emulation(tiny, tmp_path):
    """ORT CPU has no BF16 Add/MatMul/Gemm kernels, so every bf16 build failed validation (a user's pass): the build
    runs the model's twin with BF16 tensors made FP32 and BF16 rounding kept at its casts."""
    import ml_dtypes
    import onnxruntime as ort

    from dsedge.toolchain.evaluate import host_backend
    from dsedge.toolchain.quantize.bf16_host import has_bf16, host_model_file, host_twin

    model, batches = tiny
    batch = batches[0]
    q, _ = convert_float16(model, dtype="bf16")
    path = tmp_path / "bf16.onnx"
    onnx.save(q, str(path))
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    twin = host_twin(q)
    assert has_bf16(q) and not has_bf16(twin) and not has_bf16(host_twin(model))
    # what the twin computes: the fp32 model with its weights and its input rounded to BF16, in FP32
    rounded = onnx.ModelProto()
    rounded.CopyFrom(model)
    for i, t in enumerate(rounded.graph.initializer):
        a = numpy_helper.to_array(t)
        rounded.graph.initializer[i].CopyFrom(numpy_helper.from_array(
            a.astype(ml_dtypes.bfloat16).astype(np.float32) if a.ndim >= 2 else a, t.name))
    name = model.graph.input[0].name
    want = run(rounded, {name: batch[name].astype(ml_dtypes.bfloat16).astype(np.float32)})
    got = host_backend(path).run(batch)
    out = next(iter(got.values()))
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)  # the twin also rounds at its FP32 islands
    fp32 = run(model, batch)
    assert 0 < np.abs(out - fp32).max() and cosine(out, fp32) > 0.999
    with host_model_file(path) as p:
        made = p
        assert p != path and p.exists()
    assert not made.exists()  # the temporary twin is gone


def test_smooth_quant_keeps_the_function_and_helps_w8a8_with_outlier_channels():
    from dsedge.toolchain.quantize.int8 import smooth_quant

    model, calib = mlp(seed=4), inputs(seed=2, outliers=False)
    for b in calib:                       # strong outlier channels in the LayerNorm output feeding fc1
        b["x"][..., [5, 9]] *= 60.0
    ln_scale = next(t for t in model.graph.initializer if t.name == "ln_scale")
    g = np.ones(64, np.float32)
    g[[5, 9]] = 40.0
    ln_scale.CopyFrom(numpy_helper.from_array(g, "ln_scale"))
    smoothed, rep = smooth_quant(model, calib)
    assert {tuple(gr["layers"]) for gr in rep["groups"]} == {("fc1",), ("fc2", "fc3")}
    assert sum(n.op_type == "Mul" for n in smoothed.graph.node) == 2
    np.testing.assert_allclose(run(smoothed, calib[0]), run(model, calib[0]), rtol=1e-4, atol=1e-4)
    plain, _ = quantize_int8_static(model, calib)
    smooth, report = quantize_int8_static(model, calib, smooth_alpha=0.5)
    assert report["smooth_quant"]["alpha"] == 0.5
    ref = run(model, calib[1])
    assert 1 - cosine(ref, run(smooth, calib[1])) < 0.7 * (1 - cosine(ref, run(plain, calib[1])))
