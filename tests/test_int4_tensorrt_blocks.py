"""INT4 for TensorRT targets is blockwise along K with K a whole number of blocks (TensorRT "Quantization Schemes":
INT4 weight-only, blocks of 64 or 128): a new user's jetson build of a model with K=64 layers shipped per-channel
INT4 (no ``block_size``) that its own recipe said TensorRT rejects. Also what ``dsedge quantize`` says its INT4
output holds."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import run_main
from dsedge.runtime.errors import QuantizationError
from dsedge.toolchain.pipeline import BuildOptions, build


def _dense(path, ks=(32, 64, 128), classes=4, seed=0):
    """x[batch, ks[0]] → MatMul fc1 → Relu → MatMul fc2 → … → Gemm (transB, the last) → logits: one layer per K."""
    rng = np.random.default_rng(seed)
    dims = [*ks, classes]
    inits, nodes, x = [], [], "x"
    for i, (k, n) in enumerate(zip(dims, dims[1:]), 1):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        if i == len(ks):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{i}"))
            nodes.append(helper.make_node("Gemm", [x, f"w{i}"], ["logits"], name=f"fc{i}", transB=1))
        else:
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"fc{i}"),
                      helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}")]
            x = f"r{i}"
    graph = helper.make_graph(nodes, "dense",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", ks[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _table_model(path, dim=64, vocab=2048, seed=0):
    """ids → Gather(table [vocab, dim]) → MatMul fc1 [dim, 128] → Relu → MatMul fc2 [128, 8]."""
    rng = np.random.default_rng(seed)
    arrays = {"table": rng.standard_normal((vocab, dim)), "w1": rng.standard_normal((dim, 128)) / np.sqrt(dim),
              "w2": rng.standard_normal((128, 8)) / np.sqrt(128)}
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed", axis=0),
         helper.make_node("MatMul", ["e", "w1"], ["h"], name="fc1"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "w2"], ["out"], name="fc2")], "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", 8])],
        [numpy_helper.from_array(a.astype(np.float32), n) for n, a in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))
    rng = np.random.default_rng(1)
    for name in ("calib", "held"):
        (path.parent / name).mkdir(exist_ok=True)
        np.savez(path.parent / name / "a.npz", ids=rng.integers(0, vocab, (16, 8)).astype(np.int64))
    return path


def _dq(model):
    """{consumer node name: (input dtype, DequantizeLinear attributes, scale shape)} of each weight's DQ."""
    inits = {t.name: t for t in model.graph.initializer}
    dqs = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for n in model.graph.node:
        src = n.input[1] if n.op_type in ("MatMul", "Gemm") else n.input[0] if n.op_type == "Gather" else None
        if src in dqs:
            dq = dqs[src]
            out[n.name] = (inits[dq.input[0]].data_type, {a.name: helper.get_attribute_value(a) for a in dq.attribute},
                           tuple(inits[dq.input[1]].dims))
    return out


def test_a_per_channel_int4_weight_rewritten_as_one_block_computes_the_same(tmp_path):
    from dsedge.toolchain.quantize.int4 import per_channel_int4_as_blocks
    from dsedge.toolchain.quantize.weight_only import quantize_weight_only

    m = onnx.load(str(_dense(tmp_path / "m.onnx")))
    q, _ = quantize_weight_only(m, algorithm="rtn", block_size=64)
    before = _dq(q)
    assert before["fc2"][1] == {"axis": 1} and before["fc2"][2] == (128,)      # K 64 = block: per-channel
    assert before["fc1"][1] == {"axis": 1} and before["fc3"][1] == {"axis": 1, "block_size": 64}
    x = np.random.default_rng(3).standard_normal((5, 32)).astype(np.float32)
    y0 = ort.InferenceSession(q.SerializeToString()).run(None, {"x": x})[0]
    assert per_channel_int4_as_blocks(q) == 2                                   # fc1 (K 32) and fc2 (K 64)
    after = _dq(q)
    assert after["fc2"] == (TensorProto.INT4, {"axis": 0, "block_size": 64}, (1, 128))
    assert after["fc1"] == (TensorProto.INT4, {"axis": 0, "block_size": 32}, (1, 64))
    assert after["fc3"] == before["fc3"]                                        # blockwise already: untouched
    onnx.checker.check_model(q)
    np.testing.assert_array_equal(ort.InferenceSession(q.SerializeToString()).run(None, {"x": x})[0], y0)


def test_jetson_int4_is_blockwise_and_keeps_a_layer_with_k_under_the_block_float(tmp_path):
    """K 32 < 64: float (it was per-channel INT4); K 64: one block of 64 (was per-channel); K 128: two blocks."""
    from dsedge.runtime.backends.ort_rewrites import int4_block_sizes

    path = _dense(tmp_path / "m.onnx")
    logs: list[str] = []
    r = build(BuildOptions(model=str(path), target="jetson", precision="int4", block_size=64, keep_fp32=False,
                           out_dir=str(tmp_path / "o"), latency_iterations=3), log=logs.append)
    q = onnx.load(str(r.bundle / "models" / "int4.onnx"))
    dq = _dq(q)
    assert set(dq) == {"fc2", "fc3"}
    assert dq["fc2"] == (TensorProto.INT4, {"axis": 0, "block_size": 64}, (1, 128))
    assert dq["fc3"] == (TensorProto.INT4, {"axis": 1, "block_size": 64}, (4, 2))   # Gemm transB: [N, K]
    assert next(n for n in q.graph.node if n.name == "fc1").input[1] == "w1"        # the float initializer
    assert int4_block_sizes(q) == {64}
    trt = r.report["compression"]["tensorrt_int4"]
    assert [(u["node"], u["k"]) for u in trt["float"]] == [("fc1", 32)] and trt["one_block_layers"] == 1
    said = "TensorRT's INT4 is blockwise along K, K a multiple of the block (64): kept float 1 MatMul/Gemm layer (K 32)"
    assert any(said in line and "2 layers converted" in line for line in logs)
    manifest = json.loads((r.bundle / "manifest.json").read_text())
    assert any(said in n for n in manifest["variants"][0]["notes"])
    recipe = (r.bundle / "build" / "trtexec.sh").read_text() + json.dumps(r.report["engine_recipe"])
    assert "per-channel" not in recipe and "rebuild it with --block-size" not in recipe
    # ONNX Runtime targets keep per-channel INT4 where K fits one block
    c = build(BuildOptions(model=str(path), target="cpu", precision="int4", block_size=64, keep_fp32=False,
                           out_dir=str(tmp_path / "c"), latency_iterations=3))
    dq = _dq(onnx.load(str(c.bundle / "models" / "int4.onnx")))
    assert dq["fc1"][1] == {"axis": 1} and dq["fc2"][1] == {"axis": 1}
    assert "tensorrt_int4" not in c.report["compression"]


def test_jetson_int4_refuses_a_model_whose_layers_no_block_fits(tmp_path, capsys):
    path = _dense(tmp_path / "m.onnx", ks=(32, 48))
    code, out, err = run_main(["build", "--target", "jetson", "--precision", "int4", "--model", path,
                               "--out", tmp_path / "o", "-q"], capsys)
    assert code == 2 and "Traceback" not in err
    assert ("int4 for jetson-orin has no layer of m to convert: TensorRT's INT4 is blockwise along K with blocks of "
            "64, and none of its 2 MatMul/Gemm layers has K a multiple of 64 (K: 32, 48)") in err
    assert "--precision fp16 or int8" in err
    with pytest.raises(QuantizationError, match=r"K a multiple of 128 \(K: 32, 64\)") as e:
        build(BuildOptions(model=str(_dense(tmp_path / "n.onnx", ks=(64, 32))), target="jetson", precision="int4",
                           block_size=128, out_dir=str(tmp_path / "o2")))
    assert e.value.hint.startswith("--block-size 64 fits some")                # K 64 fits blocks of 64
    r = build(BuildOptions(model=str(path), target="jetson", out_dir=str(tmp_path / "a"), latency_iterations=3))
    assert r.report["precision"] != "int4"                                       # auto moved on
    assert any(n.startswith("auto skipped int4: int4 for jetson-orin has no layer of m") for n in r.report["notes"])


def test_jetson_gated_int4_searches_only_the_layers_tensorrt_takes(tmp_path):
    path = _dense(tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    for name in ("calib", "held"):
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / "a.npz", x=rng.standard_normal((32, 32)).astype(np.float32))
    r = build(BuildOptions(model=str(path), target="jetson", precision="int4", block_size=64,
                           calib=str(tmp_path / "calib"), heldout=str(tmp_path / "held"), accuracy_gate="cosine:0.99", keep_fp32=False,
                           out_dir=str(tmp_path / "o"), latency_iterations=3))
    c = r.report["compression"]
    assert set(c["precision_by_layer"]) == {"fc2", "fc3"} and c["counts"]["int4"] >= 1
    assert [u["node"] for u in c["tensorrt_int4"]["float"]] == ["fc1"]
    dq = _dq(onnx.load(str(r.bundle / "models" / "int4.onnx")))
    assert "fc1" not in dq
    for node, (dtype, attrs, _) in dq.items():           # INT4 blockwise by 64; a raised layer INT8 per-channel
        assert attrs == ({"axis": 0 if node == "fc2" else 1, "block_size": 64} if dtype == TensorProto.INT4
                         else {"axis": 1 if node == "fc2" else 0})
    assert c["value"] >= 0.99


def test_jetson_int4_keeps_a_table_float_when_its_hidden_dim_is_not_whole_blocks(tmp_path):
    r = build(BuildOptions(model=str(_table_model(tmp_path / "m.onnx", dim=96)), target="jetson", precision="int4",
                           keep_fp32=False, out_dir=str(tmp_path / "o"), latency_iterations=3))
    q = onnx.load(str(r.bundle / "models" / "int4.onnx"))
    dq = _dq(q)
    assert set(dq) == {"fc2"} and dq["fc2"] == (TensorProto.INT4, {"axis": 0, "block_size": 64}, (2, 8))
    assert {t.name for t in q.graph.initializer if t.data_type == TensorProto.FLOAT} >= {"table", "w1"}
    c = r.report["compression"]
    assert c["embeddings"] == [] and [(u["node"], u["op"], u["k"]) for u in c["tensorrt_int4"]["float"]] == [
        ("fc1", "MatMul", 96), ("embed", "Gather", 96)]
    assert "the word-embedding table (table: hidden dim 96)" in c["float_reason"]


def test_a_gated_int4_build_whose_gate_raised_every_layer_is_refused(tmp_path):
    """cosine:0.9999 raised both layers to INT8 and the table to float: the "int4" variant held no INT4."""
    path = _table_model(tmp_path / "m.onnx")
    with pytest.raises(QuantizationError, match=r"int4 kept none of m's 2 layers INT4 to meet the accuracy gate "
                                                r"cosine:0.9999: 2 INT8, 0 float") as e:
        build(BuildOptions(model=str(path), target="jetson", precision="int4", calib=str(tmp_path / "calib"),
                           heldout=str(tmp_path / "held"), accuracy_gate="cosine:0.9999", keep_fp32=False,
                           out_dir=str(tmp_path / "o")))
    assert "--precision int8 or fp16" in e.value.hint


def test_quantize_says_how_many_layers_are_int4_and_counts_the_table_as_a_candidate(tmp_path, capsys):
    path = _table_model(tmp_path / "m.onnx")
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    code, stdout, err = run_main(["quantize", path, "-o", out, "--calib", tmp_path / "calib", "--heldout",
                                  tmp_path / "held", "--accuracy-gate", "cosine:0.9999", "--report", report], capsys)
    assert code == 0, err
    assert f"wrote {out} (int4: 0 of 2 layers INT4, 2 INT8, table float; " in stdout
    r = json.loads(report.read_text())
    assert r["layer_precisions"] == {"int4": 0, "int8": 2, "float": 0} and r["tables"] == {"table": "float"}
    kinds = [onnx.TensorProto.DataType.Name(d) for d, _, _ in _dq(onnx.load(str(out))).values()]
    assert sorted(kinds) == ["INT8", "INT8"]                                      # what the line says
    progress = [ln for ln in err.splitlines() if "sensitivity" in ln and "improves" in ln]   # on stderr
    assert [ln.split(":")[0].strip() for ln in progress] == ["sensitivity 1/3", "sensitivity 2/3", "sensitivity 3/3"]
    assert "embedding table table int4 -> float" in progress[-1] and "(rank 1 of 3)" in stdout
    code, stdout, _ = run_main(["quantize", path, "-o", tmp_path / "q2.onnx"], capsys)   # no gate: all INT4
    assert code == 0 and "(int4: 2 of 2 layers INT4, table INT4; " in stdout
