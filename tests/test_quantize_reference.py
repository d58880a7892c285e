"""The compression toolchain on the real all-MiniLM-L6-v2 (shares the session's reference bundle build)."""
from __future__ import annotations

import onnx
import pytest

pytestmark = pytest.mark.slow


def test_reference_int4_uses_gptq_and_beats_every_anchor(reference_build):
    report = reference_build.report
    comp = report["compression"]
    # block 64 on a TensorRT target: TensorRT's INT4 takes blocks of 64 or 128 only ("Quantization Schemes")
    assert comp["algorithm"] == "gptq" and comp["symmetric"] is True and comp["block_size"] == 64
    assert [t["shape"] for t in comp["embeddings"]] == [[30522, 384]]          # word embeddings INT4 too
    # ... symmetric on a TensorRT target: its ONNX parser refuses UINT4 and non-zero zero points (the table was
    # UINT4 + zero points, and trtexec could not parse the variant)
    from dsedge.toolchain.stages.engine_recipe import _graph_facts

    assert comp["embedding_tables"] == "int4 symmetric"
    assert _graph_facts(reference_build.bundle / "models" / "int4.onnx")["dq_unparsable"] == []
    assert "parser refuses" not in (reference_build.bundle / "build" / "trtexec.sh").read_text()
    assert comp["embedding_bytes"]["onnx_int4"] < comp["embedding_bytes"]["tensorrt_fp16"] / 3
    int4 = next(v for v in report["variants"] if v["name"] == "int4")
    assert int4["size_vs_fp32"] <= 0.20
    # ANCHORS.md: ORT RTN 0.972, ORT GPTQ 0.976, HQQ 0.979, ModelOpt AWQ 0.978 on the same 60 held-out sentences
    assert int4["accuracy"]["cosine_mean"] >= 0.982
    layers = report["layers"]
    assert len(layers) == 36 and all(lay["bits"] == 4 and lay["algorithm"] == "gptq" for lay in layers)
    assert max(lay["rel_error"] for lay in layers) < 0.02
    q = onnx.load(str(reference_build.bundle / "models" / "int4.onnx"))
    assert sum(n.op_type == "Mul" and "awq" in n.name for n in q.graph.node) == 0     # GPTQ adds no nodes
