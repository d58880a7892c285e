"""`dsedge build` end to end on the real all-MiniLM-L6-v2 (built once per session) and on small sources."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import dsedge
from dsedge.runtime.bundle import verify_bundle
from dsedge.runtime.errors import CalibrationError, PrecisionNotSupported, SourceError, TargetError
from dsedge.toolchain.pipeline import BuildOptions, build
from tiny_models import mlp_onnx


def test_reference_bundle_layout_and_manifest(reference_build):
    b = reference_build.bundle
    assert b.name == "all-minilm-l6-v2-jetson-orin.dse"
    m = verify_bundle(b)
    assert m.default_variant == "int4" and {v.name for v in m.variants} == {"int4", "fp32"}
    assert [(s.name, s.dtype, s.shape) for s in m.inputs] == [
        (n, "int64", ("batch", "sequence")) for n in ("input_ids", "attention_mask", "token_type_ids")]
    assert m.outputs[0].name == "last_hidden_state" and m.outputs[0].shape == ("batch", "sequence", 384)
    assert m.outputs[1].name == "sentence_embedding" and m.outputs[1].shape == ("batch", 384)
    assert set(m.files) >= {"models/int4.onnx", "models/fp32.onnx", "build/trtexec.sh", "report.json"}
    assert m.source["sha256"] == "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    assert m.target["name"] == "jetson-orin" and m.latency_budget_ms > 0
    # where it came from, without this machine's paths (site-packages, the checkout): a bundle moves between hosts
    assert m.source["ref"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert m.target["source"] == "builtin:jetson-orin.toml"
    text = (b / "manifest.json").read_text() + (b / "report.json").read_text()
    assert "site-packages" not in text and str(dsedge.__file__).rsplit("/", 2)[0] not in text


def test_reference_int4_model_has_dq_on_every_weight_and_is_small(reference_build):
    b = reference_build.bundle
    q = onnx.load(str(b / "models/int4.onnx"))
    assert q.opset_import[0].version == 21 and q.ir_version >= 10
    producers = {o: n for n in q.graph.node for o in n.output}
    inits = {t.name: t for t in q.graph.initializer}
    linear = [n for n in q.graph.node if n.op_type in ("MatMul", "Gemm")]
    weights = [n.input[1] for n in linear if n.input[1] in producers and producers[n.input[1]].op_type == "DequantizeLinear"]
    assert len(weights) == 36  # 6 layers × (q, k, v, out, ffn in, ffn out)
    assert not any(n.input[1] in inits for n in linear)  # no float weight left on a MatMul/Gemm
    for w in weights:
        dq = producers[w]
        assert inits[dq.input[0]].data_type == TensorProto.INT4
        assert {a.name: a.i for a in dq.attribute}["block_size"] == 64  # TensorRT: blocks of 64 or 128 only
    report = reference_build.report
    assert report["precision_choice"]["chosen"] == "int4" and report["precision_choice"]["candidates"][0]["qualifies"]
    int4 = next(v for v in report["variants"] if v["name"] == "int4")
    assert int4["size_vs_fp32"] <= 0.20
    assert report["export"]["parity_max_abs_diff"] < 1e-3
    acc = int4["accuracy"]
    assert acc["n"] == 60 and 0.95 < acc["cosine_mean"] <= 1.0 and acc["cosine_min"] <= acc["cosine_mean"]
    assert 0.5 <= acc["top1_agreement"] <= 1.0
    assert int4["latency_ms"]["1"]["p50"] > 0 and int4["latency_ms"]["1"]["p99"] >= int4["latency_ms"]["1"]["p50"]
    on_disk = json.loads((b / "report.json").read_text())
    assert on_disk["variants"][0]["accuracy"] == acc


def test_reference_bundle_serves_real_sentences(reference_build):
    from dsedge.toolchain import reference

    tok = reference.load_tokenizer(reference.verified_model_dir())
    feeds = reference.tokenize(tok, ["The train was late again.", "Our flight was delayed by the storm.",
                                     "She baked bread this morning."])
    s4 = dsedge.load(reference_build.bundle)
    s32 = dsedge.load(reference_build.bundle, variant="fp32")
    assert s4.variant.name == "int4" and s4.providers == ["CPUExecutionProvider"]
    e4, e32 = s4.run(feeds)["sentence_embedding"], s32.run(feeds)["sentence_embedding"]
    assert e4.shape == (3, 384)
    cos = (e4 * e32).sum(1) / np.linalg.norm(e4, axis=1) / np.linalg.norm(e32, axis=1)
    assert cos.min() > 0.9
    sim = e32 @ e32.T
    assert sim[0, 1] > sim[0, 2]  # the two travel sentences are closer than the baking one


def test_reference_recipe_uses_real_trtexec_flags(reference_build):
    text = (reference_build.bundle / "build/trtexec.sh").read_text()
    assert "trtexec" in text and "--onnx=models/int4.onnx" in text and "--saveEngine=" in text
    assert "--minShapes=input_ids:1x1" in text and "--maxShapes=input_ids:32x256" in text


def test_onnx_source_builds_for_cpu_with_example_validation(tmp_path):
    r = build(BuildOptions(model=str(mlp_onnx(tmp_path / "clf.onnx")), target="cpu", out_dir=str(tmp_path / "out"),
                           precision="int4", latency_iterations=5))
    assert r.bundle.name == "clf-cpu.dse"
    assert r.report["validation"]["inputs"] == "example inputs"
    acc = r.report["variants"][0]["accuracy"]
    assert acc["cosine_mean"] > 0.98 and "argmax_agreement" in acc
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["clf-cpu.dse"]  # no temp dirs left


def test_calib_dir_is_split_and_reported(tmp_path):
    rng = np.random.default_rng(0)
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(2):
        np.savez(calib / f"part{i}.npz", x=rng.standard_normal((10, 64)).astype(np.float32))
    r = build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="cpu", out_dir=str(tmp_path / "o"),
                           precision="int4", calib=str(calib), latency_iterations=3, keep_fp32=False))
    assert r.report["validation"]["samples"] == 10 and "--calib" in r.report["validation"]["inputs"]
    assert [v["name"] for v in r.report["variants"]] == ["int4"]
    np.savez(calib / "part2.npz", y=np.zeros((1, 64), np.float32))
    with pytest.raises(CalibrationError, match="part2.npz lacks input 'x'"):
        build(BuildOptions(model=str(tmp_path / "m.onnx"), target="cpu", out_dir=str(tmp_path / "o2"),
                           precision="int4", calib=str(calib)))


def test_a_bf16_build_is_validated_on_its_fp32_emulation_and_says_so(tmp_path):
    """A user's pass: every `--precision bf16` build failed (ORT CPU: "Could not find an implementation for Add(14)")
    on every target that lists it. The build validates, times and writes golden outputs from its host twin."""
    from click.testing import CliRunner

    from dsedge.cli import cli

    model = mlp_onnx(tmp_path / "m.onnx")
    r = CliRunner().invoke(cli, ["build", "--target", "a100", "--model", str(model), "--precision", "bf16",
                                 "--out", str(tmp_path / "out"), "--json", "-q"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    bundle = tmp_path / "out" / report["bundle"]
    manifest = verify_bundle(bundle)
    bf16 = manifest.variant("bf16")
    assert onnx.load(str(bundle / bf16.file)).graph.initializer[0].data_type == TensorProto.BFLOAT16
    assert bf16.accuracy["cosine_mean"] > 0.999 and bf16.latency_ms
    assert any("FP32 emulation" in n for n in bf16.notes)
    with pytest.raises(dsedge.BundleError, match="NOT_IMPLEMENTED") as e:  # on this CPU host: said plainly
        dsedge.load(bundle)
    assert "a BF16 variant is for GPUs" in e.value.hint
    with dsedge.load(bundle, variant="fp32") as s:
        assert s.variant.name == "fp32"


def _fp16_onnx(path, io_fp16: bool = True):
    """``mlp_onnx`` with fp16 weights (and fp16 input/output unless ``io_fp16`` is False: fp32 IO around Casts)."""
    from onnx import helper, numpy_helper

    m = onnx.load(str(mlp_onnx(path.with_name("src32.onnx"))))
    for t in m.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    if io_fp16:
        for v in (*m.graph.input, *m.graph.output):
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    else:
        m.graph.node[0].input[0] = "x16"
        m.graph.node[-1].output[0] = "logits16"
        m.graph.node.insert(0, helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16))
        m.graph.node.append(helper.make_node("Cast", ["logits16"], ["logits"], to=TensorProto.FLOAT))
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("target, precision, io_fp16", [("jetson", "fp32", True), ("cpu", "fp32", False),
                                                         ("jetson", "auto", False), ("cpu", "int8", True)])
def test_fp16_onnx_source_is_refused_not_labelled_fp32(tmp_path, target, precision, io_fp16):
    """Found by a user: an fp16 ONNX built with `-p fp32` shipped as the variant "fp32" (manifest and report), and
    `-p auto` / the fp32 variant beside a compressed one did the same; TensorRT and ORT ran it in fp16."""
    model = _fp16_onnx(tmp_path / "m16.onnx", io_fp16)
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=r"the model holds fp16 weights \(2 of 2 float weight tensors, e.g. 'w1'\): "
                                          r"dsedge build needs the fp32 model") as e:
        build(BuildOptions(model=str(model), target=target, out_dir=str(out), precision=precision,
                           latency_iterations=3))
    assert "-p fp16 makes the fp16 variant" in e.value.hint
    assert not out.exists() or list(out.iterdir()) == []


def test_quantized_onnx_source_is_refused_not_labelled_fp32(tmp_path):
    from dsedge.toolchain.quantize.compress import compress

    q = tmp_path / "q.onnx"
    onnx.save(compress(onnx.load(str(mlp_onnx(tmp_path / "m.onnx"))), "int4-rtn").model, str(q))
    with pytest.raises(SourceError, match=r"holds quantized layers \(2 DequantizeLinear nodes\)"):
        build(BuildOptions(model=str(q), target="cpu", out_dir=str(tmp_path / "out"), precision="fp32"))


def test_callable_source_exports_with_dynamic_batch(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))\n"
        "    return m, {'features': torch.randn(4, 16)}\n")
    monkeypatch.chdir(tmp_path)
    r = build(BuildOptions(model="mymodels:make", target="cpu", out_dir="out", precision="int4", latency_iterations=3))
    m = verify_bundle(r.bundle)
    assert m.inputs[0].name == "features" and m.inputs[0].shape[0] == "batch"
    assert r.bundle.name == "mymodels-make-cpu.dse" and [o.name for o in m.outputs] == ["output"]
    assert r.report["export"]["parity_max_abs_diff"] < 1e-4
    s = dsedge.load(r.bundle)
    assert s.run({"features": np.ones((7, 16), np.float32)})[s.outputs[0].name].shape == (7, 3)


@pytest.mark.parametrize("opts, error, message", [
    (dict(target="nowhere"), TargetError, "unknown target 'nowhere'"),
    (dict(model="missing.onnx"), SourceError, "does not exist"),
    (dict(target="cpu", precision="fp16"), PrecisionNotSupported, "cpu does not support fp16"),
])
def test_bad_build_inputs_write_nothing(tmp_path, opts, error, message):
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        build(BuildOptions(out_dir=str(out), **opts))
    assert not out.exists() or list(out.iterdir()) == []


def test_not_onnx_and_unknown_directory(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(SourceError, match="is not a valid ONNX model"):
        build(BuildOptions(model=str(bad), target="cpu", out_dir=str(tmp_path / "o"), precision="int4"))
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(SourceError, match="is not an ONNX file"):
        build(BuildOptions(model=str(tmp_path / "weights.pt"), target="cpu", out_dir=str(tmp_path / "o")))
    with pytest.raises(SourceError, match="not a Hugging Face model"):
        build(BuildOptions(model=str(tmp_path), target="cpu", out_dir=str(tmp_path / "o")))


@pytest.mark.slow
def test_hugging_face_directory_source(tmp_path):
    """A local HF directory (a tiny BERT with the reference tokenizer) builds like the reference model."""
    from tiny_models import tiny_bert_dir

    d = tiny_bert_dir(tmp_path / "Tiny_Bert", hidden=64)
    r = build(BuildOptions(model=str(d), target="cpu", out_dir=str(tmp_path / "o"), precision="int4",
                           latency_iterations=3, keep_fp32=False))
    assert r.bundle.name == "tiny-bert-cpu.dse"
    assert r.report["validation"]["inputs"].startswith("held-out real inputs")
    assert r.report["variants"][0]["accuracy"]["n"] == 60
    (d / "model.safetensors").unlink()
    with pytest.raises(SourceError, match="no model.safetensors"):
        build(BuildOptions(model=str(d), target="cpu", out_dir=str(tmp_path / "o")))


@pytest.mark.parametrize("target, dla, message", [("cpu", 0, "cpu has no DLA"), ("jetson", 2, "not 2")])
def test_dla_on_a_target_without_it_is_refused(tmp_path, target, dla, message):
    with pytest.raises(TargetError, match=message):
        build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target=target, dla_core=dla,
                           out_dir=str(tmp_path / "o")))


def test_xavier_bundle_is_opset_17_and_int4_is_refused(tmp_path):
    model = str(mlp_onnx(tmp_path / "m.onnx"))
    r = build(BuildOptions(model=model, target="jetson-xavier", out_dir=str(tmp_path / "o"), latency_iterations=3))
    assert r.report["export"]["opset"] == 17 and r.report["precision"] != "int4"
    assert onnx.load(str(r.bundle / "models" / f"{r.report['precision']}.onnx")).opset_import[0].version == 17
    with pytest.raises(PrecisionNotSupported, match="jetson-xavier does not support int4"):
        build(BuildOptions(model=model, target="jetson-xavier", precision="int4", out_dir=str(tmp_path / "o")))


def test_engine_build_without_tensorrt_fails_before_writing(tmp_path):
    from dsedge.runtime.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="TensorRT is not installed"):
        build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="jetson", engine=True,
                           out_dir=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_reference_bundle_refuses_token_ids_outside_the_vocabulary(reference_build):
    from dsedge.runtime.errors import InputError

    s = dsedge.load(reference_build.bundle)
    spec = {i.name: i for i in s.inputs}
    assert spec["input_ids"].value_range == (0, 30521) and spec["token_type_ids"].value_range == (0, 1)
    ids = np.array([[101, 30522, 102]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    with pytest.raises(InputError, match="'input_ids' holds 30522, outside the model's range"):
        s.run(feeds)
    feeds["input_ids"] = np.array([[101, 2000, 102]], np.int64)
    feeds["token_type_ids"] = np.full_like(ids, 5)
    with pytest.raises(InputError, match="'token_type_ids' holds 5"):
        s.run(feeds)


def test_fallback_steps_down_to_what_the_target_and_this_version_build(tmp_path):
    r = build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="t4", precision="int4", fallback=True,
                           out_dir=str(tmp_path / "o"), latency_iterations=3))
    assert r.report["precision"] in ("int8", "fp16", "fp32")
    assert any("fell back" in n for n in r.report["notes"])


def test_calib_arrays_with_the_wrong_dtype_are_a_calibration_error(tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    np.savez(calib / "a.npz", x=np.zeros((4, 64), np.float64))
    with pytest.raises(CalibrationError, match="a.npz: input 'x' has dtype float64"):
        build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="cpu", precision="int4",
                           calib=str(calib), out_dir=str(tmp_path / "o")))


def test_cpu_auto_measures_each_precision_and_keeps_the_fastest_accurate_one(tmp_path):
    r = build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="cpu", out_dir=str(tmp_path / "o"),
                           latency_iterations=5))
    choice = r.report["precision_choice"]
    measured = [c for c in choice["candidates"] if "b1_p50_ms" in c]
    assert {c["precision"] for c in measured} >= {"int4", "fp32"}
    qualified = [c for c in measured if c["qualifies"]]
    assert all(c["cosine_mean"] >= 0.99 for c in qualified if c["precision"] != "fp32")
    from dsedge.toolchain.stages.auto import AUTO_MIN_SPEEDUP

    fp32 = next(c["b1_p50_ms"] for c in measured if c["precision"] == "fp32")
    fast = [c for c in qualified if c["precision"] == "fp32" or fp32 / c["b1_p50_ms"] >= AUTO_MIN_SPEEDUP]
    assert choice["chosen"] == r.report["precision"] == min(fast, key=lambda c: c["b1_p50_ms"])["precision"]
    assert choice["why"].startswith(f"auto: {choice['chosen']} (") and "timed side by side" in choice["why"]
    assert "by measured latency" in r.report["notes"][0]
    chosen = next(v for v in r.report["variants"] if v["name"] == choice["chosen"])
    assert chosen["latency_ms"]["1"]["p50"] == next(c for c in measured if c["precision"] == choice["chosen"])["b1_p50_ms"]
    # timed as the runtime serves here (one of its instances' thread count), and the record says so
    from dsedge.runtime.instances import serving_threads

    assert all(v["latency_ms"]["1"]["threads"] == serving_threads() for v in r.report["variants"])
    assert "one serving instance's here" in choice["why"]


def test_dla_that_a_variant_cannot_use_is_said_on_the_terminal(tmp_path):
    """A user's pass: `--dla 1 --precision fp32` exited 0 with DLA dropped, said only in trtexec.sh and report.json."""
    lines: list[str] = []
    r = build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target="jetson", out_dir=str(tmp_path / "o"),
                           precision="fp32", dla_core=1, latency_iterations=2), log=lines.append)
    assert "fp32 builds for the GPU instead of DLA core 1" in " ".join(r.report["engine_recipe"]["fp32"])
    assert [x for x in lines if x.startswith("note: fp32: DLA runs INT8/FP16 only")], lines
