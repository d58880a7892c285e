"""INT4 weight-only quantization: blockwise RTN, GPTQ, AWQ numerics and the Q/DQ ONNX they write (real ORT)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dsedge.runtime.errors import CalibrationError, QuantizationError
from dsedge.toolchain.quantize.awq import awq_search
from dsedge.toolchain.quantize.blockwise import quantize_blockwise
from dsedge.toolchain.quantize.gptq import gptq_quantize
from dsedge.toolchain.quantize.weight_only import quantize_weight_only

from quantize_models import cosine, inputs, mlp, run


def _correlated(rows: int, k: int, seed: int = 0) -> np.ndarray:
    # low-rank activations plus noise: strongly correlated input channels, as in real layers
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, k // 4)) @ rng.standard_normal((k // 4, k))
    return (z + 0.3 * rng.standard_normal((rows, k))).astype(np.float32)


def test_blockwise_codes_and_scales_have_the_dequantize_linear_layout():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 5)).astype(np.float32)          # K not a multiple of the block size
    sym = quantize_blockwise(w, block_size=32, clip_search=False)
    assert sym.codes.shape == (70, 5) and sym.scales.shape == (3, 5) and sym.zero_points is None
    assert sym.codes.min() >= -8 and sym.codes.max() <= 7
    # absmax scaling: every weight is within half a step of its dequantized value
    step = np.repeat(sym.scales, 32, axis=0)[:70]
    assert np.all(np.abs(sym.dequantize() - w) <= step / 2 + 1e-6)
    np.testing.assert_allclose(sym.scales[0], np.abs(w[:32]).max(axis=0) / 7, rtol=1e-6)
    asym = quantize_blockwise(w, block_size=32, symmetric=False, clip_search=False)
    assert asym.codes.min() >= 0 and asym.codes.max() <= 15 and asym.zero_points.shape == (3, 5)
    assert np.abs(asym.dequantize() - w).mean() < np.abs(sym.dequantize() - w).mean()


def test_clip_search_lowers_the_weight_error():
    w = np.random.default_rng(1).standard_t(3, size=(128, 16)).astype(np.float32)   # heavy tails
    plain = quantize_blockwise(w, block_size=32, clip_search=False)
    searched = quantize_blockwise(w, block_size=32, clip_search=True)
    assert ((searched.dequantize() - w) ** 2).sum() < 0.9 * ((plain.dequantize() - w) ** 2).sum()


def test_gptq_output_error_is_well_below_rtn():
    x = _correlated(512, 64)
    w = np.random.default_rng(2).standard_normal((64, 24)).astype(np.float32)
    rtn = quantize_blockwise(w, block_size=16, clip_search=True, importance=(x * x).mean(0))
    gq = gptq_quantize(w, x, block_size=16)
    err = lambda q: float(((x @ (q.dequantize() - w)) ** 2).mean())  # noqa: E731
    assert gq.codes.min() >= -8 and gq.codes.max() <= 7
    # GPTQ uses the static-group scales; its codes differ from rounding and halve the output error or better
    np.testing.assert_array_equal(gq.scales, quantize_blockwise(
        w, block_size=16, importance=np.diag(2 * x.T.astype(np.float64) @ x / len(x)) + 1e-8).scales)
    assert err(gq) < 0.6 * err(rtn)
    assert gptq_quantize(w, x, block_size=16, act_order=False).codes.shape == (64, 24)


def test_gptq_asymmetric_and_dead_channels():
    x = _correlated(256, 32)
    x[:, 5] = 0.0                                                 # a channel that never fires
    w = np.random.default_rng(3).standard_normal((32, 8)).astype(np.float32)
    gq = gptq_quantize(w, x, block_size=16, symmetric=False)
    assert gq.codes.min() >= 0 and gq.codes.max() <= 15 and gq.zero_points is not None
    assert float(((x @ (gq.dequantize() - w)) ** 2).mean()) < 0.05 * float(((x @ w) ** 2).mean())


def test_awq_scales_salient_channels_and_beats_rtn():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1024, 64)).astype(np.float32)
    x[:, [3, 17, 40]] *= 20.0                                      # salient input channels
    ws = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2)]
    r = awq_search(ws, x, block_size=32, clip_search=False)
    assert r.alpha > 0 and r.scale.shape == (64,)
    assert r.scale[[3, 17, 40]].min() > np.median(r.scale)        # protected channels are scaled up
    assert r.error_awq < 0.8 * r.error_rtn


@pytest.fixture(scope="module")
def tiny():
    return mlp(), inputs()


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq", "awq+gptq"])
def test_quantized_onnx_matches_its_dequantized_weights_in_ort(tiny, algorithm):
    model, calib = tiny
    q, report = quantize_weight_only(model, calib, algorithm=algorithm, block_size=16)
    assert q.ir_version >= 10 and q.opset_import[0].version == 21
    onnx.checker.check_model(q)
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 3 and all({a.name: a.i for a in n.attribute}["block_size"] == 16 for n in dqs)
    inits = {t.name: t for t in q.graph.initializer}
    assert all(inits[n.input[0]].data_type == onnx.TensorProto.INT4 for n in dqs)
    assert not {"w1", "w2", "w3"} & set(inits)                    # float weights are gone
    assert [lay["node"] for lay in report["layers"]] == ["fc1", "fc2", "fc3"]
    muls = [n for n in q.graph.node if n.op_type == "Mul"]
    assert (len(muls) >= 1) == algorithm.startswith("awq")
    ref, got = run(model, calib[0]), run(q, calib[0])
    assert cosine(ref, got) > 0.995
    assert got.shape == ref.shape


def test_ort_runs_exactly_the_codes_we_chose(tiny):
    model, calib = tiny
    q, _ = quantize_weight_only(model, calib, algorithm="gptq", block_size=16, nodes=["fc2"])
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear")
    codes, scales = inits[dq.input[0]].astype(np.float32), inits[dq.input[1]]
    w2 = codes * np.repeat(scales, 16, axis=0)
    # rebuild the fp32 model with that weight: ORT must give the same output as the Q/DQ model
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    for t in ref.graph.initializer:
        if t.name == "w2":
            t.CopyFrom(numpy_helper.from_array(w2, "w2"))
    np.testing.assert_allclose(run(q, calib[1], exact_int4=True), run(ref, calib[1]), rtol=1e-4, atol=1e-4)
    assert {n.name for n in q.graph.node if n.op_type == "MatMul" and n.input[1] in inits} == {"fc1", "fc3"}


def test_gemm_trans_b_and_asymmetric_int8_mixture():
    model, calib = mlp(gemm_trans_b=True), inputs(two_d=True)
    q, report = quantize_weight_only(model, calib, algorithm="gptq", block_size=16, symmetric=False,
                                     layer_bits={"fc3": 8, "fc2": 32})
    dqs = {n.output[0]: n for n in q.graph.node if n.op_type == "DequantizeLinear"}
    gemm = next(n for n in q.graph.node if n.name == "fc1")
    attrs = {a.name: a.i for a in dqs[gemm.input[1]].attribute}
    assert attrs == {"axis": 1, "block_size": 16}                  # [N, K] weight: blocks along axis 1
    inits = {t.name: t for t in q.graph.initializer}
    assert inits[dqs[gemm.input[1]].input[0]].data_type == onnx.TensorProto.UINT4
    assert len(dqs[gemm.input[1]].input) == 3                       # zero point
    fc3 = next(n for n in q.graph.node if n.name == "fc3")
    assert inits[dqs[fc3.input[1]].input[0]].data_type == onnx.TensorProto.UINT8
    assert "block_size" not in {a.name for a in dqs[fc3.input[1]].attribute}   # per-channel
    assert report["kept_float"] == ["fc2"] and "w2" in inits
    assert cosine(run(model, calib[0]), run(q, calib[0])) > 0.995


def test_bad_inputs_fail_clearly(tiny):
    model, calib = tiny
    with pytest.raises(CalibrationError, match="needs calibration"):
        quantize_weight_only(model, None, algorithm="gptq")
    with pytest.raises(CalibrationError, match="empty"):
        quantize_weight_only(model, [], algorithm="awq")
    with pytest.raises(CalibrationError, match="'tokens', which is not a model input"):
        quantize_weight_only(model, [{**calib[0], "tokens": np.zeros((2, 3), np.int64)}], algorithm="awq")
    with pytest.raises(CalibrationError, match="lacks model input 'x'"):
        quantize_weight_only(model, [{"tokens": np.zeros((2, 3), np.int64)}], algorithm="awq")
    with pytest.raises(CalibrationError, match="is int64, the model expects float32"):
        quantize_weight_only(model, [{"x": np.zeros((2, 3, 64), np.int64)}], algorithm="awq")
    with pytest.raises(CalibrationError, match="rank 2"):
        quantize_weight_only(model, [{"x": np.zeros((2, 64), np.float32)}], algorithm="awq")
    with pytest.raises(QuantizationError, match="'relu' .Relu. has no initializer weight"):
        quantize_weight_only(model, calib, nodes=["relu"])
    with pytest.raises(QuantizationError, match="no node named 'nope'"):
        quantize_weight_only(model, calib, nodes=["nope"])
    with pytest.raises(QuantizationError, match="unknown algorithm"):
        quantize_weight_only(model, calib, algorithm="hqq")
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    w = numpy_helper.to_array(next(t for t in bad.graph.initializer if t.name == "w2")).copy()
    w[3, 4] = np.nan
    next(t for t in bad.graph.initializer if t.name == "w2").CopyFrom(numpy_helper.from_array(w, "w2"))
    with pytest.raises(QuantizationError, match="'fc2' holds 1 NaN/Inf"):
        quantize_weight_only(bad, None, algorithm="rtn")
