"""How ``dsedge build`` judges and reports an encoder and a float conversion: a sentence-transformers-style ONNX
(``token_embeddings`` [N, T, D] and ``sentence_embedding`` [N, D]) is judged as a sentence encoder (nearest-neighbour
top-1 of ``sentence_embedding``, no argmax warning), a per-token output judged on its real tokens also reports its
worst single token, and BF16 says which nodes stayed FP32 because ONNX has no BF16 type for them at the model's
opset. Tiny real ONNX models built here, real ONNX Runtime sessions."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.toolchain.evaluate import compare_models, model_outputs, top1_neighbour_agreement
from tests.test_compression_choice import cnn_model

VOCAB, WIDTH, DIM, SEQ = 40, 16, 12, 8


def _st_onnx(path: Path, sentence_rank: int = 2, seed: int = 0) -> Path:
    """input_ids, attention_mask [N, T] → ``token_embeddings`` [N, T, DIM] = MatMul(table[ids], W) (first output) and
    ``sentence_embedding``: its mean over the real tokens [N, DIM] (``sentence_rank=3``: kept [N, 1, DIM])."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    w = (rng.standard_normal((WIDTH, DIM)) / np.sqrt(WIDTH)).astype(np.float32)
    keep = int(sentence_rank == 3)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["e"], axis=0),
        helper.make_node("MatMul", ["e", "w"], ["token_embeddings"], name="proj"),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
        helper.make_node("Mul", ["token_embeddings", "m3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "seq"], ["total"], keepdims=keep),
        helper.make_node("ReduceSum", ["m3", "seq"], ["count"], keepdims=keep),
        helper.make_node("Div", ["total", "count"], ["sentence_embedding"]),
    ]
    shape = ["batch", DIM] if sentence_rank == 2 else ["batch", 1, DIM]
    graph = helper.make_graph(
        nodes, "st",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
         for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("token_embeddings", TensorProto.FLOAT, ["batch", "sequence", DIM]),
         helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w"),
         numpy_helper.from_array(np.array([-1]), "last"), numpy_helper.from_array(np.array([1]), "seq")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _token_feeds(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, SEQ + 1, n)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(1, VOCAB, (n, SEQ)), 0).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


def _npz_dir(d: Path, batches: int, seed: int) -> Path:
    d.mkdir()
    for i in range(batches):
        np.savez(d / f"{i}.npz", **_token_feeds(8, seed + i))
    return d


# --- item 1: an ONNX with a rank-2 sentence_embedding is a sentence encoder ----------------------------------------

def test_an_onnx_with_a_rank2_sentence_embedding_is_a_sentence_encoder(tmp_path):
    from dsedge.toolchain.sources import resolve_source
    from dsedge.toolchain.stages.compressors import _embedding_output, _top1

    src = resolve_source(str(_st_onnx(tmp_path / "st.onnx")))
    assert src.kind == "onnx" and src.task == "sentence-embedding"
    exported = SimpleNamespace(outputs=[SimpleNamespace(name=n) for n in ("token_embeddings", "sentence_embedding")],
                               path=Path("st.onnx"))
    # the INT4/INT8 gates measure the sentence embedding, and top1 there is nearest-neighbour agreement
    assert _embedding_output(exported, src) == "sentence_embedding" and _top1(src) == "neighbour"
    # a sentence_embedding that is not [N, D] is no sentence encoder's: judged as before
    other = resolve_source(str(_st_onnx(tmp_path / "st3.onnx", sentence_rank=3)))
    assert other.task == "generic" and _top1(other) == "argmax"


def test_build_judges_an_st_onnx_on_sentence_embedding_with_neighbour_top1(tmp_path):
    """A user's pass: the default gate and the table judged token_embeddings (first output) with argmax over the
    hidden dims as "top-1"; with --gate-output sentence_embedding, top-1 was still argmax (0.80, with a warning
    suggesting --accuracy-gate top1:0.99)."""
    from dsedge.toolchain.config import BuildConfig
    from dsedge.toolchain.pipeline import build

    model = _st_onnx(tmp_path / "st.onnx")
    calib, held = _npz_dir(tmp_path / "calib", 2, 10), _npz_dir(tmp_path / "held", 2, 20)
    for gate_output in (None, "sentence_embedding"):
        lines: list[str] = []
        result = build(BuildConfig(model=str(model), target="cpu", precision="int8", calib=str(calib),
                                   heldout=str(held), out_dir=str(tmp_path / f"o-{gate_output}"),
                                   latency_iterations=2, keep_fp32=False, gate_output=gate_output),
                       log=lines.append)
        report = result.report
        acc = report["variants"][0]["accuracy"]
        assert acc["output"] == "sentence_embedding" and "argmax_agreement" not in acc, acc
        feeds = {k: np.concatenate([np.load(p)[k] for p in sorted(held.glob("*.npz"))])
                 for k in ("input_ids", "attention_mask")}
        int8 = Path(result.bundle) / "models" / "int8.onnx"
        ref, test = (model_outputs(m, feeds)["sentence_embedding"] for m in (model, int8))
        assert acc["n"] == 16
        assert acc["top1_agreement"] == pytest.approx(top1_neighbour_agreement(ref, test), abs=1e-4)
        assert not any("argmax" in line for line in lines + report["notes"])


def test_the_argmax_warning_is_for_classifiers_not_a_sentence_encoders_outputs():
    from dsedge.toolchain.stages.validate import _judged_warnings

    def warnings(task: str) -> list[str]:
        plan = SimpleNamespace(config=SimpleNamespace(precision="int8"))
        source = SimpleNamespace(task=task, kind="onnx", validation_kind="held-out real inputs")
        model = SimpleNamespace(source=source, validation={"input_ids": np.zeros((16, 4), np.int64)})
        acc = {"output": "token_embeddings", "cosine_mean": 0.99, "cosine_min": 0.98, "argmax_agreement": 0.5,
               "n": 16}
        return _judged_warnings(plan, model, SimpleNamespace(precision="int8"), acc)

    assert warnings("sentence-embedding") == []
    assert len(warnings("generic")) == 1 and "agrees with fp32 on 0.50 of 16 samples" in warnings("generic")[0]


def test_a_sentence_encoders_other_rank2_output_is_judged_by_neighbours(tmp_path):
    """--gate-output naming a rank-2 output of a sentence encoder other than ``sentence_embedding``: an embedding
    too, top-1 is nearest-neighbour agreement (was argmax over its dims)."""
    a, b = _st_onnx(tmp_path / "a.onnx", seed=0), _st_onnx(tmp_path / "b.onnx", seed=1)
    for p in (a, b):  # rename the output: a pooler-style embedding
        m = onnx.load(str(p))
        for node in m.graph.node:
            node.output[:] = ["pooled" if o == "sentence_embedding" else o for o in node.output]
        m.graph.output[1].name = "pooled"
        onnx.save(m, str(p))
    feeds = _token_feeds(12, 3)
    rec = compare_models(a, b, feeds, task="sentence-embedding", output="pooled")
    ref, test = (model_outputs(m, feeds)["pooled"] for m in (a, b))
    assert rec["output"] == "pooled" and "argmax_agreement" not in rec and rec["n"] == 12
    assert rec["top1_agreement"] == pytest.approx(top1_neighbour_agreement(ref, test), abs=1e-4)


# --- item 2: the worst real token beside the per-sample cosine -------------------------------------------------------

def test_a_per_token_output_reports_its_worst_real_token(tmp_path):
    """One token id (7) is far off in the test model: each sample's cosine over all its real tokens averages it
    away; ``token_cosine_min`` is that token's own cosine."""
    from dsedge.toolchain.report import summary_table, token_caption

    a = _st_onnx(tmp_path / "a.onnx")
    m = onnx.load(str(a))
    table = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "table")).copy()
    table[7] += 1.5 * np.random.default_rng(5).standard_normal(WIDTH).astype(np.float32)
    next(t for t in m.graph.initializer if t.name == "table").CopyFrom(numpy_helper.from_array(table, "table"))
    b = tmp_path / "b.onnx"
    onnx.save(m, str(b))
    feeds = _token_feeds(6, 1)
    feeds["input_ids"][0, 0] = 7      # a real token (every sample has at least 2)
    rec = compare_models(a, b, feeds, output="token_embeddings")
    ra, rb = (model_outputs(p, feeds)["token_embeddings"] for p in (a, b))
    real = feeds["attention_mask"] == 1
    ra, rb = ra[real].astype(np.float64), rb[real].astype(np.float64)
    tok = (ra * rb).sum(1) / (np.linalg.norm(ra, axis=1) * np.linalg.norm(rb, axis=1))
    assert rec["masked_by"] == "attention_mask" and rec["tokens"] == int(real.sum())
    assert rec["token_cosine_min"] == pytest.approx(tok.min(), abs=1e-5)
    assert rec["token_cosine_mean"] == pytest.approx(tok.mean(), abs=1e-5)
    assert rec["token_cosine_min"] < rec["cosine_min"] - 0.05      # the per-sample figure hides the bad token
    # the build's table says it under the table (compressed variants only)
    report = {"bundle": "st-cpu.dse", "target": "cpu", "precision": "int8",
              "variants": [{"name": "int8", "size_bytes": 1, "size_vs_fp32": 1.0, "accuracy": rec, "latency_ms": {}},
                           {"name": "fp32", "size_bytes": 1, "size_vs_fp32": 1.0,
                            "accuracy": {**rec, "token_cosine_min": 1.0}, "latency_ms": {}}]}
    assert token_caption(report) == ("cos min: the worst sample's cosine over its real tokens of 'token_embeddings'; "
                                     f"worst single token: int8 {rec['token_cosine_min']:.4f}")
    assert summary_table(report).caption == token_caption(report)
    report["variants"][0]["accuracy"] = {k: v for k, v in rec.items() if not k.startswith("token_")}
    assert token_caption(report) is None


# --- item 3: BF16 says which nodes stayed FP32 for want of a BF16 type ----------------------------------------------

BF16_NOTE = ("bf16: 2 Conv, 1 GlobalAveragePool stay FP32: ONNX has no BF16 for them before opset 22 "
             "(the model's opset: 13)")


def test_bf16_names_the_nodes_onnx_has_no_bf16_type_for():
    from dsedge.toolchain.quantize.fp16 import convert_float16

    assert convert_float16(cnn_model(), dtype="bf16")[1]["fp32_untyped_note"] == BF16_NOTE
    assert "fp32_untyped_note" not in convert_float16(cnn_model(), dtype="fp16")[1]
    assert "fp32_untyped_note" not in convert_float16(cnn_model(opset=22), dtype="bf16")[1]
    # ops typed from different opsets: each says its own (below 13 neither Gemm nor Relu has BF16)
    assert convert_float16(cnn_model(opset=12), dtype="bf16")[1]["fp32_untyped_note"] == (
        "bf16: 2 Conv, 1 Flatten, 1 Gemm, 1 GlobalAveragePool, 2 Relu stay FP32: ONNX has no BF16 for them at the "
        "model's opset 12 (Conv from opset 22, Flatten from opset 13, Gemm from opset 13, GlobalAveragePool from "
        "opset 22, Relu from opset 13)")


def test_quantize_bf16_warns_and_build_bf16_notes_the_fp32_nodes(tmp_path, capsys):
    from dsedge.cli import main
    from dsedge.toolchain.config import BuildConfig
    from dsedge.toolchain.pipeline import build

    onnx.save(cnn_model(), str(tmp_path / "cnn.onnx"))
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(tmp_path / "cnn.onnx"), "-o", str(tmp_path / "bf16.onnx"), "--precision", "bf16"])
    assert e.value.code in (0, None)
    err = capsys.readouterr().err
    assert f"warning: {BF16_NOTE}" in err.splitlines()

    lines: list[str] = []
    report = build(BuildConfig(model=str(tmp_path / "cnn.onnx"), target="a100", precision="bf16",
                               out_dir=str(tmp_path / "o"), latency_iterations=2, keep_fp32=False),
                   log=lines.append).report
    assert report["precision"] == "bf16" and report["compression"]["fp32_untyped_note"] == BF16_NOTE
    assert BF16_NOTE in lines
    manifest = json.loads((tmp_path / "o" / "cnn-a100.dse" / "manifest.json").read_text())
    assert BF16_NOTE in manifest["variants"][0]["notes"]
