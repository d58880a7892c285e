"""Which compression a model gets: ``--precision auto`` skips an INT4 that would convert a small share of a CNN's
weights (Conv stays float under INT4), BF16 of a Conv model keeps the ops ONNX has no BF16 type for (Conv before
opset 22) as FP32 islands so the model loads, and the INT4 accuracy gate can raise an INT4 word-embedding table to
float like a weight layer. Real ONNX models built here, real ONNX Runtime sessions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.tiny_models import mlp_onnx


def cnn_model(opset: int = 13, seed: int = 0) -> onnx.ModelProto:
    """x[batch, 3, 16, 16] → Conv(3→16, 3x3) → Relu → Conv(16→32, 3x3, stride 2) → Relu →
    GlobalAveragePool → Flatten → Gemm(32→10, transB) → logits[batch, 10]: weight bytes mostly Conv (5.9 % Gemm)."""
    rng = np.random.default_rng(seed)
    w = {"w1": rng.standard_normal((16, 3, 3, 3)) / np.sqrt(27), "b1": rng.standard_normal(16) * 0.1,
         "w2": rng.standard_normal((32, 16, 3, 3)) / np.sqrt(144), "b2": rng.standard_normal(32) * 0.1,
         "wf": rng.standard_normal((10, 32)) / np.sqrt(32), "bf": np.zeros(10)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(a.astype(np.float32), n) for n, a in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    onnx.checker.check_model(model)
    return model


def _npz_dir(d: Path, n: int, seed: int) -> Path:
    d.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(n):
        np.savez(d / f"{i}.npz", x=rng.standard_normal((4, 3, 16, 16)).astype(np.float32))
    return d


# --- item 1: auto does not ship an INT4 that left the Convs float ---------------------------------------------------

def test_int4_weight_share_counts_gemm_weights_against_all_float_weights(tmp_path):
    from dsedge.toolchain.stages.auto import AUTO_INT4_MIN_WEIGHT_SHARE, int4_weight_share

    onnx.save(cnn_model(), str(tmp_path / "cnn.onnx"))
    share, int4_bytes, total = int4_weight_share(tmp_path / "cnn.onnx", tables=True)
    assert int4_bytes == 10 * 32 * 4                                   # the Gemm weight only
    assert total == 4 * (16 * 27 + 16 + 32 * 144 + 32 + 320 + 10)      # every float initializer
    assert share == pytest.approx(1280 / 21672) and share < AUTO_INT4_MIN_WEIGHT_SHARE
    share, int4_bytes, total = int4_weight_share(mlp_onnx(tmp_path / "mlp.onnx"), tables=True)
    assert int4_bytes == 4 * (64 * 128 + 4 * 128) and share > 0.98


def test_auto_on_jetson_skips_int4_of_a_cnn_and_ships_int8(tmp_path):
    from dsedge.toolchain.pipeline import BuildOptions, build

    onnx.save(cnn_model(), str(tmp_path / "cnn.onnx"))
    res = build(BuildOptions(model=str(tmp_path / "cnn.onnx"), target="jetson",
                             calib=str(_npz_dir(tmp_path / "calib", 4, 0)), out_dir=str(tmp_path / "out"),
                             latency_iterations=3, threads=1))
    record = res.report["precision_choice"]
    assert record["chosen"] == "int8"
    int4 = next(c for c in record["candidates"] if c["precision"] == "int4")
    assert "b1_p50_ms" not in int4                                     # never built
    assert "5.9% of this model's float weight bytes (1280 of 21672" in int4["skipped"]
    assert int4["int4_weight_share"] == pytest.approx(0.0591, abs=1e-4)
    int8 = next(c for c in record["candidates"] if c["precision"] == "int8")
    assert int8["qualifies"] and int8["cosine_mean"] > 0.999
    assert any("auto skipped int4: INT4 converts" in n for n in res.report["notes"])


# --- item 2: BF16 of a Conv model loads in ONNX Runtime --------------------------------------------------------------

def test_bf16_of_a_cnn_keeps_conv_fp32_and_loads_in_ort(tmp_path):
    from dsedge.toolchain.commands.quantize import check_loads_in_ort
    from dsedge.toolchain.evaluate import compare_models
    from dsedge.toolchain.quantize.fp16 import convert_float16

    fp32 = cnn_model()
    onnx.save(fp32, str(tmp_path / "cnn.onnx"))
    bf16, report = convert_float16(fp32, dtype="bf16")
    # Conv and GlobalAveragePool have no BF16 type before opset 22: FP32 islands, their weights FP32
    assert report["fp32_untyped_nodes"] == ["conv1", "conv2", "pool"]
    dtypes = {t.name: t.data_type for t in bf16.graph.initializer}
    assert dtypes["w1"] == dtypes["w2"] == TensorProto.FLOAT and dtypes["wf"] == TensorProto.BFLOAT16
    onnx.checker.check_model(bf16, full_check=True)
    onnx.save(bf16, str(tmp_path / "bf16.onnx"))
    check_loads_in_ort(tmp_path / "bf16.onnx", "the bf16 model")       # raised "bfloat16 Conv … invalid" before
    x = np.random.default_rng(3).standard_normal((8, 3, 16, 16)).astype(np.float32)
    acc = compare_models(tmp_path / "cnn.onnx", tmp_path / "bf16.onnx", {"x": x})
    assert 0.999 < acc["cosine_mean"] and acc["max_abs_diff"] > 0        # BF16 Gemm rounds: not the fp32 graph
    # fp16 has a type for every op here: nothing changes for it
    assert convert_float16(fp32, dtype="fp16")[1]["fp32_untyped_nodes"] == []


def test_bf16_keeps_conv_bf16_where_the_opset_has_the_type():
    from dsedge.toolchain.quantize.fp16 import convert_float16

    bf16, report = convert_float16(cnn_model(opset=22), dtype="bf16")
    assert report["fp32_untyped_nodes"] == [] and report["fp32_nodes"] == []
    assert {t.name: t.data_type for t in bf16.graph.initializer}["w2"] == TensorProto.BFLOAT16
    onnx.checker.check_model(bf16, full_check=True)


# --- item 3: the INT4 accuracy gate can raise the word-embedding table ----------------------------------------------

def test_int4_gate_raises_the_embedding_table_when_it_is_what_costs(tmp_path):
    from dsedge.toolchain.quantize.compress import Calibration, compress_int4_with_tables
    from dsedge.toolchain.quantize.presets import get_preset
    from tests.tiny_models import embedding_onnx

    model = onnx.load(str(embedding_onnx(tmp_path / "emb.onnx")))
    # a projection INT4 holds exactly (one magnitude per block): all the INT4 error is the table's
    signs = np.sign(np.random.default_rng(5).standard_normal((64, 64))).astype(np.float32)
    w = next(t for t in model.graph.initializer if t.name == "w")
    w.CopyFrom(numpy_helper.from_array(signs * np.float32(0.125), "w"))
    rng = np.random.default_rng(1)
    calib = [{"ids": rng.integers(0, 2048, (4, 8))} for _ in range(2)]
    held = [{"ids": rng.integers(0, 2048, (4, 8))} for _ in range(2)]
    out = compress_int4_with_tables(model, get_preset("int4-rtn").replace(accuracy_gate="cosine:0.9999"),
                                    Calibration(calib, heldout=held), tables=True)
    d = out.details           # before: AccuracyGateError "best cosine = 0.99713 with every weight layer in float"
    assert d["value_all_int4"] == pytest.approx(0.99713, abs=1e-4) and d["value"] > 0.99998
    assert [(r["node"], r["from"], r["to"], r["rank"]) for r in d["raised"]] == [("table", "int4", "float", 1)]
    assert d["tables"] == {"table": "float"} and d["table_sensitivity"]["table"] > 0.001
    assert d["precision_by_layer"] == {"proj": "int4"} and d["embeddings"] == []
    inits = {t.name: t for t in out.model.graph.initializer}
    assert inits["table"].data_type == TensorProto.FLOAT and "table_int4" not in inits
    assert not any(n.op_type == "DequantizeLinear" and n.output[0] == "table" for n in out.model.graph.node)


def test_the_auto_note_shows_the_order_of_candidates_timed_in_microseconds():
    """Found by a user: a tiny model's note read ``fp32 0.01 ms, int4 0.01 ms`` for 0.005 and 0.014 ms."""
    from dsedge.targets import get_target
    from dsedge.toolchain.stages.auto import _auto_why

    cands = [{"precision": "int4", "b1_p50_ms": 0.0142, "cosine_mean": 0.999, "qualifies": True},
             {"precision": "fp32", "b1_p50_ms": 0.00512, "cosine_mean": 1.0, "qualifies": True},
             {"precision": "int8", "b1_p50_ms": 14.23, "cosine_mean": 0.9, "qualifies": False}]
    why = _auto_why("fp32", cands, get_target("cpu"), 1)
    assert why.startswith("auto: fp32 (fp32 0.00512 ms, int4 0.0142 ms, int8 14.2 ms (cosine 0.9 < ")
