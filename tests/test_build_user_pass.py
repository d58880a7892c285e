"""A tester's pass over the compress stage of `dsedge build` (small real ONNX models built with onnx.helper, real
ONNX Runtime): a quantizing precision that converted no layer, one that converted some, FP16 of a Loop model, and
what a user must be told about an auto choice judged on synthetic inputs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.errors import QuantizationError
from dsedge.toolchain.pipeline import BuildOptions, build


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _no_initializers(path: Path) -> Path:
    """z = Relu(x @ w) with the weight w a graph input: nothing a quantizer converts."""
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["z"])],
                          "noinit", [_vi("x", ["batch", 8]), _vi("w", [8, 8])], [_vi("z", ["batch", 8])])
    return _save(g, path)


def _cnn(path: Path, channels: int = 32) -> Path:
    """Conv 3→channels (3×3) → Relu → GlobalAveragePool → Flatten → MatMul channels→10 + b: INT4 converts the
    MatMul only."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 3, 3, 3)) * 0.3).astype(np.float32), "wc"),
             numpy_helper.from_array((rng.standard_normal((channels, 10)) * 0.3).astype(np.float32), "wf"),
             numpy_helper.from_array(np.zeros(10, np.float32), "bf")]
    g = helper.make_graph([helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["r"]),
                           helper.make_node("GlobalAveragePool", ["r"], ["p"]),
                           helper.make_node("Flatten", ["p"], ["f"]),
                           helper.make_node("MatMul", ["f", "wf"], ["mm"], name="fc"),
                           helper.make_node("Add", ["mm", "bf"], ["y"])],
                          "cnn", [_vi("x", ["batch", 3, 8, 8])], [_vi("y", ["batch", 10])], inits)
    return _save(g, path)


def _near_tie_classifier(path: Path, classes: int = 16) -> Path:
    """logits = x @ (w0 + 1e-4·R) + 10: every class shares w0 and a large bias, so the logits of INT4 are within
    cosine ~1 of fp32 while the classes differ by less than INT4's rounding: the argmax (top-1) does not survive."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((64, 1)) / 8
    w = (w0 + 1e-4 * rng.standard_normal((64, classes))).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["mm"], name="fc"),
                           helper.make_node("Add", ["mm", "b"], ["logits"])],
                          "clf", [_vi("x", ["batch", 64])], [_vi("logits", ["batch", classes])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.full(classes, 10, np.float32),
                                                                                    "b")])
    return _save(g, path)


def _loop(path: Path) -> Path:
    """y = Loop 3× (h @ WL) from x (the tester's loopm.onnx)."""
    wl = (np.random.default_rng(1).standard_normal((16, 16)) * 0.2).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("MatMul", ["h_in", "WL"], ["h_out"])],
        "body", [_vi("i", [], TensorProto.INT64), _vi("c_in", [], TensorProto.BOOL), _vi("h_in", None)],
        [_vi("c_out", [], TensorProto.BOOL), _vi("h_out", None)])
    g = helper.make_graph([helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)], "loopm",
                          [_vi("x", ["batch", 16])], [_vi("y", ["batch", 16])],
                          [numpy_helper.from_array(wl, "WL"), numpy_helper.from_array(np.array(3, np.int64), "trip"),
                           numpy_helper.from_array(np.array(True), "cond")])
    return _save(g, path)


@pytest.mark.parametrize("target,precision", [("cpu", "int4"), ("cpu", "int8")])
def test_a_precision_asked_for_that_quantizes_no_layer_is_refused(tmp_path, target, precision):
    """A user's pass: `--precision int4` on a model without initializers shipped the fp32 graph as "int4" and logged
    "compressed to int4" (`dsedge quantize` warned about the same file)."""
    lines: list[str] = []
    with pytest.raises(QuantizationError) as e:
        build(BuildOptions(model=str(_no_initializers(tmp_path / "noinit.onnx")), target=target,
                           out_dir=str(tmp_path / "out"), precision=precision, latency_iterations=3), log=lines.append)
    assert str(e.value).startswith(f"{precision} quantized no layer of noinit: it converts ")
    assert "--precision auto" in e.value.hint and "\n" not in str(e.value)
    assert not any(line.startswith("compressed to") for line in lines)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_auto_skips_a_candidate_that_quantizes_no_layer_and_says_so(tmp_path):
    r = build(BuildOptions(model=str(_no_initializers(tmp_path / "noinit.onnx")), target="jetson",
                           out_dir=str(tmp_path / "out"), precision="auto", latency_iterations=3))
    assert r.report["precision"] == "fp16"                   # jetson's order: int4, int8, fp16 (first accurate)
    skipped = {c["precision"]: c["skipped"] for c in r.report["precision_choice"]["candidates"] if "skipped" in c}
    assert set(skipped) == {"int4", "int8"} and "quantized no layer of noinit" in skipped["int8"]
    assert "0.0% of this model's float weight bytes" in skipped["int4"]  # not built: nothing INT4 converts
    assert f"auto skipped int4: {skipped['int4']}" in r.report["notes"]
    assert [v["name"] for v in r.report["variants"]] == ["fp16", "fp32"]


def test_int4_of_a_cnn_says_which_layers_stayed_float(tmp_path):
    lines: list[str] = []  # MatMul K 64: TensorRT's INT4 takes it (K 32 < its block of 64 stays float, or is refused)
    r = build(BuildOptions(model=str(_cnn(tmp_path / "cnn.onnx", channels=64)), target="jetson",
                           out_dir=str(tmp_path / "out"),
                           precision="int4", latency_iterations=3), log=lines.append)
    note = ("int4: 1 layer converted, 1 weight layer stayed float (1 Conv; int4 converts MatMul/Gemm weights and "
            "word-embedding tables)")
    manifest = json.loads((r.bundle / "manifest.json").read_text())
    assert note in manifest["variants"][0]["notes"]
    assert f"compressed to int4; {note}" in lines
    assert r.report["compression"]["float_layers"] == {"Conv": 1}
    assert r.report["compression"]["converted_layers"] == 1


def test_fp16_of_a_loop_model_builds(tmp_path):
    """A user's pass: `dsedge build --precision fp16` of a Loop model failed in validation (ONNX Runtime: "Tensor
    element type mismatch"), with a hint about opsets."""
    r = build(BuildOptions(model=str(_loop(tmp_path / "loopm.onnx")), target="jetson", out_dir=str(tmp_path / "out"),
                           precision="fp16", latency_iterations=3))
    acc = r.report["variants"][0]["accuracy"]
    assert r.report["precision"] == "fp16" and acc["cosine_min"] > 0.999


def test_auto_on_synthetic_inputs_with_a_lost_top1_warns(tmp_path):
    """A user's pass: auto kept int4 for a classifier at argmax agreement 0.00 on 2 synthetic example inputs, without
    a word. The rule stays (cosine mean >= 0.98 on jetson); the build says what it rests on and what was lost."""
    lines: list[str] = []
    r = build(BuildOptions(model=str(_near_tie_classifier(tmp_path / "clf.onnx")), target="jetson",
                           out_dir=str(tmp_path / "out"), precision="auto", latency_iterations=3), log=lines.append)
    acc = r.report["variants"][0]["accuracy"]
    assert r.report["precision"] == "int4" and acc["cosine_mean"] > 0.99
    assert r.report["validation"] == {"inputs": "example inputs", "samples": 2}
    agree = acc["argmax_agreement"]
    assert agree < 0.9
    synthetic = ("warning: auto chose int4 judging accuracy on 2 example inputs only (synthetic random inputs), not "
                 "on real data: pass --calib DIR or --heldout DIR of real inputs")
    top1 = (f"warning: the int4 variant's argmax (top-1 class, if 'logits' holds a classifier's scores) agrees with "
            f"fp32 on {agree:.2f} of 2 samples (below 0.9): check it on real data, add --accuracy-gate top1:0.99, or "
            "build --precision fp32")
    assert synthetic in r.report["notes"] and top1 in r.report["notes"]
    assert synthetic in lines and top1 in lines


def test_a_build_on_real_data_with_top1_kept_does_not_warn(tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(5)
    for i in range(2):
        np.savez(calib / f"{i}.npz", x=rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    lines: list[str] = []  # MatMul K 64: one block of TensorRT's INT4 (a K 32 one is refused for jetson)
    r = build(BuildOptions(model=str(_cnn(tmp_path / "cnn.onnx", channels=64)), target="jetson",
                           out_dir=str(tmp_path / "out"), precision="int4", calib=str(calib), latency_iterations=3),
              log=lines.append)
    assert r.report["variants"][0]["accuracy"]["argmax_agreement"] >= 0.9
    assert not [n for n in r.report["notes"] if n.startswith("warning")]
    assert not [line for line in lines if line.startswith("warning")]


def _if_with_a_scalar_flag(path: Path) -> Path:
    """y = x @ W if flag else x @ W2, with ``flag`` a rank-0 bool input (no batch axis)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), n) for n in ("W", "W2")]
    branch = [helper.make_graph([helper.make_node("MatMul", ["x", w], [f"{w}_out"])], f"b{w}", [],
                                [_vi(f"{w}_out", None)]) for w in ("W", "W2")]
    g = helper.make_graph([helper.make_node("If", ["flag"], ["y"], then_branch=branch[0], else_branch=branch[1])],
                          "ifm", [_vi("x", ["batch", 16]), _vi("flag", [], TensorProto.BOOL)],
                          [_vi("y", ["batch", 16])], initializer=weights)
    return _save(g, path)


def test_a_model_with_a_scalar_input_builds_with_golden_io_that_verify_checks(tmp_path, capsys):
    """A user's pass: `dsedge build` of a model with a rank-0 bool input crashed with an IndexError while cutting
    golden rows (axis 0 of every input); then it built without golden I/O. The scalar is now stored as it is and
    fed with every chunk of golden rows, so `dsedge verify` checks the bundle."""
    from dsedge.cli import main

    r = build(BuildOptions(model=str(_if_with_a_scalar_flag(tmp_path / "ifm.onnx")), target="cpu",
                           out_dir=str(tmp_path / "out"), precision="fp32", latency_iterations=3))
    assert not any("no golden I/O" in n for n in r.report.get("notes", [])), r.report["notes"]
    golden = np.load(Path(r.bundle) / "golden" / "inputs.npz", allow_pickle=False)
    assert golden["flag"].shape == () and golden["flag"].dtype == np.bool_ and golden["x"].shape[1:] == (16,)
    with pytest.raises(SystemExit) as e:
        main(["verify", str(r.bundle)])
    out = capsys.readouterr()
    assert e.value.code in (0, None) and "Traceback" not in out.err, out.err


def _conv_only(path: Path) -> Path:
    """Conv 1→4 (3×3) → Relu: weights INT4 never converts (INT4 is MatMul/Gemm and embedding tables only)."""
    w = (np.random.default_rng(0).standard_normal((4, 1, 3, 3)) * 0.3).astype(np.float32)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])],
                          "convonly", [_vi("x", ["batch", 1, 8, 8])], [_vi("y", ["batch", 4, 8, 8])],
                          [numpy_helper.from_array(w, "w")])
    return _save(g, path)


def test_int4_of_a_conv_only_model_hints_precisions_the_target_offers(tmp_path, capsys):
    """A user's pass: `dsedge build --target cpu --precision int4` of a Conv-only model was refused with the hint
    "build it as fp16 or fp32 (--precision fp16)", and the cpu target has no fp16: following it was a second error."""
    from cli_helpers import run_main
    from dsedge.targets import get_target

    model = _conv_only(tmp_path / "convonly.onnx")
    code, _, err = run_main(["build", "--target", "cpu", "--model", model, "--precision", "int4",
                             "--out", tmp_path / "out"], capsys)
    flat = " ".join(err.split())
    assert code != 0 and "int4 quantized no layer of convonly" in flat and "Traceback" not in err, err
    hint = flat[flat.index("hint"):]
    offered = get_target("cpu").precisions
    assert "fp16" not in offered and "fp16" not in hint, hint
    named = re.findall(r"--precision (\w+)", hint)
    assert named and all(p == "auto" or p in offered for p in named), hint


@pytest.mark.parametrize("target,words", [
    ("cpu", "build it as fp32 (--precision fp32), or with --precision auto, which skips this precision; "
            "--precision int8 converts Conv weights (W8A8: needs --calib data)"),
    ("t4", "build it as fp16 or fp32 (--precision fp16), or with --precision auto, which skips this precision; "
           "--precision int8 converts Conv weights (W8A8: needs --calib data)"),
])
def test_the_no_layer_hint_names_what_the_target_offers(tmp_path, target, words):
    from types import SimpleNamespace

    from dsedge.targets import get_target
    from dsedge.toolchain.artifacts import Compressed
    from dsedge.toolchain.stages.compressors import check_converted

    comp = Compressed(_conv_only(tmp_path / "convonly.onnx"), "int4")
    with pytest.raises(QuantizationError) as e:
        check_converted(comp, SimpleNamespace(name="convonly"), asked=True, target=get_target(target))
    assert e.value.hint == words
