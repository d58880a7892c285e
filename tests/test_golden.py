"""Golden I/O: every built bundle carries held-out inputs, fp32 reference outputs and per-variant tolerances;
`dsedge verify` and `load(check_outputs=True)` pass on what was built and fail on a perturbed variant (real ORT CPU)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import dsedge
from dsedge.cli import main
from dsedge.runtime.bundle import read_manifest, verify_bundle, write_manifest
from dsedge.runtime.errors import BundleError, OutputMismatchError
from dsedge.runtime.golden import INPUTS_FILE, OUTPUTS_FILE, load_golden, run_rows
from dsedge.toolchain.golden import CAP_BYTES, fit_cap
from dsedge.toolchain.pipeline import BuildOptions, build
from tiny_models import mlp_onnx


@pytest.fixture(scope="module")
def mlp_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    rng = np.random.default_rng(0)
    for part in ("calib", "heldout"):
        (tmp / part).mkdir()
        np.savez(tmp / part / "a.npz", x=rng.standard_normal((24, 64)).astype(np.float32))
    r = build(BuildOptions(model=str(mlp_onnx(tmp / "clf.onnx")), target="cpu", out_dir=str(tmp / "out"),
                           precision="int4", calib=str(tmp / "calib"), heldout=str(tmp / "heldout"),
                           latency_iterations=2))
    return r.bundle


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_build_writes_hash_listed_golden_io_and_per_variant_tolerances(mlp_bundle):
    m = verify_bundle(mlp_bundle)
    assert {INPUTS_FILE, OUTPUTS_FILE, "golden/golden.json"} <= set(m.files)
    g = load_golden(mlp_bundle, m)
    assert g.rows == 8 and g.inputs["x"].shape == (8, 64) and g.outputs["logits"].shape == (8, 4)
    heldout = np.load(mlp_bundle.parent.parent / "heldout" / "a.npz")["x"]
    assert np.array_equal(g.inputs["x"][0], heldout[0]) and np.array_equal(g.inputs["x"][-1], heldout[-1])
    size = sum((mlp_bundle / f).stat().st_size for f in (INPUTS_FILE, OUTPUTS_FILE))
    assert size == g.info["bytes"] < CAP_BYTES
    int4, fp32 = m.variant("int4").golden["logits"], m.variant("fp32").golden["logits"]
    assert 0.9 < int4["cosine_min"] < 1.0 and int4["measured_max_abs_diff"] > 0
    assert fp32["cosine_min"] == 1.0 and fp32["measured_max_abs_diff"] == 0.0
    assert fp32["max_abs_diff"] == pytest.approx(0.01 * np.abs(g.outputs["logits"]).max(), rel=1e-3)  # the floor


def test_verify_passes_here_and_load_checks_outputs(mlp_bundle, capsys):
    code, out, _ = cli(capsys, "verify", str(mlp_bundle), "--variant", "all", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["passed"] and [v["variant"] for v in rep["variants"]] == ["int4", "fp32"]
    o = rep["variants"][0]["outputs"]["logits"]
    assert rep["variants"][0]["providers"] == ["CPUExecutionProvider"]
    assert o["cosine_min"] == pytest.approx(o["cosine_min_build"], abs=1e-5) and o["ok"]
    s = dsedge.load(mlp_bundle, check_outputs=True)
    assert s.run({"x": np.zeros((1, 64), np.float32)})["logits"].shape == (1, 4)


def test_verify_checks_a_variant_named_twice_once_in_the_order_given(mlp_bundle, capsys):
    """Found by a user: `dsedge verify B --variant fp32 --variant fp32` loaded and checked fp32 twice."""
    code, out, _ = cli(capsys, "verify", str(mlp_bundle), "--variant", "fp32", "--variant", "int4", "--variant", "fp32",
                       "--json")
    rep = json.loads(out)
    assert code == 0 and [v["variant"] for v in rep["variants"]] == ["fp32", "int4"]


def test_a_perturbed_variant_fails_verify_and_check_outputs(mlp_bundle, tmp_path, capsys):
    bad = shutil.copytree(mlp_bundle, tmp_path / "bad.dse")
    model = onnx.load(str(bad / "models/fp32.onnx"))
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    arr = numpy_helper.to_array(w1)
    w1.CopyFrom(numpy_helper.from_array(arr + np.random.default_rng(1).normal(0, 0.05, arr.shape).astype(np.float32),
                                        "w1"))
    onnx.save(model, str(bad / "models/fp32.onnx"))
    m = read_manifest(bad)
    write_manifest(bad, m)  # re-hashed: the bundle verifies, only its answers are wrong
    code, out, _ = cli(capsys, "verify", str(bad), "--variant", "fp32")
    assert code == 1 and "FAIL" in out and "NO" in out
    code, out, _ = cli(capsys, "verify", str(bad), "--variant", "int4", "--json")
    assert code == 0  # the untouched variant still passes
    with pytest.raises(OutputMismatchError, match=r"fp32.*logits: cosine min 0\.\d+ < allowed 0\.995"):
        dsedge.load(bad, variant="fp32", check_outputs=True)


def test_bundle_without_golden_is_reported_not_passed(mlp_bundle, tmp_path, capsys):
    old = shutil.copytree(mlp_bundle, tmp_path / "old.dse")
    shutil.rmtree(old / "golden")
    write_manifest(old, read_manifest(old))
    code, _, err = cli(capsys, "verify", str(old))
    assert code == 2 and "no golden I/O" in err
    with pytest.raises(BundleError, match="no golden I/O"):
        dsedge.load(old, check_outputs=True)


def _zip(path, members):
    import zipfile

    path.unlink()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _npy_header(shape, descr):
    """The bytes of a ``.npy`` header (magic included) declaring ``shape`` of ``descr``, and no data after it."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.mark.parametrize("tamper, words", [
    (lambda g: (g / "golden.json").write_text("{"), "golden/golden.json is not valid JSON"),
    (lambda g: (g / "golden.json").write_text("[1, 2]"), "holds a list, not a JSON object"),
    (lambda g: np.savez(g / "inputs.npz", x=np.load(g / "inputs.npz")["x"].astype(np.float64)),
     "golden input 'x' is float64 [8, 64], the manifest's input is float32"),
    (lambda g: np.savez(g / "outputs.npz", logits=np.load(g / "outputs.npz")["logits"][:3]), "x 8, logits 3 rows"),
    (lambda g: np.savez(g / "inputs.npz", x=np.zeros((0, 64), np.float32)), "x 0, logits 8 rows"),
    (lambda g: np.savez(g / "outputs.npz", logits=np.zeros((8, 4), np.float32), probs=np.zeros((8, 4), np.float32)),
     "golden output 'probs' is not an output of the bundle"),
    (lambda g: _zip(g / "inputs.npz", {"x.npy": b"not an npy"}), "member 'x' is not a .npy array"),
    (lambda g: _zip(g / "inputs.npz", {"x.npy": _npy_header((1 << 20, 1 << 10), "<f4")}),  # declares 4 GiB
     "its arrays declare 4294967296 bytes, more than the 67108864 allowed here"),
])
def test_malformed_golden_io_cannot_be_checked_exit_2(mlp_bundle, tmp_path, capsys, tamper, words):
    """Found by a user: golden files that are hash-listed but malformed (written by hand or by another tool, then
    re-hashed) gave a JSONDecodeError/AttributeError or ONNX Runtime traceback, or "outside tolerance" (exit 1) for
    rows that do not pair up. They are a bundle that cannot be checked: one line, exit 2."""
    bad = shutil.copytree(mlp_bundle, tmp_path / "bad.dse")
    tamper(bad / "golden")
    write_manifest(bad, read_manifest(bad))  # re-hashed: the bundle verifies
    code, out, err = cli(capsys, "verify", str(bad))
    assert code == 2 and words in err and "Traceback" not in err + out, err
    with pytest.raises(BundleError, match="golden"):
        dsedge.load(bad, check_outputs=True)


def test_cap_leaves_out_big_outputs_first_then_halves_rows():
    ins = {"ids": np.zeros((8, 128), np.int64)}  # 8 KiB
    outs = {"last_hidden_state": np.zeros((8, 128, 384), np.float32), "sentence_embedding": np.zeros((8, 384), np.float32)}
    assert fit_cap(ins, outs) == (8, ["sentence_embedding"])
    assert fit_cap(ins, {"big": np.zeros((8, 100_000), np.float32)}) == (1, ["big"])  # one row stays


def test_rows_run_in_engine_sized_calls_padded_to_a_static_batch():
    calls = []

    def run(feed):
        calls.append(len(feed["x"]))
        return {"y": feed["x"] * 2}

    out = run_rows(run, {"x": np.arange(5, dtype=np.float32)[:, None]}, (4, 4))
    assert calls == [4, 4] and out["y"][:, 0].tolist() == [0, 2, 4, 6, 8]


def test_reference_bundle_carries_golden_io_and_verifies(reference_build, capsys):
    code, out, _ = cli(capsys, "verify", str(reference_build.bundle), "--variant", "all", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["passed"], out
    assert rep["rows"] == 8 and rep["left_out"] == []  # 8 real held-out sentences, both outputs under the cap
    for v in rep["variants"]:
        assert set(v["outputs"]) == {"last_hidden_state", "sentence_embedding"} and v["passed"]
    g = load_golden(reference_build.bundle, verify_bundle(reference_build.bundle))
    assert g.info["bytes"] <= CAP_BYTES and g.info["from"].startswith("held-out real inputs")


def test_sign_refuses_a_bundle_whose_golden_io_verify_would_refuse(mlp_bundle, tmp_path, capsys):
    """A user's pass: `dsedge sign` signed a bundle whose golden/golden.json nested 100,000 deep (hash-listed),
    which `dsedge verify` then refused: a corrupt bundle is never signed."""
    import hashlib

    pytest.importorskip("cryptography")
    from dsedge.runtime.signing import generate_key

    priv, _ = generate_key(tmp_path / "keys" / "release")
    b = shutil.copytree(mlp_bundle, tmp_path / "b.dse")
    info = b / "golden" / "golden.json"
    info.write_text("[" * 100_000 + "]" * 100_000)
    m = read_manifest(b)
    m.files["golden/golden.json"] = hashlib.sha256(info.read_bytes()).hexdigest()
    write_manifest(b, m)
    code, out, err = cli(capsys, "sign", str(b), "--key", str(priv))
    assert code == 2 and "golden.json is not valid JSON" in err and "Traceback" not in err, err
    assert not (b / "manifest.sig").exists()
