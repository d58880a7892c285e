"""W8A8 Q/DQ placement (inputs of weighted layers only) and INT8 under an accuracy gate, on tiny real ONNX models."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from dsedge.runtime.errors import AccuracyGateError, ConfigError
from dsedge.toolchain.quantize.int8 import quantize_int8_static
from dsedge.toolchain.quantize.int8_gate import keep_float, quantize_int8_gated

from quantize_models import cosine, inputs, mlp, run


def outlier_mlp(factor: float = 100.0):
    """``mlp`` whose ReLU output (the input of fc2/fc3) has two channels ``factor`` times larger than the rest, as
    the GELU output feeding a transformer's FFN down-projection has; the float function barely changes."""
    m = mlp(seed=4)
    for t in m.graph.initializer:
        a = numpy_helper.to_array(t).copy()
        if t.name == "w1":
            a[:, :2] *= factor
        if t.name in ("w2", "w3"):
            a[:2, :] /= factor
        if t.name == "b1":
            a[:2] = np.abs(a[:2]) * factor
        t.CopyFrom(numpy_helper.from_array(a, t.name))
    return m


@pytest.fixture(scope="module")
def data():
    return inputs(seed=2, outliers=False), inputs(seed=7, outliers=False)


def _dq_inputs(model, name):
    prod = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == name)
    return [prod[i].op_type if i in prod else "float" for i in node.input]


def test_qdq_only_on_inputs_of_weighted_layers(data):
    calib, _ = data
    q, _ = quantize_int8_static(mlp(seed=4), calib)
    quantized = {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"}
    assert not quantized & {"h1", "y2", "y3", "y"}           # no Q/DQ on the outputs of fc1/fc2/fc3 or the sum
    assert _dq_inputs(q, "fc2")[:2] == ["DequantizeLinear", "DequantizeLinear"]
    assert _dq_inputs(q, "sum") == ["MatMul", "MatMul"]       # the Add reads the float MatMul outputs


def test_keep_float_restores_float_inputs_and_drops_dead_qdq(data):
    calib, held = data
    model = outlier_mlp()
    q, _ = quantize_int8_static(model, calib)
    f = keep_float(q, model, ["fc2"])
    assert _dq_inputs(f, "fc2") == ["Relu", "float"]          # float activation, float weight initializer
    assert _dq_inputs(f, "fc3")[:2] == ["DequantizeLinear", "DequantizeLinear"]
    w2 = next(t for t in f.graph.initializer if t.name == "w2")
    np.testing.assert_array_equal(numpy_helper.to_array(w2),
                                  numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w2")))
    all_float = keep_float(q, model, ["fc1", "fc2", "fc3"])
    assert not any(n.op_type.endswith("QuantizeLinear") for n in all_float.graph.node)
    np.testing.assert_allclose(run(all_float, held[0]), run(model, held[0]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="no quantized layer"):
        keep_float(q, model, ["nope"])


def test_gate_keeps_the_outlier_layers_float_until_it_passes(data):
    calib, held = data
    model = outlier_mlp()
    q, rep = quantize_int8_gated(model, calib, gate="cosine:0.995", heldout=held, smooth_alpha=None)
    assert rep["values_all_int8"]["cosine"] < 0.95                 # per-tensor INT8 of the outlier input fails
    assert rep["values"]["cosine"] >= 0.995 and rep["passed"]
    assert {k["node"] for k in rep["kept_float"]} == {"fc2", "fc3"}  # the two layers reading the outliers
    assert rep["sensitivity"]["fc2"] > rep["sensitivity"]["fc1"]
    assert rep["int8_layers"] == 1 and _dq_inputs(q, "fc1")[:2] == ["DequantizeLinear", "DequantizeLinear"]
    got = np.mean([cosine(run(model, h), run(q, h)) for h in held])
    assert got == pytest.approx(rep["values"]["cosine"], abs=0.01)


def test_gate_passing_at_int8_keeps_everything_int8_and_bad_gates_fail_clearly(data):
    calib, held = data
    q, rep = quantize_int8_gated(mlp(seed=4), calib, gate="cosine:0.99", heldout=held, smooth_alpha=None)
    assert rep["kept_float"] == [] and rep["int8_layers"] == 3 and rep["values"]["cosine"] > 0.99
    with pytest.raises(AccuracyGateError, match="cannot be met: best cosine = 0.50000 with every layer in float"):
        quantize_int8_gated(outlier_mlp(), calib, gate="cosine:0.9", metric=lambda m: 0.5, smooth_alpha=None)
    with pytest.raises(ConfigError, match="needs held-out data"):
        quantize_int8_gated(mlp(seed=4), calib, gate="cosine:0.99")


@pytest.mark.parametrize("spec, words", [("cosine:1.5", "cosine lies in \\[-1, 1\\]"),
                                         ("top1:2", "top1 lies in \\[0, 1\\]"), ("cosine", "METRIC:THRESHOLD")])
def test_gate_specs_out_of_range_fail_before_any_work(spec, words):
    from dsedge.toolchain.gates import build_gates

    with pytest.raises(ConfigError, match=words):
        build_gates(spec)
    with pytest.raises(ConfigError, match="cannot measure 'auc-drop'"):
        build_gates("auc-drop:0.003")
    assert [str(g) for g in build_gates("cosine:0.99,top1:0.9")] == ["cosine:0.99", "top1:0.9"]


def test_build_enforces_the_gate_on_precisions_without_a_gated_search(tmp_path):
    """Dynamic INT8 (cpu) has no per-layer search: the gate is checked on the shipped variant, and a miss is an
    AccuracyGateError with nothing written."""
    from dsedge.toolchain.pipeline import BuildOptions, build

    from tiny_models import mlp_onnx

    model = str(mlp_onnx(tmp_path / "m.onnx"))
    out = tmp_path / "o"
    r = build(BuildOptions(model=model, target="cpu", precision="int8", out_dir=str(out), accuracy_gate="cosine:0.9",
                           latency_iterations=2))
    assert r.report["variants"][0]["accuracy"]["cosine_mean"] >= 0.9
    with pytest.raises(AccuracyGateError, match="not met by the int8 variant: cosine = 0.9"):
        build(BuildOptions(model=model, target="cpu", precision="int8", out_dir=str(tmp_path / "o2"),
                           accuracy_gate="cosine:0.999999", latency_iterations=2))
    assert not list((tmp_path / "o2").glob("*.dse"))


def test_ragged_npz_files_pad_token_inputs_and_refuse_float_ones(tmp_path):
    from dsedge.runtime.bundle import IOSpec
    from dsedge.runtime.errors import CalibrationError
    from dsedge.toolchain.npz_inputs import read_npz_dir

    specs = [IOSpec("input_ids", "int64", ("batch", "sequence")), IOSpec("x", "float32", ("batch", "n"))]
    for i, n in enumerate((3, 5)):
        np.savez(tmp_path / f"{i}.npz", input_ids=np.ones((1, n), np.int64), x=np.ones((1, 4), np.float32))
    data = read_npz_dir(tmp_path, specs)
    assert data["input_ids"].shape == (2, 5) and data["input_ids"][0].tolist() == [1, 1, 1, 0, 0]
    np.savez(tmp_path / "2.npz", input_ids=np.ones((1, 2), np.int64), x=np.ones((1, 6), np.float32))
    with pytest.raises(CalibrationError, match="input 'x' has different shapes across files"):
        read_npz_dir(tmp_path, specs)


def test_static_int8_names_the_layer_with_nan_weights(data):
    from dsedge.runtime.errors import QuantizationError

    calib, _ = data
    m = mlp(seed=4)
    w2 = next(t for t in m.graph.initializer if t.name == "w2")
    a = numpy_helper.to_array(w2).copy()
    a[0, 0] = np.nan
    w2.CopyFrom(numpy_helper.from_array(a, "w2"))
    with pytest.raises(QuantizationError, match="'w2' \\(read by 'fc2'\\) holds 1 NaN/Inf"):
        quantize_int8_static(m, calib)


def test_build_log_summarises_what_a_gate_kept_higher():
    from dsedge.toolchain.gates import gate_summary

    assert gate_summary({"kept_float": ["fc2"], "layers": [{"node": "fc2"}]}) == ""       # INT4 without a gate
    assert gate_summary({"gate": "cosine:0.99", "kept_float": [{}] * 3, "layers": 36, "int8_layers": 33,
                         "values": {"cosine": 0.99521}}) == " (gate cosine:0.99: 3 of 36 layers kept float, cosine 0.9952)"
    assert gate_summary({"gate": "cosine:0.99", "raised": [{}, {}], "values": {"cosine": 0.9907}}) == \
        " (gate cosine:0.99: 2 layer raises, cosine 0.9907)"
