"""Every field of a manifest, profile and report validated at write and read; names that become paths; files a model
reads from outside the hashes."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import dsedge
from dsedge.runtime import schema
from dsedge.runtime.bundle import MANIFEST, hash_files, read_manifest, verify_bundle
from dsedge.runtime.errors import BundleError, BundleIntegrityError, DsedgeError, TargetError
from dsedge.targets import load_profile
from tiny_models import embedding_onnx, mlp_onnx, tiny_bundle

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bundle(tmp_path):
    return tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)


def rewrite_manifest(bundle: Path, edit, text: str | None = None) -> None:
    """Edit manifest.json and recompute every hash, as an attacker or a careless script would: it still verifies
    by hash."""
    d = json.loads((bundle / MANIFEST).read_text())
    edit(d)
    d["files"] = hash_files(bundle)
    (bundle / MANIFEST).write_text(text if text is not None else json.dumps(d))


def test_schemas_shipped_in_the_package_equal_the_published_copies():
    for kind in schema.KINDS:
        shipped = json.loads((REPO / "runtime" / "schemas" / f"{kind}.schema.json").read_text())
        published = json.loads((REPO / "docs" / "schemas" / f"{kind}.schema.json").read_text())
        assert shipped == published, kind
        assert shipped["title"] == schema.SCHEMA_IDS[kind] == f"dsedge.{kind}/1"
        schema._validator(kind)  # a valid Draft 2020-12 schema


def test_written_documents_carry_their_schema_names(bundle):
    m = json.loads((bundle / MANIFEST).read_text())
    assert m["schema"] == "dsedge.manifest/1" and not schema.problems("manifest", m, root=bundle)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["shape_ranges"].update(batch={"min": -5, "max": 10**12}), "shape_ranges.batch.min"),
    (lambda d: d["shape_ranges"].update(batch={"min": -5, "max": 8}), "shape_ranges.batch.min"),
    (lambda d: d["shape_ranges"].update(batch={"min": 9, "opt": 8, "max": 32}), "shape_ranges.batch"),
    (lambda d: d["shape_ranges"].update(batch={"min": "1", "max": 8}), "shape_ranges.batch.min"),
    (lambda d: d["shape_ranges"].update(batch={"min": 1.5, "max": 8}), "shape_ranges.batch.min"),
    (lambda d: d.update(latency_budget_ms=-1), "latency_budget_ms"),
    (lambda d: d.update(latency_budget_ms="5"), "latency_budget_ms"),
    (lambda d: d["variants"][0].update(size_bytes=-1), "variants[0].size_bytes"),
    (lambda d: d["inputs"][0].update(value_range=[5, 1]), "inputs[0].value_range"),
    (lambda d: d["target"].update(default_budget_ms=0), "target.default_budget_ms"),
    (lambda d: d["variants"].append(dict(d["variants"][0])), "variants[1].name"),
    (lambda d: d["variants"][0].update(file="/etc/passwd"), "variants[0].file"),
    (lambda d: d["variants"][0].update(name="../x"), "variants[0].name"),
    (lambda d: d.update(name="/../../ESCAPED"), "name"),
    (lambda d: d.update(surprise=1), "(root)"),
    # build-time latency: a batch of 0 made submit() divide by zero; a negative figure was taken as a speed
    (lambda d: d["variants"][0].update(latency_ms={"0": {"p50": 1.0}}), "variants[0].latency_ms"),
    (lambda d: d["variants"][0].update(latency_ms={"1": {"p50": -1.0}}), "variants[0].latency_ms.1"),
    (lambda d: d["variants"][0].update(latency_ms={"8x0": 2.0}), "variants[0].latency_ms"),
    (lambda d: d["variants"][0].update(latency_ms={"1": -2.0}), "variants[0].latency_ms.1"),
    (lambda d: d["variants"][0].update(latency_ms={"1": 10**400}), "variants[0].latency_ms.1"),  # OverflowError
])
def test_numbers_and_names_in_a_rehashed_manifest_are_refused_naming_the_field(bundle, edit, field):
    rewrite_manifest(bundle, edit)
    with pytest.raises(BundleError, match=re.escape(f"manifest.json field {field}")):
        dsedge.load(bundle)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_numbers_are_refused(bundle, constant):
    rewrite_manifest(bundle, lambda d: None,
                     text=(bundle / MANIFEST).read_text().replace('"latency_budget_ms": 5.0', f'"latency_budget_ms": {constant}'))
    assert constant in (bundle / MANIFEST).read_text()
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(bundle)


def test_a_key_repeated_in_the_manifest_is_refused(bundle):
    """A user's pass: {"name": "a", ..., "name": "b"} loaded as "b" (Python keeps the last; another reader, or a
    signer, may keep the first)."""
    text = (bundle / MANIFEST).read_text()
    (bundle / MANIFEST).write_text(text.replace('"schema":', '"latency_budget_ms": 5.0, "schema":', 1))
    with pytest.raises(BundleError, match="key 'latency_budget_ms' appears twice in one object"):
        dsedge.load(bundle)


def test_huge_batch_range_never_reaches_an_allocation(bundle):
    """Before: the first submit() died in a raw MemoryError allocating the profile's largest batch."""
    rewrite_manifest(bundle, lambda d: d["shape_ranges"].update(batch={"min": 1, "opt": 8, "max": 10**12}))
    with pytest.raises(BundleError, match="shape_ranges.batch.max: 1000000000000 is greater than the maximum"):
        dsedge.load(bundle)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_manifest_with_a_bad_number_is_never_written(tmp_path, bad):
    with pytest.raises(BundleError, match="latency_budget_ms"):
        _bundle_with_budget(tmp_path, bad)
    assert not (tmp_path / "mlp-cpu.dse").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp litter either


def _bundle_with_budget(tmp_path, budget):
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    return write_bundle(tmp_path / "mlp-cpu.dse", name="mlp", target={"name": "cpu"},
                        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                        models={"models/fp32.onnx": mlp_onnx(tmp_path / "m.onnx")},
                        variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32",
                        shape_ranges={"batch": {"min": 1, "opt": 8, "max": 32}}, latency_budget_ms=budget)


def test_report_with_nan_is_never_written(tmp_path):
    with pytest.raises(BundleError, match=r"report.json field wall_time_s: is nan"):
        tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path, report={
            "schema": "dsedge.build-report/1", "bundle": "mlp-cpu.dse", "target": "cpu", "precision": "fp32",
            "variants": [{"name": "fp32", "precision": "fp32"}], "wall_time_s": float("nan")})
    assert not (tmp_path / "mlp-cpu.dse").exists()


PROFILE = 'name = "my-dev"\nbackend = "onnxruntime"\nprecisions = ["fp32"]\n'


@pytest.mark.parametrize("extra, field", [
    ("default_budget_ms = nan\n", "default_budget_ms: is nan"),
    ("default_budget_ms = inf\n", "default_budget_ms: is inf"),
    ("default_budget_ms = -3.0\n", "default_budget_ms"),
    ('shapes = { batch = { min = "1", opt = 8, max = 32 } }\n', "shapes.batch.min"),
    ("shapes = { batch = { min = 1.5, opt = 8, max = 32 } }\n", "shapes.batch.min"),
    ("shapes = { batch = { min = -5, opt = 8, max = 1000000000000 } }\n", "shapes.batch"),
    ("shapes = { batch = { min = 8, opt = 4, max = 32 } }\n", "shapes.batch: needs min <= opt <= max"),
    ("dla_cores = 1.5\n", "dla_cores"),
    ("workspace_mb = true\n", "workspace_mb"),
    ('aliases = ["../up"]\n', r"aliases\[0\]"),
])
def test_profile_numbers_are_checked_before_any_build(tmp_path, extra, field):
    p = tmp_path / "dev.toml"
    p.write_text(PROFILE + extra)
    with pytest.raises(TargetError, match=f"target profile dev.toml field {field}"):
        load_profile(p)


def test_profile_name_escaping_out_is_refused_and_nothing_is_written(tmp_path):
    """Before: `--target` with name "/../../ESCAPED" and `--out O/sub` wrote O/ESCAPED.dse."""
    p = tmp_path / "evil.toml"
    p.write_text(PROFILE.replace('"my-dev"', '"/../../ESCAPED"'))
    out = tmp_path / "O" / "sub"
    r = subprocess.run([sys.executable, "-m", "dsedge.cli", "build", "--model", str(mlp_onnx(tmp_path / "m.onnx")),
                        "--target", str(p), "--out", str(out), "--precision", "fp32"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "field name: '/../../ESCAPED' is not a safe name" in r.stderr
    assert not (tmp_path / "O").exists() and not list(tmp_path.rglob("*ESCAPED*"))


def test_bundle_path_refuses_unsafe_names_and_source_names_are_made_safe(tmp_path):
    from dsedge.runtime.names import safe_model_name
    from dsedge.toolchain.bundle_writer import bundle_path

    for name, target in (("../x", "cpu"), ("m", "../../x"), ("m", "a/b"), (".hidden", "cpu"), ("-rf", "cpu")):
        with pytest.raises(BundleError, match="is not a safe name"):
            bundle_path(tmp_path, name, target)
    assert bundle_path(tmp_path, "mlp", "cpu") == tmp_path / "mlp-cpu.dse"
    assert safe_model_name("My Model (v2)") == "my-model-v2" and safe_model_name("..evil") == "evil"
    with pytest.raises(DsedgeError):
        safe_model_name("...")


def _external(bundle: Path, location: str, data_file: Path | None = None) -> None:
    """Rewrite the fp32 model so w1 reads its bytes from ``location``; rehash the manifest."""
    from onnx import TensorProto

    path = bundle / "models" / "fp32.onnx"
    model = onnx.load(str(path))
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    raw = onnx.numpy_helper.to_array(w1).tobytes()
    if data_file is not None:
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_bytes(raw)
    w1.ClearField("float_data")
    w1.ClearField("raw_data")
    w1.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        e = w1.external_data.add()
        e.key, e.value = k, v
    onnx.save(model, str(path))
    rewrite_manifest(bundle, lambda d: None)


@pytest.mark.parametrize("where", ["../../x.bin", "ABS"])
def test_external_data_outside_the_bundle_fails_load_and_inspect(bundle, tmp_path, where):
    """Before: load refused (by accident of ORT) but `dsedge inspect` exited 0 and said "verified"."""
    outside = tmp_path / "x.bin"
    location = str(outside) if where == "ABS" else where
    _external(bundle, location, data_file=outside if where == "ABS" else bundle.parent.parent / "x.bin")
    with pytest.raises(BundleIntegrityError, match="reads external data from"):
        verify_bundle(bundle)
    with pytest.raises(BundleIntegrityError):
        dsedge.load(bundle)
    r = subprocess.run([sys.executable, "-m", "dsedge.cli", "inspect", str(bundle)], capture_output=True, text=True)
    assert r.returncode == 2 and "reads external data" in r.stderr and "verified" not in r.stdout


def test_external_data_inside_the_bundle_must_be_hash_listed(bundle):
    data = bundle / "models" / "w1.bin"
    _external(bundle, "w1.bin", data_file=data)      # rehashed: listed, so it loads and runs
    s = dsedge.load(bundle)
    assert s.run({"x": np.ones((1, 64), np.float32)})["logits"].shape == (1, 4)
    m = json.loads((bundle / MANIFEST).read_text())
    m["files"].pop("models/w1.bin")
    (bundle / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleIntegrityError, match="hashes do not cover"):
        verify_bundle(bundle)


def test_a_link_out_of_the_bundle_is_refused(bundle, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    (bundle / "build").mkdir(exist_ok=True)
    (bundle / "build" / "leak.txt").symlink_to(secret)
    rewrite_manifest(bundle, lambda d: None)
    with pytest.raises(BundleIntegrityError, match="resolves outside"):
        verify_bundle(bundle)


def test_onnx_source_gets_its_vocabulary_bound_from_the_gather_table(tmp_path):
    """Before: value_range null; INT4 returned finite garbage for ids >= vocab and fp32 a raw ORT error."""
    from dsedge.runtime.errors import InputError
    from dsedge.toolchain.pipeline import BuildOptions, build

    r = build(BuildOptions(model=str(embedding_onnx(tmp_path / "emb.onnx", vocab=2048)), target="cpu",
                           out_dir=str(tmp_path / "o"), precision="int4", latency_iterations=3))
    m = read_manifest(r.bundle)
    assert m.inputs[0].value_range == (0, 2047) and r.report["source"]["vocab_size"] == 2048
    for variant in ("int4", "fp32"):
        s = dsedge.load(r.bundle, variant=variant)
        assert s.run({"ids": np.array([[0, 2047]], np.int64)})["out"].shape == (1, 2, 64)
        for bad in (2048, 40000, 10**6, 10**12, -5):
            with pytest.raises(InputError, match="outside the model's range"):
                s.run({"ids": np.array([[1, bad]], np.int64)})


def test_a_manifest_that_is_a_link_out_is_refused(bundle, tmp_path):
    elsewhere = tmp_path / "m.json"
    elsewhere.write_text((bundle / MANIFEST).read_text())
    (bundle / MANIFEST).unlink()
    (bundle / MANIFEST).symlink_to(elsewhere)
    with pytest.raises(BundleError, match="is a link"):
        read_manifest(bundle)


def test_a_model_reading_data_from_outside_is_never_bundled(tmp_path):
    from onnx import TensorProto

    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    src = mlp_onnx(tmp_path / "m.onnx")
    model = onnx.load(str(src))
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    raw = onnx.numpy_helper.to_array(w1).tobytes()
    (tmp_path / "w1.bin").write_bytes(raw)
    w1.ClearField("raw_data")
    w1.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w1.bin"), ("offset", "0"), ("length", str(len(raw)))):
        e = w1.external_data.add()
        e.key, e.value = k, v
    onnx.save(model, str(src))
    with pytest.raises(DsedgeError):
        write_bundle(tmp_path / "b.dse", name="b", target={"name": "cpu"},
                     inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                     models={"models/fp32.onnx": src}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                     default_variant="fp32")
    assert not (tmp_path / "b.dse").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("rel", ["../escape.txt", "/tmp/abs.txt", "build/../../x", ".hidden/x"])
def test_the_writer_refuses_bundle_files_outside_the_bundle(tmp_path, rel):
    with pytest.raises(BundleError, match="is not a safe relative path"):
        tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path, extra_files={rel: "x"})
    assert not (tmp_path / "mlp-cpu.dse").exists() and not (tmp_path / "escape.txt").exists()


def test_deeply_nested_documents_fail_in_one_line(bundle, tmp_path):
    """Found beyond the issue: a manifest, profile or baseline nested 10^5 deep died in a raw RecursionError."""
    (bundle / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="nests deeper"):
        read_manifest(bundle)
    p = tmp_path / "deep.toml"
    p.write_text('name = "x"\nnotes = ' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TargetError, match="nests too deeply"):
        load_profile(p)
    from dsedge.runtime.bench import load_report
    from dsedge.runtime.errors import BenchError

    (tmp_path / "base.json").write_text("[" * 100_000)
    with pytest.raises(BenchError, match="not valid JSON"):
        load_report(tmp_path / "base.json")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [MANIFEST, "manifest.sig"])
@pytest.mark.parametrize("command", [["bench", "{bundle}", "--iterations", "2", "-o"],
                                     ["bench", "{bundle}", "--iterations", "2", "--plot"],
                                     ["quantize", "{model}", "--precision", "fp16", "-o"],
                                     ["quantize", "{model}", "--precision", "fp16", "-o", "{tmp}/q.onnx", "--report"],
                                     ["prune", "{model}", "-o"]])
def test_an_output_path_that_is_the_bundles_manifest_or_signature_is_refused(bundle, tmp_path, capsys, command,
                                                                            name):
    """Found by a user: `dsedge bench B.dse -o B.dse/manifest.json` exited 0 having replaced the manifest with the
    bench report (the bundle no longer loaded), and quantize did the same, then a traceback: manifest.json and
    manifest.sig are not in manifest["files"], so the hash-listed-file guard missed them."""
    from cli_helpers import run_main

    before = _snapshot(bundle)
    args = [a.format(bundle=bundle, model=bundle / "models" / "fp32.onnx", tmp=tmp_path) for a in command]
    code, out, err = run_main([*args, bundle / name], capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.startswith("error: ") and "is a file of the bundle" in err and "\n  hint: write elsewhere" in err, err
    assert len(err.strip().splitlines()) == 2, err                  # error line + hint line
    assert _snapshot(bundle) == before and not (tmp_path / "q.onnx").exists()
    assert verify_bundle(bundle).variant().name == "fp32"


def test_a_manifest_json_outside_any_bundle_may_be_written_again(bundle, tmp_path, capsys):
    """The manifest guard needs a bundle (a manifest with a files table, or a .dse folder): a bench report named
    manifest.json in a plain folder is rewritten by the next run."""
    from cli_helpers import run_main

    out = tmp_path / "reports" / MANIFEST
    for _ in range(2):
        code, _, err = run_main(["bench", bundle, "--iterations", "2", "-q", "-o", out], capsys)
        assert code in (0, 1) and "Traceback" not in err, err       # 1: over the tiny budget on a busy machine
        assert json.loads(out.read_text())["schema"].startswith("dsedge.bench-report/")
