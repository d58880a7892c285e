"""INT4 blockwise Q/DQ: codes and scales, graph form, ORT execution, load-time Gather rewrite."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.backends.ort import OrtBackend
from dsedge.runtime.token_bounds import graph_value_ranges
from dsedge.runtime.errors import QuantizationError
from dsedge.toolchain.quantize.int4 import dequantize_site, quantize_int4, quantize_site
from tiny_models import embedding_onnx, mlp_onnx


def test_symmetric_rtn_known_values():
    w = np.array([[7.0], [-3.5], [1.0], [0.49]], np.float32)  # one block of 4 along axis 0
    codes, scales, zp = quantize_site(w, axis=0, block_size=4, scale_search=False)
    assert zp is None and scales.shape == (1, 1) and scales[0, 0] == pytest.approx(1.0)
    assert codes.ravel().tolist() == [7, -4, 1, 0]  # rint(-3.5) = -4 (half to even)
    np.testing.assert_array_equal(dequantize_site(codes, scales, 0, 4).ravel(), [7, -4, 1, 0])


def test_asymmetric_uses_uint4_and_zero_points():
    w = np.linspace(0, 3, 32, dtype=np.float32).reshape(32, 1)
    codes, scales, zp = quantize_site(w, axis=0, block_size=32, symmetric=False, scale_search=False)
    assert codes.min() == 0 and codes.max() == 15 and zp.ravel().tolist() == [0]
    assert np.abs(dequantize_site(codes, scales, 0, 32, zp) - w).max() <= scales.max() / 2 + 1e-6


@pytest.mark.parametrize("axis", [0, 1])
def test_error_is_bounded_by_half_a_step_and_k_need_not_divide(axis):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((80, 48) if axis == 0 else (48, 80)).astype(np.float32)  # K = 80: 3 blocks of 32
    codes, scales, _ = quantize_site(w, axis=axis, block_size=32, scale_search=False)
    assert scales.shape[axis] == 3 and codes.min() >= -8 and codes.max() <= 7
    deq = dequantize_site(codes, scales, axis, 32)
    step = np.repeat(scales, 32, axis=axis).take(np.arange(80), axis=axis)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-6)


def test_matmul_and_gemm_weights_become_int4_dq_and_run_in_ort(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    q, report = quantize_int4(onnx.load(str(path)), block_size=32)
    onnx.checker.check_model(q)
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert {n.output[0] for n in dqs} == {"w1", "w2"}
    attrs = {n.output[0]: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in dqs}
    assert attrs["w1"] == {"axis": 0, "block_size": 32} and attrs["w2"] == {"axis": 1, "block_size": 32}  # Gemm transB
    inits = {t.name: t for t in q.graph.initializer}
    assert inits["w1_int4"].data_type == TensorProto.INT4 and "w1" not in inits
    assert {layer["op"] for layer in report["layers"]} == {"MatMul", "Gemm"}
    assert q.opset_import[0].version == 21 and q.ir_version >= 10
    # ORT computes exactly what the numpy dequantization says.
    x = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    deq = {}
    for name, axis in (("w1", 0), ("w2", 1)):
        deq[name] = dequantize_site(numpy_helper.to_array(inits[f"{name}_int4"]),
                                         numpy_helper.to_array(inits[f"{name}_scale"]), axis, 32)
    b1 = numpy_helper.to_array(inits["b1"])
    want = np.maximum(x @ deq["w1"] + b1, 0) @ deq["w2"].T
    got = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_older_opset_is_upgraded_to_21(tmp_path):
    q, _ = quantize_int4(onnx.load(str(mlp_onnx(tmp_path / "m17.onnx", opset=17))))
    assert q.opset_import[0].version == 21 and q.ir_version >= 10
    ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])


def test_embedding_table_quantized_and_rewritten_for_ort_cpu(tmp_path):
    path = embedding_onnx(tmp_path / "emb.onnx")
    q, report = quantize_int4(onnx.load(str(path)), block_size=32, embeddings=True)
    assert {layer["op"] for layer in report["layers"]} == {"Gather", "MatMul"}
    qpath = tmp_path / "q.onnx"
    onnx.save(q, str(qpath))
    ids = np.random.default_rng(0).integers(0, 2048, (2, 7))
    plain = ort.InferenceSession(str(qpath), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    backend = OrtBackend(qpath, providers=["CPUExecutionProvider"])
    assert backend.rewrites == 1  # DequantizeLinear → Gather became GatherBlockQuantized
    np.testing.assert_allclose(backend.run({"ids": ids})["out"], plain, rtol=1e-5, atol=1e-5)
    small, r2 = quantize_int4(onnx.load(str(path)), embeddings=True, min_vocab=4096)
    assert {layer["op"] for layer in r2["layers"]} == {"MatMul"}


def test_an_id_past_an_int4_table_is_refused_at_the_input_not_answered_from_the_rewritten_gather(tmp_path):
    """ORT CPU's GatherBlockQuantized (what the INT4 table's Gather becomes at load) answers an index past its table
    with finite numbers where Gather fails; a bundle whose manifest gives the ids no range is checked against the
    table's size instead (a user's pass: the fraud student's int4 variant scored sparse id 10**6)."""
    import dsedge
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.runtime.errors import InputError
    from dsedge.toolchain.bundle_writer import write_bundle

    q, _ = quantize_int4(onnx.load(str(embedding_onnx(tmp_path / "emb.onnx"))), block_size=32, embeddings=True)
    qpath = tmp_path / "q.onnx"
    onnx.save(q, str(qpath))
    bad = np.array([[5, 10**6]], np.int64)
    rewritten = OrtBackend(qpath, providers=["CPUExecutionProvider"])
    assert rewritten.rewrites == 1 and graph_value_ranges(q) == {"ids": (0, 2047)}
    assert np.isfinite(rewritten.run({"ids": bad})["out"]).all()  # what the rewrite alone would answer
    with pytest.raises(Exception, match="out of data bounds"):  # what the model as built does
        ort.InferenceSession(str(qpath), providers=["CPUExecutionProvider"]).run(None, {"ids": bad})
    bundle = write_bundle(
        tmp_path / "emb.dse", name="emb", target={"name": "cpu"},
        inputs=[IOSpec("ids", "int64", ("batch", "sequence"))],  # no value_range, as bundles built before
        outputs=[IOSpec("out", "float32", ("batch", "sequence", 64))],
        models={"models/int4.onnx": qpath}, variants=[Variant("int4", "int4", "models/int4.onnx")],
        default_variant="int4", shape_ranges={"batch": {"min": 1, "opt": 1, "max": 8},
                                              "sequence": {"min": 1, "opt": 8, "max": 16}}, latency_budget_ms=50.0)
    with dsedge.load(bundle) as s:
        assert [i.value_range for i in s.inputs] == [(0, 2047)]
        with pytest.raises(InputError, match="holds 1000000, outside the model's range \\[0, 2047\\]"):
            s.run({"ids": bad})
        with pytest.raises(InputError, match="outside the model's range"):
            s.submit({"ids": bad}, budget_ms=1000)
        good = np.array([[5, 2047]], np.int64)
        np.testing.assert_allclose(s.run({"ids": good})["out"], rewritten.run({"ids": good})["out"], rtol=1e-6)


def test_a_build_records_the_range_of_ids_that_index_a_table_when_the_source_gives_none(tmp_path):
    import torch

    from dsedge.toolchain.sources import Source
    from dsedge.toolchain.stages.export import export_with_ranges

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(300, 8)
            self.fc = torch.nn.Linear(8 + 3, 2)

        def forward(self, dense, sparse_ids):
            return self.fc(torch.cat([dense, self.emb(sparse_ids).mean(1)], 1))

    ex = {"dense": np.zeros((2, 3), np.float32), "sparse_ids": np.zeros((2, 4), np.int64)}
    source = Source(kind="run", name="scorer", example_inputs=ex, output_names=["logits"], module=Scorer().eval(),
                    dynamic_axes={"dense": {0: "batch"}, "sparse_ids": {0: "batch"}})
    exported = export_with_ranges(source, tmp_path / "fp32.onnx")
    assert {i.name: i.value_range for i in exported.inputs} == {"dense": None, "sparse_ids": (0, 299)}


def test_scale_search_never_worse_than_absmax():
    w = np.random.default_rng(3).standard_t(3, (256, 64)).astype(np.float32)  # heavy tails
    c0, s0, _ = quantize_site(w, 0, 32, scale_search=False)
    c1, s1, _ = quantize_site(w, 0, 32)
    e0 = np.mean((dequantize_site(c0, s0, 0, 32) - w) ** 2)
    e1 = np.mean((dequantize_site(c1, s1, 0, 32) - w) ** 2)
    assert e1 < e0 * 0.95


def test_bad_inputs(tmp_path):
    path = mlp_onnx(tmp_path / "mlp.onnx")
    with pytest.raises(QuantizationError, match="block size 24"):
        quantize_int4(onnx.load(str(path)), block_size=24)
    model = onnx.load(str(path))
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    arr = numpy_helper.to_array(w1).copy()
    arr[3, 5] = np.nan
    w1.CopyFrom(numpy_helper.from_array(arr, "w1"))
    with pytest.raises(QuantizationError, match="'w1' of MatMul node 'fc1' has NaN"):
        quantize_int4(model)
    relu_only = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(QuantizationError, match="no MatMul or Gemm"):
        quantize_int4(relu_only)


def test_ids_the_session_cannot_check_keep_the_checking_gather_and_every_served_variant_checks_its_ids(tmp_path):
    """A user's pass over the fix above: (1) ids offset per field before the table (Add) got no range and the
    table still became GatherBlockQuantized, which answered 10**6 with finite numbers; such a table is now left as
    DequantizeLinear → Gather, which fails; (2) an fp32 primary with an INT4 cascade variant, or an old bundle's
    fp32 variant (ONNX's Gather wraps -1), checked no range: every served variant's tables now set it."""
    import dsedge
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.runtime.errors import InputError
    from dsedge.toolchain.bundle_writer import write_bundle

    emb = onnx.load(str(embedding_onnx(tmp_path / "emb.onnx")))
    offset = onnx.ModelProto()
    offset.CopyFrom(emb)
    g = offset.graph
    g.initializer.append(numpy_helper.from_array(np.array([0, 100], np.int64), "field_offsets"))
    g.node.insert(0, helper.make_node("Add", ["ids", "field_offsets"], ["ids_off"]))
    next(n for n in g.node if n.op_type == "Gather").input[1] = "ids_off"
    q, _ = quantize_int4(offset, block_size=32, embeddings=True)
    qpath = tmp_path / "offset-int4.onnx"
    onnx.save(q, str(qpath))
    backend = OrtBackend(qpath, providers=["CPUExecutionProvider"])
    assert backend.rewrites == 0 and graph_value_ranges(q) == {}
    with pytest.raises(Exception, match="out of data bounds"):  # ORT's Gather checks; a Session says InferenceError
        backend.run({"ids": np.array([[10**6, 0]], np.int64)})

    fp32, int4 = tmp_path / "fp32.onnx", tmp_path / "int4.onnx"
    onnx.save(emb, str(fp32))
    onnx.save(quantize_int4(emb, block_size=32, embeddings=True)[0], str(int4))
    bundle = write_bundle(
        tmp_path / "emb.dse", name="emb", target={"name": "cpu"},
        inputs=[IOSpec("ids", "int64", ("batch", "sequence"))], outputs=[IOSpec("out", "float32", ("batch", "sequence", 64))],
        models={"models/fp32.onnx": fp32, "models/int4.onnx": int4},
        variants=[Variant("fp32", "fp32", "models/fp32.onnx"), Variant("int4", "int4", "models/int4.onnx")],
        default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 1, "max": 8},
                                              "sequence": {"min": 1, "opt": 8, "max": 16}}, latency_budget_ms=50.0)
    for kwargs in ({}, {"cascade": True}):
        with dsedge.load(bundle, **kwargs) as s:
            assert s.variant.name == "fp32" and [i.value_range for i in s.inputs] == [(0, 2047)]
            for bad in (-1, 2048):
                with pytest.raises(InputError, match=f"holds {bad}, outside the model's range"):
                    s.run({"ids": np.array([[5, bad]], np.int64)})
