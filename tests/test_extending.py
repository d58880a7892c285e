"""The three "how to add" recipes of docs/architecture.md, each done from outside the package: a target (a profile
file), a compression algorithm (one function, one registration, one preset), a backend (one opener, one
registration) — and a build or a load through it."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner

from tiny_models import mlp_onnx, tiny_bundle


def _ort(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_add_a_target_with_a_profile_file_and_build_for_it(tmp_path):
    from dsedge.cli import cli
    from dsedge.runtime.bundle import verify_bundle

    profile = tmp_path / "my-device.toml"
    profile.write_text('name = "my-device"\ndescription = "an ARM board with ORT"\nbackend = "onnxruntime"\n'
                       'precisions = ["fp16", "fp32"]\nprecision_order = ["fp16", "fp32"]\n'
                       'opset = { min = 13, max = 21 }\ndefault_budget_ms = 20.0\n', encoding="utf-8")
    model = mlp_onnx(tmp_path / "m.onnx")
    r = CliRunner().invoke(cli, ["build", "--target", str(profile), "--model", str(model), "--precision", "fp16",
                                 "--out", str(tmp_path / "out"), "--json", "-q"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["target"] == "my-device" and report["precision"] == "fp16"
    manifest = verify_bundle(tmp_path / "out" / report["bundle"])
    assert manifest.target["name"] == "my-device" and manifest.latency_budget_ms == 20.0
    assert [v.name for v in manifest.variants] == ["fp16", "fp32"]


def _per_tensor_int8(model, preset, calibration):
    """A toy algorithm: every MatMul/Gemm weight as INT8 codes with one absmax scale per tensor (DequantizeLinear)."""
    from onnx import helper, numpy_helper

    g = model.graph
    weights = {n.input[1] for n in g.node if n.op_type in ("MatMul", "Gemm")}
    layers = []
    for t in [t for t in g.initializer if t.name in weights]:
        w = numpy_helper.to_array(t)
        scale = np.float32(np.abs(w).max() / 127)
        g.initializer.remove(t)
        g.initializer.extend([numpy_helper.from_array(np.round(w / scale).astype(np.int8), t.name + "_q"),
                              numpy_helper.from_array(np.array(scale, np.float32), t.name + "_s")])
        g.node.insert(0, helper.make_node("DequantizeLinear", [t.name + "_q", t.name + "_s"], [t.name]))
        layers.append({"name": t.name, "scale": float(scale)})
    return model, {"algorithm": "per-tensor", "layers": layers}


def test_add_an_algorithm_and_quantize_through_its_preset(tmp_path):
    from dsedge.cli import cli
    from dsedge.toolchain.quantize.algorithms import register_algorithm
    from dsedge.toolchain.quantize.presets import Preset, register_preset

    register_algorithm("int8", "toy-per-tensor", _per_tensor_int8, replace=True)
    register_preset(Preset("int8-toy", "int8", "toy-per-tensor", description="toy: per-tensor INT8"), replace=True)
    listed = CliRunner().invoke(cli, ["quantize", "--list-presets", "--json"])
    assert "int8-toy" in [p["name"] for p in json.loads(listed.stdout)]

    model = mlp_onnx(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    r = CliRunner().invoke(cli, ["quantize", str(model), "-o", str(out), "--preset", "int8-toy", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["algorithm"] == "per-tensor" and {x["name"] for x in report["layers"]} == {"w1", "w2"}
    q = onnx.load(str(out))
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 2
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    a, b = _ort(model, x), _ort(out, x)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max() and not np.array_equal(a, b)


class _ReferenceEvaluatorBackend:
    """A toy backend: ONNX's pure-Python reference evaluator."""

    name = "onnx-reference"
    providers = ["onnx.reference"]

    def __init__(self, path):
        from onnx.reference import ReferenceEvaluator

        self.session = ReferenceEvaluator(str(path))
        self.outputs = [o.name for o in onnx.load(str(path)).graph.output]

    def run(self, inputs):
        return dict(zip(self.outputs, self.session.run(None, inputs)))


def test_add_a_backend_and_load_a_bundle_through_it(tmp_path):
    import dsedge
    from dsedge.runtime.backends import register_backend
    from dsedge.targets import load_profile

    opened = []

    def open_reference(variant, preferences):
        opened.append(variant.variant.name)
        return _ReferenceEvaluatorBackend(variant.onnx_path)

    register_backend("onnx-reference", open_reference, replace=True)
    bundle = tiny_bundle(tmp_path / "b.dse", tmp_path)
    manifest_path = bundle / "manifest.json"
    data = json.loads(manifest_path.read_text())
    data["target"] = {"name": "toy-device", "backend": "onnx-reference"}
    manifest_path.write_text(json.dumps(data))
    s = dsedge.load(bundle)
    assert opened == ["fp32"] and s.backend_name == "onnx-reference" and s.providers == ["onnx.reference"]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(s.run({"x": x})["logits"], _ort(bundle / "models" / "fp32.onnx", x), rtol=1e-5,
                               atol=1e-5)
    s.close()
    assert dsedge.load(bundle, providers=["CPUExecutionProvider"]).backend_name == "onnxruntime"  # ORT asked for
    profile = tmp_path / "toy.toml"
    profile.write_text('name = "toy-device"\ndescription = "d"\nbackend = "onnx-reference"\nprecisions = ["fp32"]\n'
                       'precision_order = ["fp32"]\nopset = { min = 13, max = 21 }\n', encoding="utf-8")
    assert load_profile(profile).backend == "onnx-reference"       # a registered backend is a valid profile value
