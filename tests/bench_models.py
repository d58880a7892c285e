"""Tiny real ONNX models and bundles for the bench tests (built with onnx.helper, run by real ONNX Runtime)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN = 128, 16


def text_model(path: Path, static_batch: int | None = None, opset: int = 17) -> Path:
    """input_ids, attention_mask int64 [batch, sequence] → Gather(embedding) · mask → MatMul → [batch, sequence, 16].

    The embedding has ``VOCAB`` rows, so token ids ≥ VOCAB make ONNX Runtime fail (bench must stay within vocab).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    b = static_batch if static_batch else "batch"
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b, "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [b, "sequence"])
    out = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [b, "sequence", HIDDEN])
    inits = [
        numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "embedding"),
        numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis"),
    ]
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last_axis"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
        helper.make_node("MatMul", ["masked", "w"], ["last_hidden_state"]),
    ]
    graph = helper.make_graph(nodes, "tiny_text", [ids, mask], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def text_bundle(dest: Path, work: Path, *, static_batch: int | None = None, budget_ms: float | None = 1000.0,
                batch_max: int = 16, vocab_size: int | None = VOCAB, variants: tuple[str, ...] = ("fp32",)) -> Path:
    """A real bundle (``write_bundle``) around ``text_model``; one identical ONNX file per variant name."""
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    work.mkdir(parents=True, exist_ok=True)
    onnx_path = text_model(work / f"tiny-{static_batch or 'dyn'}.onnx", static_batch=static_batch)
    b = static_batch if static_batch else "batch"
    ranges = {"sequence": {"min": 1, "opt": 8, "max": 64}}
    if not static_batch:
        ranges["batch"] = {"min": 1, "opt": 1, "max": batch_max}
    return write_bundle(
        dest, name="tiny-text", target={"name": "cpu"},
        inputs=[IOSpec("input_ids", "int64", (b, "sequence")), IOSpec("attention_mask", "int64", (b, "sequence"))],
        outputs=[IOSpec("last_hidden_state", "float32", (b, "sequence", HIDDEN))],
        models={f"models/{v}.onnx": onnx_path for v in variants},
        variants=[Variant(name=v, precision="fp32", file=f"models/{v}.onnx") for v in variants],
        default_variant=variants[0], shape_ranges=ranges, latency_budget_ms=budget_ms,
        source={"vocab_size": vocab_size} if vocab_size else {},
    )
