"""``dsedge prune`` / ``dsedge quantize`` issues a user found: a channel-pruned bias two layers share, prune and INT4
runs that change nothing, flags a run would ignore, an empty --heldout named as calibration data."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cli_helpers import run_main
from tiny_models import mlp_onnx

K, H = 16, 32


def _shared_bias_model(path, side: str):
    """x[B, 16] → fc1 (MatMul [16, 32]) + b → Relu → fc2 (MatMul [32, 16]) → y, one prunable block, plus a second
    layer reading the same bias ``b`` (what torch.onnx.export makes of equal zero-init biases):

    - ``side="identity"`` / ``"direct"``: ``side`` = x @ w3 + b ([B, 32], a graph output, so no block), ``b`` read
      through an Identity node or directly;
    - ``side="block"``: a second block y2 = Relu(x @ w3 + Identity(b)) @ w4 ([B, 16]), prunable too (BERT's case).
    """
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32), n)
             for n, s in (("w1", (K, H)), ("w2", (H, K)), ("w3", (K, H)), ("w4", (H, K)))]
    inits.append(numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(np.float32), "b"))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
             helper.make_node("Add", ["h1", "b"], ["h1b"], name="fc1_bias"),
             helper.make_node("Relu", ["h1b"], ["h2"], name="relu1"),
             helper.make_node("MatMul", ["h2", "w2"], ["y"], name="fc2"),
             helper.make_node("MatMul", ["x", "w3"], ["s1"], name="fc3")]
    bias = "b"
    if side != "direct":
        nodes.append(helper.make_node("Identity", ["b"], ["b_copy"], name="share_b"))
        bias = "b_copy"
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", K])]
    if side == "block":
        nodes += [helper.make_node("Add", ["s1", bias], ["s1b"], name="fc3_bias"),
                  helper.make_node("Relu", ["s1b"], ["s2"], name="relu3"),
                  helper.make_node("MatMul", ["s2", "w4"], ["y2"], name="fc4")]
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["B", K]))
    else:
        inits = inits[:3] + inits[4:]                                        # no w4
        nodes.append(helper.make_node("Add", ["s1", bias], ["side"], name="fc3_bias"))
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, ["B", H]))
    graph = helper.make_graph(nodes, "shared_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", K])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _run(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))


@pytest.mark.parametrize("side", ["identity", "direct", "block"])
def test_channel_pruning_gives_each_pruned_layer_its_own_copy_of_a_shared_bias(tmp_path, capsys, side):
    """Found by a user on BERT: the pruner sliced layer.0's FFN bias, which layer.1 reads through an Identity
    (torch dedups equal initializers); the pruned model did not load in ORT and prune refused to write it."""
    src = _shared_bias_model(tmp_path / "m.onnx", side)
    out = tmp_path / "p.onnx"
    code, stdout, err = run_main(["prune", src, "-o", out, "--pattern", "channels", "--sparsity", "0.5", "--json"],
                                 capsys)
    assert code == 0 and "does not load in ONNX Runtime" not in err, err
    report = json.loads(stdout.strip().splitlines()[-1])
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    before, after = _run(src, x), _run(out, x)                               # a real ORT session loads it
    pruned = onnx.load(str(out))
    inits = {t.name: list(t.dims) for t in pruned.graph.initializer}
    kept = {b["up"]: b["hidden_after"] for b in report["blocks"]}
    fc1_bias = next(n for n in pruned.graph.node if n.name == "fc1_bias")
    assert inits[fc1_bias.input[1]] == [kept["fc1"]] and kept["fc1"] < H     # fc1's own bias, cut as fc1
    assert after["y"].shape == (3, K)
    if side == "block":                                                      # both blocks cut, each its own bias
        assert sorted(kept) == ["fc1", "fc3"] and kept["fc3"] < H
        fc3_bias = next(n for n in pruned.graph.node if n.name == "fc3_bias")
        assert inits[fc3_bias.input[1]] == [kept["fc3"]] and fc3_bias.input[1] != fc1_bias.input[1]
        assert after["y2"].shape == (3, K)
        assert not any(n.op_type == "Identity" for n in pruned.graph.node) and "b" not in inits  # nothing orphaned
    else:                                                                    # the other layer keeps the whole bias
        assert kept == {"fc1": 16}
        assert after["side"].shape == (3, H) and inits["b"] == [H]
        np.testing.assert_array_equal(after["side"], before["side"])


def _conv_only(path):
    rng = np.random.default_rng(0)
    # input channels 3 and 6: neither Conv can take 2:4 (it groups input channels in 4s)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((4, 6, 3, 3)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4, 8, 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _one_line_error(code, err, *words):
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 2 and err.splitlines()[1].startswith("  hint: "), err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("source", ["int4", "conv"])
def test_a_prune_that_would_change_nothing_is_refused_and_writes_nothing(tmp_path, capsys, source):
    """It wrote the source again and said 'wrote pq.onnx: 2:4 sparsity on 0 layers', exit 0 (warning only)."""
    if source == "int4":
        src = tmp_path / "q4.onnx"
        code, _, err = run_main(["quantize", mlp_onnx(tmp_path / "mlp.onnx"), "-o", src, "--algorithm", "rtn"], capsys)
        assert code == 0, err
        words = ["2:4 sparsity has nothing to prune in", "it is quantized already", "prune the float model"]
    else:
        src = _conv_only(tmp_path / "cnn.onnx")
        words = ["2:4 sparsity has nothing to prune in", "and the model has 2 with other K (e.g. 'conv1')",
                 "a stem reading 1-3 image channels cannot take it"]
    out = tmp_path / "p.onnx"
    code, stdout, err = run_main(["prune", src, "-o", out], capsys)
    _one_line_error(code, err, *words)
    assert "sparsity on 0 layers" not in stdout and not out.exists()


@pytest.mark.parametrize("args, words", [
    (["--precision", "int8", "--int8-mode", "dynamic", "--calib", "{cal}"],
     ["--calib applies to INT4 and INT8 static quantization", "int8-dynamic", "reads no calibration data"]),
    (["--precision", "fp16", "--calib", "{cal}"], ["--calib applies to INT4 and INT8 static", "reads no calibration"]),
    (["--heldout", "{cal}"], ["--heldout is the data --accuracy-gate measures, and no gate was given",
                              "add --accuracy-gate"]),
])
def test_quantize_refuses_data_flags_the_run_would_not_read(tmp_path, capsys, args, words):
    """They were silently ignored (exit 0), as --asymmetric with fp16 is not."""
    cal = tmp_path / "cal"
    cal.mkdir()
    np.savez(cal / "0.npz", x=np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    out = tmp_path / "q.onnx"
    code, _, err = run_main(["quantize", mlp_onnx(tmp_path / "mlp.onnx"), "-o", out,
                             *[a.format(cal=cal) for a in args]], capsys)
    _one_line_error(code, err, *words)
    assert not out.exists()


def test_an_empty_heldout_directory_is_named_held_out_data(tmp_path, capsys):
    from dsedge.runtime.errors import CalibrationError
    from dsedge.toolchain.quantize.calibration import read_batches

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_main(["quantize", mlp_onnx(tmp_path / "mlp.onnx"), "-o", tmp_path / "q.onnx",
                             "--accuracy-gate", "cosine:0.9", "--heldout", empty], capsys)
    _one_line_error(code, err, f"held-out directory {str(empty)!r} holds no .npz file")
    assert "calibration" not in err and not (tmp_path / "q.onnx").exists()
    with pytest.raises(CalibrationError, match=r"^held-out data '.*missing' does not exist$"):
        read_batches(tmp_path / "missing", what="held-out")
    with pytest.raises(CalibrationError, match=r"^calibration directory '.*empty' holds no \.npz file$"):
        read_batches(empty)                                                 # the default still says calibration


def test_int4_of_a_model_without_matmul_is_refused_with_a_hint(tmp_path, capsys):
    """A pure Conv net was written as "int4" at 101-140 % of the source size, exit 0 (warning only)."""
    out = tmp_path / "q.onnx"
    code, _, err = run_main(["quantize", _conv_only(tmp_path / "cnn.onnx"), "-o", out, "--algorithm", "rtn"], capsys)
    _one_line_error(code, err, "int4 has nothing to quantize in cnn.onnx", "(its weight layers: 2 Conv)",
                    "--precision int8")
    assert not out.exists()


def test_an_onnx_prune_reports_its_accuracy_against_the_source_and_warns_when_it_costs(tmp_path, capsys):
    """A user's pass: `dsedge prune` of an ONNX file (not fine-tuned) said nothing of accuracy; 2:4 of a small MLP
    had cosine 0.74 to its source. The output is now compared with the source on --calib rows (else synthetic
    inputs), reported, and a cosine mean under 0.99 is a warning."""
    src = mlp_onnx(tmp_path / "mlp.onnx")
    rng = np.random.default_rng(3)
    (tmp_path / "calib").mkdir()
    x = rng.standard_normal((16, 64)).astype(np.float32)
    np.savez(tmp_path / "calib" / "0.npz", x=x)
    code, out, err = run_main(["prune", src, "-o", tmp_path / "p.onnx", "--pattern", "2:4", "--calib",
                               tmp_path / "calib", "--json"], capsys)
    assert code in (0, None), err
    acc = json.loads(out.strip().splitlines()[-1])["accuracy_vs_source"]
    ref, got = (next(iter(_run(p, x).values())) for p in (src, tmp_path / "p.onnx"))
    cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    assert acc["on"] == f"--calib {tmp_path / 'calib'}" and acc["n"] == 16
    assert acc["cosine_mean"] == pytest.approx(float(cos.mean()), abs=1e-4) and acc["cosine_mean"] < 0.99
    assert "warning: pruning cost accuracy" in err and f"mean {acc['cosine_mean']:.4f}" in err


def test_2_4_prunes_conv_weights_along_input_channels_as_tensorrt_wants(tmp_path, capsys):
    """A user's pass: 2:4 skipped every Conv, though TensorRT's structured sparsity covers convolutions (for each
    output channel and kernel position, 2 of every 4 consecutive input channels zero). A stem with 3 input channels
    cannot take the pattern and is skipped."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["h"], name="stem", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])],
        "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 16, 8, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "cnn.onnx"))
    code, out, err = run_main(["prune", tmp_path / "cnn.onnx", "-o", tmp_path / "p.onnx", "--pattern", "2:4",
                               "--json"], capsys)
    assert code in (0, None), err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["layers"] == [{"node": "conv2", "op": "Conv", "sparsity": 0.5}] and report["skipped"] == ["stem"]
    pruned = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "p.onnx")).graph.initializer}
    groups = pruned["w2"].reshape(16, 2, 4, 3, 3)
    assert ((groups == 0).sum(axis=2) == 2).all()                     # 2 of every 4 input channels, everywhere
    kept = np.sort(np.abs(w2.reshape(16, 2, 4, 3, 3)), axis=2)[:, :, 2:]
    np.testing.assert_array_equal(np.sort(np.abs(groups), axis=2)[:, :, 2:], kept)  # the 2 largest |w| stay
    np.testing.assert_array_equal(pruned["w1"], w1)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert _run(tmp_path / "p.onnx", x)["y"].shape == (2, 16, 8, 8)
