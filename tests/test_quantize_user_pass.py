"""A tester's pass over `dsedge quantize` (real onnx models built with onnx.helper, real ONNX Runtime): FP16 of models
with If/Loop bodies, the written model checked to load before it replaces --output, the source size with its
external data, and the house error style for a missing -o."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.toolchain.quantize.fp16 import convert_float16

from cli_helpers import run_main
from quantize_models import mlp


def _ort(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _vi(name, elem=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def _if_model() -> onnx.ModelProto:
    """h = x @ W (main graph, becomes FP16); y = If(flag, then: h @ W, else: Loop 2× (s @ W2) from h).

    The bodies read the outer tensors h (an FP16 result after conversion), W (an initializer the main graph reads
    too, so it becomes FP16) and W2 (read only by the nested Loop body); the else branch nests a Loop in the If."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["t_out"])], "then", [], [_vi("t_out")])
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("MatMul", ["s_in", "W2"], ["s_out"])],
        "body", [_vi("i", TensorProto.INT64, []), _vi("c_in", TensorProto.BOOL, []), _vi("s_in")],
        [_vi("c_out", TensorProto.BOOL, []), _vi("s_out")])
    else_g = helper.make_graph([helper.make_node("Loop", ["trip", "", "h"], ["e_out"], body=body)], "else", [],
                               [_vi("e_out")])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("If", ["flag"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)],
        "ifm", [_vi("x", shape=["B", 16]), _vi("flag", TensorProto.BOOL, [])], [_vi("y", shape=["B", 16])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w2, "W2"),
         numpy_helper.from_array(np.array(2, np.int64), "trip")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _loop_model() -> onnx.ModelProto:
    """y = Loop 3× (h @ WL) from x: the loop-carried state is a graph input, WL is read only by the body."""
    wl = (np.random.default_rng(1).standard_normal((16, 16)) * 0.2).astype(np.float32)
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), helper.make_node("MatMul", ["h_in", "WL"], ["h_out"])],
        "body", [_vi("i", TensorProto.INT64, []), _vi("c_in", TensorProto.BOOL, []), _vi("h_in")],
        [_vi("c_out", TensorProto.BOOL, []), _vi("h_out")])
    g = helper.make_graph([helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)], "loopm",
                          [_vi("x", shape=["B", 16])], [_vi("y", shape=["B", 16])],
                          [numpy_helper.from_array(wl, "WL"), numpy_helper.from_array(np.array(3, np.int64), "trip"),
                           numpy_helper.from_array(np.array(True), "cond")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_fp16_of_if_and_loop_bodies_loads_in_onnx_runtime_and_matches_fp32():
    """A user's pass: FP16 converted the initializers the bodies read, not the bodies, and ONNX Runtime refused the
    result ("Type parameter (T) of Optype (MatMul) bound to different types"; Loop: "element type mismatch")."""
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    model = _if_model()
    q, report = convert_float16(model)
    onnx.checker.check_model(q, full_check=True)
    assert "branch" in report["fp32_nodes"]                   # the If runs its bodies in FP32, as written
    assert {t.name: t.data_type for t in q.graph.initializer} == {
        "W": TensorProto.FLOAT16, "W2": TensorProto.FLOAT, "trip": TensorProto.INT64}  # W2: read by a body only
    ref, got = _ort(model), _ort(q)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        want, have = ref.run(None, feeds)[0], got.run(None, feeds)[0]
        assert have.dtype == np.float32
        np.testing.assert_allclose(have, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())

    loop = _loop_model()
    q, report = convert_float16(loop)
    assert report["fp32_initializers"] == ["WL"]
    assert not any(n.op_type == "Cast" for n in q.graph.node)  # x is read by the Loop alone: no dead Cast to FP16
    np.testing.assert_allclose(_ort(q).run(None, {"x": x})[0], _ort(loop).run(None, {"x": x})[0], rtol=1e-6)


def _broken_fp16() -> onnx.ModelProto:
    """What FP16 wrote before the fix: an If branch multiplying the fp32 input by an FP16 initializer."""
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [], [_vi("t")])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [_vi("e")])
    g = helper.make_graph([helper.make_node("If", ["flag"], ["y"], then_branch=then_g, else_branch=else_g)], "b",
                          [_vi("x", shape=["B", 16]), _vi("flag", TensorProto.BOOL, [])], [_vi("y")],
                          [numpy_helper.from_array(np.eye(16, dtype=np.float16), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_quantize_refuses_a_result_onnx_runtime_cannot_load_and_keeps_the_old_output(tmp_path, capsys,
                                                                                        monkeypatch):
    """`dsedge quantize` reported success for a file ONNX Runtime could not load; now it loads what it wrote before
    the rename, and a refusal leaves an existing --output as it was."""
    import dsedge.toolchain.quantize.compress as compress_module
    from dsedge.toolchain.artifacts import Compressed

    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(mlp(), str(src))
    out.write_bytes(b"the previous model")
    with pytest.raises(Exception, match="bound to different types"):  # the converter's output that slipped through
        _ort(_broken_fp16())
    monkeypatch.setattr(compress_module, "compress", lambda model, preset, calibration=None: Compressed(
        None, "fp16", {"precision": "fp16"}, _broken_fp16()))
    code, stdout, err = run_main(["quantize", src, "-o", out, "--precision", "fp16"], capsys)
    assert code == 2 and "Traceback" not in err and "wrote" not in stdout
    first, hint = err.strip().splitlines()
    assert first.startswith(f"error: the fp16 model made from {src} does not load in ONNX Runtime (")
    assert "bound to different types" in first and first.endswith("nothing was written")
    assert hint.startswith("  hint: ")
    assert out.read_bytes() == b"the previous model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx"]   # no temporary file left


def test_quantize_fp16_of_an_if_model_writes_a_model_onnx_runtime_runs(tmp_path, capsys):
    src, out = tmp_path / "ifm.onnx", tmp_path / "ifm16.onnx"
    onnx.save(_if_model(), str(src))
    code, stdout, err = run_main(["quantize", src, "-o", out, "--precision", "fp16"], capsys)
    assert code == 0, err
    feeds = {"x": np.ones((2, 16), np.float32), "flag": np.array(False)}
    want = _ort(_if_model()).run(None, feeds)[0]
    np.testing.assert_allclose(_ort(onnx.load(str(out))).run(None, feeds)[0], want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


def test_the_source_size_counts_its_external_data_files(tmp_path, capsys):
    """A user's pass: an external-data model printed "(int4, 0.06 MB, 5568.3% of the source)": the source size was
    its .onnx file alone (a few hundred bytes of graph), not the weights file beside it."""
    d = tmp_path / "ext"
    d.mkdir()
    src = d / "m.onnx"
    onnx.save_model(mlp(), str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.weights", size_threshold=0)
    graph_bytes, data_bytes = src.stat().st_size, (d / "m.weights").stat().st_size
    assert data_bytes > 10 * graph_bytes
    out, rep = tmp_path / "q.onnx", tmp_path / "q.json"
    code, stdout, err = run_main(["quantize", src, "-o", out, "--algorithm", "rtn", "--report", rep], capsys)
    assert code == 0, err
    report = json.loads(rep.read_text())
    assert report["source_size_bytes"] == graph_bytes + data_bytes
    assert report["size_bytes"] == out.stat().st_size
    ratio = out.stat().st_size / (graph_bytes + data_bytes)
    assert 0.1 < ratio < 0.5                                    # INT4 codes + scales of fp32 weights
    assert f"{ratio:.1%} of the source)" in stdout


def test_missing_output_and_calibration_are_one_line_errors_with_a_hint(tmp_path, capsys):
    """A user's pass: the messages of `dsedge quantize` are "error: … / hint: …", not click's "Error: …"."""
    src = tmp_path / "m.onnx"
    onnx.save(mlp(), str(src))
    code, _, err = run_main(["quantize", src], capsys)
    assert code == 2 and "Error:" not in err and "Traceback" not in err
    assert err.splitlines() == ["error: dsedge quantize needs -o/--output",
                                "  hint: dsedge quantize MODEL -o OUT.onnx [--precision int4|int8|fp16|bf16], or "
                                "dsedge quantize --list-presets"]
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "q" / "x.onnx", "--algorithm", "gptq"], capsys)
    assert code == 2 and err.splitlines() == ["error: GPTQ needs calibration data", "  hint: pass --calib DIR_OR_NPZ"]
    assert not (tmp_path / "q" / "x.onnx").exists()
