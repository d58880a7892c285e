"""Tiny real ONNX models and bundles for the streaming tests and the small-model benchmark (built, not downloaded).

``text_embedder``: input_ids/attention_mask [batch, sequence] int64 → last_hidden_state [batch, sequence, D] and a
masked mean-pooled sentence_embedding [batch, D], like a MiniLM bundle. An out-of-range token id makes ORT's
Gather fail: a real backend error. ``static_model``: x [1, 8] float32 → y [1, 8] (no dynamic batch axis).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.toolchain.bundle_writer import write_bundle

VOCAB = 100


def text_embedder(path: Path, dim: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write the text-embedder ONNX (opset 17, IR 8) to ``path``; ``layers`` MatMul+Tanh blocks set its cost."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, dim)).astype(np.float32) * 0.5, "emb"),
             numpy_helper.from_array(np.array([-1], dtype=np.int64), "axis_last"),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "axis_seq")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h0"])]
    for i in range(layers):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}" if i + 1 < layers else "last_hidden_state"])]
    nodes += [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask3"]),
        helper.make_node("Mul", ["last_hidden_state", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis_seq"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask3", "axis_seq"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["sentence_embedding"]),
    ]
    graph = helper.make_graph(
        nodes, "text_embedder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", dim]),
         helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", dim])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def static_model(path: Path) -> Path:
    """x [1, 8] float32 → y = 2·x [1, 8]: a model without a dynamic batch axis."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "static",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def text_bundle(out: Path, variants: dict[str, int] | None = None, dim: int = 64, budget_ms: float | None = None,
                latency_ms: dict[str, dict] | None = None, max_batch: int = 32, name: str = "toy-text") -> Path:
    """A bundle of the text embedder: one variant per entry of ``variants`` (name → layers), default
    ``{"fp32": 2}``; ``latency_ms`` sets each variant's build-time figures (name → {"1": ms, …})."""
    variants = variants or {"fp32": 2}
    out.mkdir(parents=True, exist_ok=True)
    models, vs = {}, []
    for i, (vname, layers) in enumerate(variants.items()):
        src = text_embedder(out / f"{vname}.onnx", dim=dim, layers=layers, seed=0)
        models[f"models/{vname}.onnx"] = src
        vs.append(Variant(vname, "fp32" if vname == "fp32" else "int8", f"models/{vname}.onnx",
                          latency_ms=dict((latency_ms or {}).get(vname, {}))))
    return write_bundle(
        out / f"{name}-cpu.dse", name=name, target={"name": "cpu"},
        inputs=[IOSpec("input_ids", "int64", ("batch", "sequence")),
                IOSpec("attention_mask", "int64", ("batch", "sequence"))],
        outputs=[IOSpec("last_hidden_state", "float32", ("batch", "sequence", dim)),
                 IOSpec("sentence_embedding", "float32", ("batch", dim))],
        models=models, variants=vs, default_variant=next(iter(variants)),
        shape_ranges={"batch": {"min": 1, "max": max_batch}, "sequence": {"min": 1, "max": 128}},
        latency_budget_ms=budget_ms)


def static_bundle(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    src = static_model(out / "static.onnx")
    return write_bundle(out / "toy-static-cpu.dse", name="toy-static", target={"name": "cpu"},
                        inputs=[IOSpec("x", "float32", (1, 8))], outputs=[IOSpec("y", "float32", (1, 8))],
                        models={"models/fp32.onnx": src}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                        default_variant="fp32")


def text_request(rng: np.random.Generator, seq: int, bad: bool = False) -> dict[str, np.ndarray]:
    """One row: random token ids (or one out-of-vocabulary id when ``bad``), full attention mask."""
    ids = rng.integers(1, VOCAB, size=(1, seq), dtype=np.int64)
    if bad:
        ids[0, 0] = VOCAB + 1000
    return {"input_ids": ids, "attention_mask": np.ones((1, seq), dtype=np.int64)}
