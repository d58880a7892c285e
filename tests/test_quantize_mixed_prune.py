"""Mixed precision under an accuracy gate, and pruning (2:4, MLP channels), on tiny real ONNX models (ORT)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dsedge.runtime.errors import AccuracyGateError, ConfigError, QuantizationError
from dsedge.toolchain.prune import find_mlp_blocks, nm_mask, prune_2_4, prune_channels
from dsedge.toolchain.quantize.mixed import parse_gate, parse_gates, quantize_mixed
from dsedge.toolchain.quantize.weight_only import layer_activations
from dsedge.toolchain.quantize.graph import select_layers

from quantize_models import cosine, inputs, mlp, run


def _sensitive_mlp() -> onnx.ModelProto:
    """fc3's weight has one huge outlier per block column: INT4 ruins it, INT8 per-channel does not."""
    m = mlp(seed=3)
    t = next(t for t in m.graph.initializer if t.name == "w3")
    w = numpy_helper.to_array(t).copy()
    w[::16, :] *= 40.0
    t.CopyFrom(numpy_helper.from_array(w, "w3"))
    return m


def test_parse_gate():
    g = parse_gate("cosine:0.99")
    assert g.metric == "cosine" and g.threshold == 0.99 and g.passes(0.995) and not g.passes(0.98)
    d = parse_gate("auc-drop:0.003")
    assert d.passes(0.001) and not d.passes(0.01) and d.gain(0.01, 0.002) > 0
    for bad in ("cosine", "psnr:30", "cosine:high"):
        with pytest.raises(ConfigError):
            parse_gate(bad)
    both = parse_gates("cosine:0.99, top1:1")
    assert [(g.metric, g.threshold) for g in both] == [("cosine", 0.99), ("top1", 1.0)]
    with pytest.raises(ConfigError):
        parse_gates(" , ")


def test_gate_raises_the_sensitive_layer_and_reports_why():
    model, calib, held = _sensitive_mlp(), inputs(seed=1), inputs(n_batches=2, seed=9)
    steps = []
    q, report = quantize_mixed(model, calib, gate="cosine:0.9999", heldout=held, algorithm="rtn", block_size=16,
                               on_step=steps.append)
    assert report["value_all_int4"] < 0.9999 <= report["value"]
    assert report["raised"][0]["node"] == "fc3" and report["raised"][0]["rank"] == 1
    assert report["raised"][0]["to"] == "int8" and "improves cosine by" in report["raised"][0]["reason"]
    assert report["sensitivity"]["fc3"] == max(v for v in report["sensitivity"].values())
    assert report["precision_by_layer"]["fc3"] in ("int8", "float")
    bits = {"int4": 4, "int8": 8, "float": 32}
    assert [lay["bits"] for lay in report["layers"]] == [bits[report["precision_by_layer"][n]]
                                                         for n in ("fc1", "fc2", "fc3")]
    assert report["counts"]["int4"] + report["counts"]["int8"] + report["counts"]["float"] == 3
    assert any("sensitivity" in s for s in steps)
    # what the report claims is what the model does
    got = np.mean([cosine(run(model, b), run(q, b)) for b in held])
    assert got >= 0.9999 - 1e-6


def test_gate_passing_at_int4_raises_nothing_and_impossible_gate_fails():
    model, calib, held = mlp(), inputs(), inputs(n_batches=1, seed=5)
    q, report = quantize_mixed(model, calib, gate="cosine:0.9", heldout=held, algorithm="gptq", block_size=16)
    assert report["raised"] == [] and report["counts"]["int4"] == 3
    q2, report2 = quantize_mixed(model, calib, gate="cosine:0.9,top1:1.0", heldout=held, algorithm="rtn",
                                 block_size=16)
    assert report2["values"]["top1"] == 1.0 and report2["gate"] == "cosine:0.9,top1:1"
    with pytest.raises(AccuracyGateError, match=r"best cosine = 0\.50000 with every weight layer in float"):
        quantize_mixed(model, calib, gate="cosine:0.9", metric=lambda m: 0.5, algorithm="rtn", block_size=16)
    with pytest.raises(ConfigError, match="can never be judged: cosine lies in"):
        quantize_mixed(model, calib, gate="cosine:1.5", heldout=held, algorithm="rtn", block_size=16)
    with pytest.raises(ConfigError, match="needs held-out data"):
        quantize_mixed(model, calib, gate="auc-drop:0.01", heldout=held)


def test_nm_mask_keeps_two_of_every_four():
    w = np.random.default_rng(0).standard_normal((16, 5)).astype(np.float32)
    mask = nm_mask(w)
    assert mask.reshape(4, 4, 5).sum(axis=1).tolist() == [[2] * 5] * 4
    kept = np.abs(w[mask]).min()
    # within a group the kept weights are the largest two
    g = np.abs(w).reshape(4, 4, 5)
    assert np.all(np.sort(g, axis=1)[:, 2:, :].reshape(-1) >= 0) and kept > 0
    np.testing.assert_array_equal(np.sort(g, axis=1)[:, 2:, :].sum(1), (g * mask.reshape(4, 4, 5)).sum(1))
    with pytest.raises(QuantizationError, match="divisible by 4"):
        nm_mask(np.ones((6, 2), np.float32))


def test_prune_2_4_onnx_with_wanda_importance():
    model, calib = mlp(), inputs()
    acts = layer_activations(model, calib, select_layers(model, None))
    p, report = prune_2_4(model, acts)
    assert report["importance"] == "wanda" and [r["sparsity"] for r in report["layers"]] == [0.5, 0.5, 0.5]
    w1 = numpy_helper.to_array(next(t for t in p.graph.initializer if t.name == "w1"))
    assert (w1.reshape(16, 4, -1) != 0).sum(axis=1).max() == 2
    assert cosine(run(model, calib[0]), run(p, calib[0])) > 0.6       # 50 % of weights gone, no fine-tune


def test_channel_pruning_shrinks_the_mlp_and_keeps_it_running():
    model, calib = mlp(hidden=96), inputs()
    blocks = find_mlp_blocks(model)
    assert [(b.up, b.bias, b.hidden) for b in blocks] == []           # fc1 feeds two layers: not one block
    # a plain Linear → Relu → Linear block is found and pruned
    m = mlp(hidden=96)
    g = m.graph
    keep = [n for n in g.node if n.name not in ("fc3", "sum")]
    del g.node[:]
    g.node.extend(keep)
    g.node[-1].output[0] = "y"
    blocks = find_mlp_blocks(m)
    assert [(b.up, b.bias, b.down, b.hidden, b.region) for b in blocks] == [("fc1", "fc1_bias", "fc2", 96, ["relu"])]
    p, report = prune_channels(m, 0.5)
    assert report["blocks"][0]["hidden_after"] == 48 and report["sparsity"] == 0.5
    inits = {t.name: numpy_helper.to_array(t) for t in p.graph.initializer}
    assert inits["w1"].shape == (64, 48) and inits["b1"].shape == (48,) and inits["w2"].shape == (48, 32)
    out = run(p, calib[0])
    assert out.shape == run(m, calib[0]).shape and cosine(out, run(m, calib[0])) > 0.7
    with pytest.raises(QuantizationError, match="no prunable MLP block"):
        prune_channels(model, 0.5)
    with pytest.raises(QuantizationError, match="outside"):
        prune_channels(m, 1.0)


def _torch_mlp_onnx(path, two_d: bool = True, act=None) -> onnx.ModelProto:
    """A real torch Linear → ReLU → Linear MLP exported by the TorchScript exporter (its Linears are Gemm, transB=1,
    the bias as C)."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), act or torch.nn.ReLU(), torch.nn.Linear(96, 32)).eval()
    torch.onnx.export(net, (torch.randn(8, 64),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}}, opset_version=17, dynamo=False)
    return onnx.load(str(path))


def test_a_gated_ffn_is_not_cut_on_one_branch(tmp_path):
    """SwiGLU, as torch exports it: down(silu(gate(x)) * up(x)). Each branch's walk reaches a Mul whose other
    operand comes from the other branch; cutting one branch's channels would break that Mul, so neither is a block,
    while the x * sigmoid(x) inside one branch (SiLU) stays a block of its own."""
    import torch

    class GatedFFN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.down = (torch.nn.Linear(64, 96), torch.nn.Linear(64, 96),
                                             torch.nn.Linear(96, 32))

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    torch.onnx.export(GatedFFN().eval(), (torch.randn(8, 64),), str(tmp_path / "g.onnx"), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b"}}, opset_version=17, dynamo=False)
    m = onnx.load(str(tmp_path / "g.onnx"))
    assert {"Mul", "Sigmoid"} <= {n.op_type for n in m.graph.node}
    assert find_mlp_blocks(m) == []
    with pytest.raises(QuantizationError, match="no prunable MLP block"):
        prune_channels(m, 0.5)
    silu = _torch_mlp_onnx(tmp_path / "silu.onnx", act=torch.nn.SiLU())  # x * sigmoid(x): both operands inside
    assert [len(b.region) for b in find_mlp_blocks(silu)] == [2]
    x = {"x": inputs(two_d=True)[0]["x"]}
    p, _ = prune_channels(silu, 0.5)
    assert run(p, x).shape == run(silu, x).shape


def test_channel_pruning_of_a_torch_exported_gemm_mlp(tmp_path, capsys):
    from dsedge.cli import main

    m = _torch_mlp_onnx(tmp_path / "mlp.onnx")
    assert [n.op_type for n in m.graph.node] == ["Gemm", "Relu", "Gemm"]
    x = {"x": inputs(two_d=True)[0]["x"]}
    p, report = prune_channels(m, 0.5)
    assert report["blocks"][0]["hidden_before"] == 96 and report["blocks"][0]["hidden_after"] == 48
    g1, g2 = (n for n in p.graph.node if n.op_type == "Gemm")
    inits = {t.name: numpy_helper.to_array(t) for t in p.graph.initializer}
    assert inits[g1.input[1]].shape == (48, 64) and inits[g1.input[2]].shape == (48,)    # [N, K] kept transposed
    assert inits[g2.input[1]].shape == (32, 48) and inits[g2.input[2]].shape == (32,)
    out, ref = run(p, x), run(m, x)
    assert out.shape == ref.shape and cosine(out, ref) > 0.7
    # pruning zero channels changes nothing: the Gemm bookkeeping (transB, C) is exact
    same, _ = prune_channels(m, 0.0, min_keep=96)
    assert np.array_equal(run(same, x), ref)
    # and through the CLI, as the user ran it
    with pytest.raises(SystemExit) as e:
        main(["prune", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "p.onnx"), "--pattern", "channels"])
    assert e.value.code in (0, None), capsys.readouterr().err
    assert run(onnx.load(str(tmp_path / "p.onnx")), x).shape == ref.shape
    # asked for more than the per-block floor allows: it says what it removed and why not what was asked
    with pytest.raises(SystemExit) as e:
        main(["prune", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "p2.onnx"), "--pattern", "channels",
              "--sparsity", "0.999"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code in (0, None) and "(asked 99.9%: each block keeps at least 8 channels" in out, out


def test_the_top1_gate_is_a_classifiers_argmax_agreement_unless_told_neighbour():
    """A user's pass: `--accuracy-gate top1:0.99` on the fraud classifier measured nearest-neighbour agreement of
    the logits (0.25 for an INT4 model whose argmax agreed on every row, as the build table's top-1 said), so the
    gate could not be met. top1 is argmax agreement by default; sentence encoders ask for the neighbour form."""
    from dsedge.toolchain.evaluate import top1_neighbour_agreement
    from dsedge.toolchain.quantize.mixed import cosine_metric

    model = mlp()
    heldout = inputs(n_batches=2, outliers=False)
    noisy = onnx.ModelProto()
    noisy.CopyFrom(model)
    rng = np.random.default_rng(5)
    for i, t in enumerate(noisy.graph.initializer):
        a = numpy_helper.to_array(t)
        noisy.graph.initializer[i].CopyFrom(numpy_helper.from_array(
            (a + 0.05 * rng.standard_normal(a.shape) * np.abs(a).mean()).astype(a.dtype), t.name))
    ref = np.concatenate([run(model, b) for b in heldout])
    got = np.concatenate([run(noisy, b) for b in heldout])
    argmax = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
    neighbour = top1_neighbour_agreement(ref.reshape(len(ref), -1), got.reshape(len(got), -1))
    assert argmax != neighbour
    assert cosine_metric(model, heldout)(noisy)["top1"] == pytest.approx(argmax)
    assert cosine_metric(model, heldout, top1="neighbour")(noisy)["top1"] == pytest.approx(neighbour)
    assert cosine_metric(model, heldout)(model)["top1"] == 1.0
    with pytest.raises(ConfigError, match="top1 must be 'argmax' or 'neighbour'"):
        cosine_metric(model, heldout, top1="knn")


def test_a_gate_whose_metric_is_undefined_for_the_output_says_so():
    """top1 of a single-logit output is NaN, which failed `top1:0.99` silently at every step (a user's pass)."""
    from dsedge.toolchain.quantize.mixed import GateCheck

    check = GateCheck("cosine:0.99,top1:0.99", metric=lambda m: {"cosine": 1.0, "top1": float("nan")},
                      heldout=None, reference=mlp())
    with pytest.raises(ConfigError, match="top1 is undefined for the gated output"):
        check.measure(mlp())
    assert GateCheck("cosine:0.99", metric=lambda m: {"cosine": 1.0, "top1": float("nan")}, heldout=None,
                     reference=mlp()).measure(mlp())["cosine"] == 1.0
