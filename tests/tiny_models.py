"""Small real ONNX models built in-process for tests (no files committed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def mlp_onnx(path: Path, k: int = 64, hidden: int = 128, classes: int = 4, seed: int = 0, opset: int = 21) -> Path:
    """x[batch, k] → MatMul(W1 [k, hidden]) + b1 → Relu → Gemm(W2ᵀ, transB=1) → logits [batch, classes]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((k, hidden)) / np.sqrt(k)).astype(np.float32)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((classes, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b2 = np.zeros(classes, np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu"),
        helper.make_node("Gemm", ["h2", "w2", "b2"], ["logits"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def embedding_onnx(path: Path, vocab: int = 2048, dim: int = 64, seed: int = 0) -> Path:
    """ids[batch, seq] int64 → Gather(table [vocab, dim]) → MatMul(W [dim, dim]) → out [batch, seq, dim]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed", axis=0),
         helper.make_node("MatMul", ["e", "w"], ["out"], name="proj")],
        "emb",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence", dim])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def tiny_bundle(dest: Path, tmp: Path, **kwargs) -> Path:
    """A real bundle around ``mlp_onnx`` (fp32 only), written with the toolchain's bundle writer."""
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    model = mlp_onnx(tmp / "mlp.onnx")
    return write_bundle(
        dest, name="mlp", target={"name": "cpu"},
        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
        models={"models/fp32.onnx": model}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
        default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 8, "max": 32}}, latency_budget_ms=5.0,
        **kwargs,
    )


def tiny_bert_dir(d: Path, hidden: int = 32, vocab_size: int = 30522, tokenizer: bool = True) -> Path:
    """A real 1-layer Hugging Face BERT (``hidden`` wide, 2 heads, FFN 2×) saved at ``d`` with safetensors, and the
    reference model's tokenizer files beside it unless ``tokenizer`` is False (seeded: the same weights each call)."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=2 * hidden, vocab_size=vocab_size)).save_pretrained(d, safe_serialization=True)
    if tokenizer:
        from dsedge.toolchain import reference

        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(reference.verified_model_dir() / f, d / f)
    return d
