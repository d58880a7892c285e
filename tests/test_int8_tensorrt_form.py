"""INT8 Q/DQ in the form TensorRT's ONNX parser takes, through ``dsedge build`` on real ORT sessions.

* Biases stay float on TensorRT targets: ORT's QDQ quantizer writes Conv/Gemm biases as INT32 DequantizeLinear by
  default, and TensorRT's parser refuses a DequantizeLinear whose input is not an activation type (INT32), so such a
  bundle's engine could not be built. ORT targets keep INT32 biases (ORT CPU fuses DQ → Conv → Q into QLinearConv).
* The INT8 paths keep the model's opset (13 at least, for per-channel DequantizeLinear): an opset-17 BERT built INT8
  for Xavier (TensorRT 8.5, opset ≤ 17) was raised to 21 first and could not come back down.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from dsedge.toolchain.pipeline import BuildOptions, build
from dsedge.toolchain.stages.engine_recipe import _graph_facts


def _int32_dq(model: onnx.ModelProto) -> list[str]:
    inits = {t.name: t for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
            and inits[n.input[0]].data_type == TensorProto.INT32]


def _float_biases(model: onnx.ModelProto) -> dict[str, str]:
    """Conv/Gemm nodes fed by a DequantizeLinear weight → the name of their float32 bias initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    dq_out = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {n.name: n.input[2] for n in model.graph.node
            if n.op_type in ("Conv", "Gemm") and n.input[1] in dq_out and len(n.input) > 2
            and n.input[2] in inits and inits[n.input[2]].data_type == TensorProto.FLOAT}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """Conv/BN/ReLU ×2 → pool → Linear (opset 13), with 8 calibration and 4 held-out batches of 4 images."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()
    d = tmp_path_factory.mktemp("cnn")
    torch.onnx.export(net, (torch.randn(1, 3, 32, 32),), str(d / "cnn.onnx"), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=13, dynamo=False)
    rng = np.random.default_rng(0)
    for sub, n in (("calib", 8), ("heldout", 4)):
        (d / sub).mkdir()
        for i in range(n):
            np.savez(d / sub / f"{i}.npz", x=rng.standard_normal((4, 3, 32, 32)).astype(np.float32))
    return d


def _build(src: Path, target: str, out: Path, **kw):
    r = build(BuildOptions(model=str(src / "cnn.onnx"), target=target, precision="int8", calib=str(src / "calib"),
                           heldout=str(src / "heldout"), out_dir=str(out), latency_iterations=3, **kw))
    return r, Path(r.bundle) / "models" / "int8.onnx"


def test_int8_cnn_for_tensorrt_keeps_float_biases_and_ort_keeps_int32(cnn, tmp_path):
    r_trt, trt_path = _build(cnn, "t4", tmp_path / "t4")
    trt = onnx.load(str(trt_path))
    assert _int32_dq(trt) == []
    assert _graph_facts(trt_path)["dq_unparsable"] == []
    ops = {n.name: n.op_type for n in trt.graph.node}
    # the second Conv and the Linear head are INT8 with float biases (the stem Conv stays float: INPUT_CONV_REASON)
    assert sorted(ops[n] for n in _float_biases(trt)) == ["Conv", "Gemm"]
    acc = next(v for v in r_trt.report["variants"] if v["precision"] == "int8")["accuracy"]
    assert acc["cosine_min"] >= 0.999

    _, cpu_path = _build(cnn, "cpu", tmp_path / "cpu", threads=1)
    cpu = onnx.load(str(cpu_path))
    assert len(_int32_dq(cpu)) == 2  # ORT CPU: INT32 biases, so DQ → Conv → Q fuses into QLinearConv
    assert _float_biases(cpu) == {}


def test_int8_of_an_opset17_bert_for_xavier_stays_at_opset17(tmp_path):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=64)).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask, tt):
            return self.bert(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.randint(0, 2000, (2, 16))
    torch.onnx.export(Hidden(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(tmp_path / "bert.onnx"),
                      input_names=names, output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={k: {0: "batch", 1: "seq"} for k in [*names, "last_hidden_state"]})
    assert any(n.op_type == "ConstantOfShape" for n in onnx.load(str(tmp_path / "bert.onnx")).graph.node)
    rng = np.random.default_rng(0)
    for sub, n in (("calib", 6), ("heldout", 4)):
        (tmp_path / sub).mkdir()
        for i in range(n):
            np.savez(tmp_path / sub / f"{i}.npz", input_ids=rng.integers(0, 2000, (2, 16)).astype(np.int64),
                     attention_mask=np.ones((2, 16), np.int64), token_type_ids=np.zeros((2, 16), np.int64))
    r = build(BuildOptions(model=str(tmp_path / "bert.onnx"), target="jetson-xavier", precision="int8",
                           calib=str(tmp_path / "calib"), heldout=str(tmp_path / "heldout"),
                           out_dir=str(tmp_path / "out"), latency_iterations=3))
    q = onnx.load(str(Path(r.bundle) / "models" / "int8.onnx"))
    assert next(o.version for o in q.opset_import if o.domain in ("", "ai.onnx")) == 17
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) >= 6  # the encoder's MatMuls really are INT8
    assert _int32_dq(q) == [] and _graph_facts(Path(r.bundle) / "models" / "int8.onnx")["dq_unparsable"] == []


def test_quantize_float_bias_flag_writes_the_tensorrt_form(cnn, tmp_path, capsys):
    from cli_helpers import run_main

    src, calib = cnn / "cnn.onnx", cnn / "calib"
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "fb.onnx", "--precision", "int8", "--calib", calib,
                             "--float-bias", "-q"], capsys)
    assert code == 0, err
    fb = onnx.load(str(tmp_path / "fb.onnx"))
    assert _int32_dq(fb) == [] and len(_float_biases(fb)) == 3  # both Convs and the Gemm (no stem exclusion here)
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "ib.onnx", "--precision", "int8", "--calib", calib,
                             "-q"], capsys)
    assert code == 0 and len(_int32_dq(onnx.load(str(tmp_path / "ib.onnx")))) == 3  # the ORT default
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "d.onnx", "--precision", "int8", "--int8-mode",
                             "dynamic", "--float-bias"], capsys)
    assert code == 2 and "--float-bias applies to INT8 static" in err and not (tmp_path / "d.onnx").exists()
