"""INT8 explicit Q/DQ of a 3-D CNN through ``dsedge build``: calibrated on real CT patches (the CT sample's data
pipeline on a crop of the real chest series), validated on patches of the other real volume, and the ``cpu`` auto
choice made by latency measured side by side. The model is a small 3-D U-Net (the CT student's architecture at
narrower widths, seed-0 weights, no training) exported with the TorchScript exporter to keep the test fast."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dsedge.runtime.errors import CalibrationError
from dsedge.toolchain.pipeline import BuildOptions, build
from dsedge.toolchain.stages.compressors import INPUT_CONV_REASON

CHEST = "ct-chest-lung-pet-ct-dx-a0002"
NIFTI = "ct-totalsegmentator-example/example_ct.nii.gz"


@pytest.fixture(scope="module")
def cnn_onnx(tmp_path_factory):
    """A Conv3d U-Net (samples.ct.model, widths 4/8/8, BatchNorm folded by the exporter) as an ONNX file."""
    import torch

    from samples.ct.model import META_DIM, make_student

    torch.manual_seed(0)
    model = make_student(widths=(4, 8, 8)).eval()
    path = tmp_path_factory.mktemp("cnn") / "cnn3d.onnx"
    args = (torch.rand(2, 1, 32, 32, 32), torch.rand(2, META_DIM))
    torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=["patch", "meta"],
                      output_names=["cell_logits"], dynamic_axes={"patch": {0: "batch"}, "meta": {0: "batch"},
                                                                  "cell_logits": {0: "batch"}})
    return path


@pytest.fixture(scope="module")
def ct_inputs(shared_data, tmp_path_factory):
    """calib/: 24 patches of a crop of the chest series; heldout/: 16 lung windows of a crop of the NIfTI volume."""
    from samples.ct.calibration import calibration_patches, window_patches, write_npz_dir
    from samples.ct.scans import make_scan, read_volume

    chest = make_scan(read_volume(shared_data / CHEST).crop((8, 120, 40), (16, 256, 256)), 3, seed=7)
    body = make_scan(read_volume(shared_data / NIFTI).crop((60, 20, 0), (52, 80, 112)), 2, seed=8)
    root = tmp_path_factory.mktemp("ct-inputs")
    calib = write_npz_dir(root / "calib", calibration_patches([chest], 24, seed=0), per_file=8)
    held = write_npz_dir(root / "heldout", window_patches([body], limit=16), per_file=8)
    return calib, held


@pytest.fixture(scope="module")
def int8_build(cnn_onnx, ct_inputs, tmp_path_factory):
    calib, held = ct_inputs
    return build(BuildOptions(model=str(cnn_onnx), target="cpu", precision="int8", calib=str(calib),
                              heldout=str(held), out_dir=str(tmp_path_factory.mktemp("o8")), latency_iterations=5,
                              threads=2))


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_int8_build_puts_qdq_around_every_conv3d(int8_build, tmp_path):
    import onnxruntime as ort

    path = int8_build.bundle / "models" / "int8.onnx"
    model = onnx.load(str(path))
    inits = _inits(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 9
    stem = [c for c in convs if c.input[0] == "patch"]                         # reads the raw image: kept float
    assert len(stem) == 1 and inits[stem[0].input[1]].dtype == np.float32
    assert int8_build.report["layers"] == [{"node": stem[0].name, "kept": "float", "why": INPUT_CONV_REASON}]
    convs = [c for c in convs if c not in stem]
    for conv in convs:
        assert conv.input[1] not in inits
        w_dq = producer[conv.input[1]]
        assert w_dq.op_type == "DequantizeLinear"
        codes, scale = inits[w_dq.input[0]], inits[w_dq.input[1]]
        assert codes.dtype == np.int8 and codes.ndim == 5                      # Conv3d weight [Cout, Cin, kD, kH, kW]
        assert scale.shape == (codes.shape[0],)                                # per output channel
        assert {a.name: a.i for a in w_dq.attribute}.get("axis", 1) == 0       # ... along axis 0
        x_dq = producer[conv.input[0]]
        assert x_dq.op_type == "DequantizeLinear" and producer[x_dq.input[0]].op_type == "QuantizeLinear"
        assert inits[x_dq.input[1]].shape == () and inits[x_dq.input[2]].dtype == np.int8   # per-tensor, INT8
        assert int(inits[x_dq.input[2]]) == 0                                  # symmetric (TensorRT explicit mode)
    users = {i: n for n in model.graph.node for i in n.input}
    after = [users[c.output[0]].op_type for c in convs]
    assert after.count("QuantizeLinear") == 7 and after.count("Reshape") == 1  # every output Q/DQ but the logits'
    details = int8_build.report["compression"]
    assert details["float_outputs"] == [next(c for c in convs if users[c.output[0]].op_type == "Reshape").output[0]]
    assert details["method"] == "minmax" and details["per_channel"]
    assert details["calibration_batches"] == 2                                 # 24 samples in batches of 16
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "ort-optimized.onnx")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    ran = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert ran.count("QLinearConv") >= 5                                       # ORT runs INT8 Conv3d kernels
    out = sess.run(None, {"patch": np.zeros((3, 1, 32, 32, 32), np.float32), "meta": np.zeros((3, 6), np.float32)})
    assert out[0].shape == (3, 16 ** 3, 2)


def test_int8_accuracy_vs_fp32_is_recorded_on_the_heldout_volume(int8_build, cnn_onnx, ct_inputs):
    import onnxruntime as ort

    from dsedge.toolchain.evaluate import two_class_metrics

    rep = int8_build.report
    assert rep["validation"]["samples"] == 16 and rep["validation"]["inputs"].startswith("--heldout")
    assert "calib" in rep["compression"]["calibration"] and "24 samples" in rep["compression"]["calibration"]
    acc = next(v for v in rep["variants"] if v["precision"] == "int8")["accuracy"]
    assert acc["n"] == 16 and acc["cosine_mean"] >= 0.98 and acc["pearson"] >= 0.98 and acc["max_abs_diff"] > 0
    assert 0.0 < acc["prob_max_abs_diff"] < 0.1 and 0.0 <= acc["dice_at_0.5"] <= 1.0
    # the recorded figures are those of the bundle's two models on the held-out files
    held = ct_inputs[1]
    feeds = {k: np.concatenate([np.load(f)[k] for f in sorted(held.glob("*.npz"))]) for k in ("patch", "meta")}
    ref = ort.InferenceSession(str(cnn_onnx), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    q = ort.InferenceSession(str(int8_build.bundle / "models" / "int8.onnx"),
                             providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert float(np.max(np.abs(ref - q))) == pytest.approx(acc["max_abs_diff"], rel=1e-4)
    assert two_class_metrics(ref, q)["prob_max_abs_diff"] == pytest.approx(acc["prob_max_abs_diff"], rel=1e-3)


def test_two_class_metrics_values():
    from dsedge.toolchain.evaluate import two_class_metrics

    ref = np.zeros((1, 4, 2), np.float32)
    ref[..., 1] = -4.0                       # negative cells (p = 0.018) ...
    ref[0, :2, 1] = 4.0                      # ... but cells 0, 1 positive (p = 0.982)
    test = ref.copy()
    test[0, 1, 1] = -4.0                     # cell 1 lost, cell 2 gained
    test[0, 2, 1] = 4.0
    m = two_class_metrics(ref, test)
    assert m["dice_at_0.5"] == pytest.approx(0.5) and m["positives_ref"] == 2 == m["positives_test"]
    assert m["prob_max_abs_diff"] == pytest.approx(1 / (1 + np.exp(-4)) - 1 / (1 + np.exp(4)), abs=1e-6)
    assert two_class_metrics(np.zeros((1, 3, 2)) - [[[0, 9]]], np.zeros((1, 3, 2)))["dice_at_0.5"] == 0.0


def test_cpu_auto_times_candidates_side_by_side_and_keeps_the_faster_accurate_one(cnn_onnx, ct_inputs, tmp_path):
    from dsedge.toolchain.stages.auto import AUTO_MIN_SPEEDUP

    calib, held = ct_inputs
    r = build(BuildOptions(model=str(cnn_onnx), target="cpu", calib=str(calib), heldout=str(held),
                           out_dir=str(tmp_path), latency_iterations=8, threads=2))
    choice = r.report["precision_choice"]
    timed = {c["precision"]: c for c in choice["candidates"] if "b1_p50_ms" in c}
    assert {"int8", "fp32"} <= set(timed) and all(c["b1_p50_ms"] > 0 for c in timed.values())
    variants = {v["precision"]: v for v in r.report["variants"]}
    lat = variants[r.report["precision"]]["latency_ms"]["1"]
    assert lat["side_by_side"] == list(timed) and lat["n"] == 8 and lat["shape"]["patch"] == [1, 1, 32, 32, 32]
    fp32 = timed["fp32"]["b1_p50_ms"]
    allowed = [p for p, c in timed.items()
               if c["qualifies"] and (p == "fp32" or fp32 / c["b1_p50_ms"] >= AUTO_MIN_SPEEDUP)]
    assert choice["chosen"] == r.report["precision"] == min(allowed, key=lambda p: timed[p]["b1_p50_ms"])
    assert timed["int8"]["qualifies"] and timed["int8"]["cosine_mean"] >= 0.98
    why = choice["why"]
    assert why.startswith(f"auto: {choice['chosen']} (") and f"int8 {timed['int8']['b1_p50_ms']:.2f} ms" in why
    assert why in r.report["notes"]


def test_cnn_int8_without_calibration_data_is_a_clear_error(cnn_onnx, tmp_path):
    with pytest.raises(CalibrationError, match=r"INT8 Q/DQ of a CNN \(Conv\) needs calibration data") as e:
        build(BuildOptions(model=str(cnn_onnx), target="jetson", precision="int8", out_dir=str(tmp_path / "o")))
    assert "--calib" in e.value.hint
    assert not list((tmp_path / "o").glob("*.dse"))


def test_empty_calibration_set_is_a_clear_error(cnn_onnx, ct_inputs, tmp_path):
    from dsedge.toolchain.quantize.int8 import quantize_int8_static

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CalibrationError, match="has no .npz files"):
        build(BuildOptions(model=str(cnn_onnx), target="cpu", precision="int8", calib=str(empty),
                           heldout=str(ct_inputs[1]), out_dir=str(tmp_path / "o")))
    np.savez(empty / "a.npz", patch=np.zeros((0, 1, 32, 32, 32), np.float32), meta=np.zeros((0, 6), np.float32))
    with pytest.raises(CalibrationError, match="holds 0 samples"):
        build(BuildOptions(model=str(cnn_onnx), target="cpu", precision="int8", calib=str(empty),
                           heldout=str(ct_inputs[1]), out_dir=str(tmp_path / "o")))
    with pytest.raises(CalibrationError, match="calibration data set is empty"):
        quantize_int8_static(onnx.load(str(cnn_onnx)), [])
    assert not list((tmp_path / "o").glob("*.dse"))
