"""Batch invariance on the real reference model: a request's answer alone and batched (with batch-mates of other
lengths, padded as the scheduler pads them) differs by at most 1e-5 · max|answer alone|, for every variant the
reference bundles serve batched. The cpu default (per-row dynamic INT8) is built here from the reference model the
way the cpu target builds it; the per-tensor dynamic INT8 it replaces is shown to fail the same check."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import dsedge
from dsedge.runtime.backends.ort import OrtBackend
from dsedge.runtime.batching import BatchLayout

TOL = 1e-5
LENGTHS = (20, 7, 33, 64)  # the request under test first; its batch-mates are shorter and longer


def _requests(rng: np.random.Generator, inputs) -> list[dict[str, np.ndarray]]:
    out = []
    for n in LENGTHS:
        feed = {}
        for spec in inputs:
            if "mask" in spec.name:
                feed[spec.name] = np.ones((1, n), np.int64)
            elif "type" in spec.name:
                feed[spec.name] = np.zeros((1, n), np.int64)
            else:
                feed[spec.name] = rng.integers(1000, 30000, size=(1, n)).astype(np.int64)
        out.append(feed)
    return out


def _worst_rel_diff(run, inputs, outputs, rng) -> float:
    layout = BatchLayout.of(inputs, outputs)
    worst = 0.0
    for _ in range(2):
        reqs = _requests(rng, inputs)
        alone = [run(r) for r in reqs]
        batch, _ = layout.stack(reqs)  # what a lane runs: right-padded to the longest, mask 0 on the padding
        parts = layout.split(run(batch), reqs)
        for a, p in zip(alone, parts):
            for name, arr in a.items():
                worst = max(worst, float(np.max(np.abs(arr - p[name])) / np.max(np.abs(arr))))
    return worst


def test_rowwise_int8_matmul_is_accurate_per_row_and_independent_of_other_rows():
    """One MatMul: each row's error is set by its own range (an outlier row does not coarsen the others), and the
    integer GEMM does not saturate (ORT's AVX2 U8S8 kernel sums pairs in int16: full-range rows would overflow)."""
    from onnx import TensorProto, helper, numpy_helper

    from dsedge.toolchain.quantize.int8_rowwise import quantize_int8_rowwise

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 32])],
                              [numpy_helper.from_array(w, "w")])
    q, report = quantize_int8_rowwise(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                                        ir_version=8), fuse=None)
    assert report["rowwise_quantizers"] == 1 and report["batch_invariant"]
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[0, 0] *= 30  # an outlier row
    import onnxruntime as ort

    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": x})[0]
    err = np.abs(y - x @ w).max(axis=-1)
    assert err[0, 1:].max() < 0.05 and err[1].max() < 0.05, err  # ~range/254 · |w| · sqrt(K) for ordinary rows
    alone = sess.run(None, {"x": x[1:2, 2:3]})[0]
    np.testing.assert_array_equal(alone[0, 0], y[1, 2])  # integer GEMM per row: bit-identical alone


@pytest.fixture(scope="module")
def cpu_int8_models(reference_build, tmp_path_factory):
    """The cpu target's INT8 forms of the reference model: per-row (the default) and per-tensor dynamic."""
    from dsedge.toolchain.export import Exported
    from dsedge.toolchain.stages.compressors import fusable_export
    from dsedge.toolchain.quantize.int8 import _save, fuse_transformer, quantize_int8_dynamic
    from dsedge.toolchain.quantize.int8_rowwise import quantize_int8_rowwise
    from dsedge.toolchain.sources import resolve_source

    work = tmp_path_factory.mktemp("cpu-int8")
    bundle = reference_build.bundle
    manifest = dsedge.load(bundle, variant="fp32", providers=["CPUExecutionProvider"]).manifest
    source = resolve_source(None)
    exported = Exported(bundle / manifest.variant("fp32").file, list(manifest.inputs), list(manifest.outputs), None,
                        "dynamo")
    fusable = fusable_export(exported, source, work)
    model = mha = onnx.load(str(fusable or exported.path))
    if fusable is not None:  # fused as compress_int8 fuses before quantizing; the per-tensor form as it was built
        mha, _ = fuse_transformer(model, model_type="bert", attention="MultiHeadAttention")
        model, _ = fuse_transformer(model, model_type="bert")
    rowwise, report = quantize_int8_rowwise(mha, fuse=None)
    per_tensor, _ = quantize_int8_dynamic(model, fuse=None)
    if fusable is not None:  # the Q, K and V projections are quantized too: no float MatMul reads a weight
        inits = {t.name for t in rowwise.graph.initializer}
        assert report["ops"]["MultiHeadAttention"] == 6 and report["ops"]["MatMulInteger"] == 36, report["ops"]
        assert not [n.name for n in rowwise.graph.node if n.op_type in ("MatMul", "Gemm", "Attention")
                    and any(i in inits for i in n.input)]
    paths = {"int8-rowwise": work / "rowwise.onnx", "int8-per-tensor": work / "per_tensor.onnx"}
    _save(rowwise, paths["int8-rowwise"])
    _save(per_tensor, paths["int8-per-tensor"])
    assert report["batch_invariant"] is True and report["rowwise_quantizers"] > 0
    return paths, manifest


def test_reference_bundle_variants_are_batch_invariant(reference_build):
    rng = np.random.default_rng(0)
    m = dsedge.load(reference_build.bundle, providers=["CPUExecutionProvider"]).manifest
    for v in m.variants:
        with dsedge.load(reference_build.bundle, variant=v.name, providers=["CPUExecutionProvider"]) as s:
            worst = _worst_rel_diff(s.run, s.inputs, s.outputs, rng)
            assert worst <= TOL, f"{v.name}: alone vs batched differs by {worst:.2e} of max|alone|"
            assert v.batch_invariant is not False  # served batched, so it must not be marked batch-variant


def test_a_request_whose_mask_row_is_all_zero_is_answered_as_alone(reference_build):
    """A row with no real token attends uniformly over every masked key, so padding it to a longer batch-mate moved
    MiniLM's ``last_hidden_state`` by about 3 (a break-it pass, through ``submit`` and over HTTP). The scheduler
    batches such a request only with requests of its own length: through ``submit``, among batch-mates of other
    lengths, it gets what ``run`` gives it alone."""
    rng = np.random.default_rng(3)
    with dsedge.load(reference_build.bundle, providers=["CPUExecutionProvider"]) as s:
        reqs = _requests(rng, s.inputs)
        empty = {k: v.copy() for k, v in reqs[0].items()}
        empty["attention_mask"][:] = 0
        layout = BatchLayout.of(s.inputs, s.outputs)
        batch, _ = layout.stack([empty, reqs[3]])  # what padding did: the answer moves
        alone = s.run(empty)["last_hidden_state"]
        moved = layout.split(s.run(batch), [empty, reqs[3]])[0]["last_hidden_state"]
        assert np.abs(moved - alone).max() > 1e-2
        s.submit(reqs[1]).result(60)
        sizes = []
        for _ in range(3):
            futs = [s.submit(r, budget_ms=60_000) for r in (reqs[3], empty, reqs[1], reqs[2], empty)]
            got = [f.result(60) for f in futs]
            sizes += [g.batch_size for g in got]
            for g in (got[1], got[4]):
                assert np.abs(g.outputs["last_hidden_state"] - alone).max() <= TOL * np.abs(alone).max()
        assert max(sizes) >= 2  # requests did share batches meanwhile


def test_cpu_fp32_is_the_fused_export_exact_and_batch_invariant(reference_build, tmp_path):
    """On ONNX Runtime targets the fp32 candidate is the fastest batch-invariant form: the parity-checked TorchScript
    export with ORT's transformer fusions, so the cpu default (chosen by latency side by side) beats it or is it."""
    from types import SimpleNamespace

    from dsedge.targets import get_target
    from dsedge.toolchain.export import Exported
    from dsedge.toolchain.sources import resolve_source
    from dsedge.toolchain.stages.compressors import compress_fp32

    bundle = reference_build.bundle
    manifest = dsedge.load(bundle, variant="fp32", providers=["CPUExecutionProvider"]).manifest
    exported = Exported(bundle / manifest.variant("fp32").file, list(manifest.inputs), list(manifest.outputs), None,
                        "dynamo")
    source = resolve_source(None)
    (tmp_path / "models").mkdir()
    fused = compress_fp32(exported, tmp_path, SimpleNamespace(target=get_target("cpu")), source)
    ops = {n.op_type for n in onnx.load(str(fused.path)).graph.node}
    assert fused.path != exported.path and {"Attention", "SkipLayerNormalization"} <= ops
    assert fused.details["batch_invariant"] is True
    rng = np.random.default_rng(2)
    feed = {"input_ids": rng.integers(1, 1000, (3, 24)), "attention_mask": np.ones((3, 24)),
            "token_type_ids": np.zeros((3, 24))}
    feed = {s.name: feed[s.name].astype(np.int64) for s in manifest.inputs}
    a, b = OrtBackend(fused.path).run(feed), OrtBackend(exported.path).run(feed)
    assert all(np.max(np.abs(a[k] - b[k])) <= 1e-3 for k in a)
    assert _worst_rel_diff(OrtBackend(fused.path).run, manifest.inputs, manifest.outputs, rng) <= TOL
    jetson = compress_fp32(exported, tmp_path, SimpleNamespace(target=get_target("jetson")), source)
    assert jetson.path == exported.path  # TensorRT reads no ORT contrib ops: the export as it is


def test_cpu_default_int8_is_batch_invariant_and_per_tensor_is_not(cpu_int8_models):
    paths, manifest = cpu_int8_models
    rng = np.random.default_rng(1)
    row = _worst_rel_diff(OrtBackend(paths["int8-rowwise"]).run, manifest.inputs, manifest.outputs, rng)
    assert row <= TOL, f"per-row INT8: alone vs batched differs by {row:.2e} of max|alone|"
    per_tensor = _worst_rel_diff(OrtBackend(paths["int8-per-tensor"]).run, manifest.inputs, manifest.outputs, rng)
    assert per_tensor > 1e-3  # the form it replaces: one scale for the whole batch
    print(f"alone vs batched, relative to max|alone|: per-row {row:.1e}, per-tensor {per_tensor:.1e}")
