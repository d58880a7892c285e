"""A rank-0 (scalar) input beside a batched one in ``--calib`` / ``--heldout`` directories (``read_npz_dir``): one value
in every file, returned once and fed unchanged with every batch the toolchain cuts (calibration, held-out gate, the
build's evaluation); and a rank-0 output (a loss, a count) in golden I/O: stored once, compared with every call's
value. Real ONNX models (onnx.helper), real ONNX Runtime, real files.

The model's scalar input comes FIRST (``temperature``, then ``x``): rows are counted from the first batched input,
not from the first input."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cli_helpers import run_main
from dsedge.runtime.bundle import Variant, read_manifest, verify_bundle, write_manifest
from dsedge.runtime.errors import CalibrationError
from dsedge.runtime.golden import INPUTS_FILE, OUTPUTS_FILE, compare, load_golden, run_rows
from dsedge.toolchain.npz_inputs import count_samples, load_calibration_dir, read_npz_dir

from scalar_models import SPECS, W, npz_dir, scalar_model, stacked_x


def _model(path, total: bool = False):
    """The scalar model (tests/scalar_models.py): output y, and with ``total`` also the rank-0 total."""
    return scalar_model(path, ("y", "total") if total else ("y",))


def _npz_dir(d, rows=(6, 6), temperatures=(2.0, 2.0), seed=1):
    return npz_dir(d, rows, temperatures, seed)


_x = stacked_x


# ------------------------------------------------------------------------------------------------ read_npz_dir


def test_a_scalar_held_by_every_file_is_returned_once_rank_0_and_rows_come_from_x(tmp_path):
    d = _npz_dir(tmp_path / "calib", rows=(5, 7))
    data = read_npz_dir(d, SPECS)
    assert data["temperature"].shape == () and data["temperature"].dtype == np.float32
    assert float(data["temperature"]) == 2.0
    assert data["x"].shape == (12, 4) and np.array_equal(data["x"], _x(d))
    assert count_samples(data) == 12
    calib, val = load_calibration_dir(d, SPECS)  # the halves both carry the one value
    assert calib["x"].shape == (6, 4) and val["x"].shape == (6, 4)
    assert calib["temperature"].shape == val["temperature"].shape == () and float(val["temperature"]) == 2.0


def test_a_scalar_that_differs_between_files_is_a_calibration_error(tmp_path):
    d = _npz_dir(tmp_path / "calib", temperatures=(2.0, 0.5))
    with pytest.raises(CalibrationError) as e:
        read_npz_dir(d, SPECS, what="held-out")
    msg = str(e.value)
    assert "held-out input 'temperature' is rank-0" in msg and "2.0 in 0.npz but 0.5 in 1.npz" in msg
    assert "\n" not in e.value.message and "save one value of 'temperature'" in e.value.hint


def test_a_model_whose_inputs_are_all_rank_0_has_no_samples_to_read(tmp_path):
    d = tmp_path / "calib"
    d.mkdir()
    np.savez(d / "a.npz", temperature=np.array(2.0, np.float32))
    with pytest.raises(CalibrationError, match="'temperature' are all rank-0") as e:
        read_npz_dir(d, SPECS[:1])
    assert "drop --calib" in e.value.hint and "batched input" in e.value.hint


def test_a_scalar_saved_with_a_batch_axis_is_refused_as_a_shape_mismatch(tmp_path):
    d = tmp_path / "calib"
    d.mkdir()
    np.savez(d / "a.npz", x=np.zeros((3, 4), np.float32), temperature=np.full(3, 2.0, np.float32))
    with pytest.raises(CalibrationError, match=r"'temperature' has shape \[3\], expected rank 0"):
        read_npz_dir(d, SPECS)


# ------------------------------------------------------------------------------------------------ consumers


def test_calibration_batches_and_evaluation_feed_the_scalar_with_every_batch(tmp_path):
    from dsedge.toolchain.evaluate import model_outputs
    from dsedge.toolchain.quantize.calibration import split_batches

    d = _npz_dir(tmp_path / "calib", rows=(11, 9))
    data = read_npz_dir(d, SPECS)
    batches = split_batches(data, 8)
    assert [b["x"].shape[0] for b in batches] == [8, 8, 4]
    assert all(b["temperature"].shape == () and float(b["temperature"]) == 2.0 for b in batches)
    assert np.array_equal(np.concatenate([b["x"] for b in batches]), data["x"])
    out = model_outputs(_model(tmp_path / "m.onnx", total=True), data)  # 20 rows: batches of 16 and 4
    assert out["y"].shape == (20, 4)
    np.testing.assert_allclose(out["y"], data["x"] @ W / 2.0, rtol=1e-5, atol=1e-6)
    assert out["total"].shape == ()  # a rank-0 output: the first batch's value
    np.testing.assert_allclose(out["total"], (data["x"][:16] @ W / 2.0).sum(), rtol=1e-4)


def test_int8_static_calibrates_on_a_dir_with_a_scalar_input(tmp_path):
    from dsedge.toolchain.quantize.compress import Calibration, compress
    from dsedge.toolchain.quantize.graph import quantized_nodes

    model = _model(tmp_path / "m.onnx")
    data = read_npz_dir(_npz_dir(tmp_path / "calib", rows=(12, 12)), SPECS)
    out = compress(onnx.load(str(model)), "int8-static", Calibration(data))
    assert out.details["calibration_batches"] == 2 and quantized_nodes(out.model)
    x = data["x"]  # inside the calibrated range: no clipping
    for t in (2.0, 0.25):  # the scalar stays an input of the quantized model, fed as given
        feed = {"temperature": np.array(t, np.float32), "x": x}
        q = ort.InferenceSession(out.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
        ref = x @ W / t
        cos = (q * ref).sum(1) / (np.linalg.norm(q, axis=1) * np.linalg.norm(ref, axis=1))
        assert cos.min() > 0.99 and np.abs(q - ref).max() < 0.1 * np.abs(ref).max()


def test_prune_measures_its_accuracy_on_a_calib_dir_with_a_scalar_input(tmp_path, capsys):
    """``dsedge prune --calib DIR``'s accuracy check reads DIR with ``read_npz_dir`` (it said "not measured" on a
    scalar input: the ValueError was swallowed), and runs both models with temperature fed."""
    d = _npz_dir(tmp_path / "calib", rows=(6, 6))
    code, out, err = run_main(["prune", _model(tmp_path / "m.onnx"), "-o", tmp_path / "p.onnx", "--calib", d,
                               "--json"], capsys)
    assert code == 0, err
    acc = json.loads(out.strip().splitlines()[-1])["accuracy_vs_source"]
    assert acc["on"] == f"--calib {d}" and acc["n"] == 12 and acc["output"] == "y", acc
    pruned = ort.InferenceSession(str(tmp_path / "p.onnx"), providers=["CPUExecutionProvider"])
    data = read_npz_dir(d, SPECS)
    y = pruned.run(None, data)[0]
    ref = data["x"] @ W / 2.0
    cos = (y * ref).sum(1) / (np.linalg.norm(y, axis=1) * np.linalg.norm(ref, axis=1))
    assert acc["cosine_mean"] == pytest.approx(cos.mean(), abs=1e-4)


# ------------------------------------------------------------------------------------------------ the build


@pytest.fixture(scope="module")
def scalar_build(tmp_path_factory):
    """INT8 W8A8 (static Q/DQ, calibrated, under the default gate on --heldout) for t4, from directories whose files
    hold temperature = 2 beside x; the model has a rank-0 output ``total`` beside ``y``."""
    from dsedge.toolchain.pipeline import BuildOptions, build

    tmp = tmp_path_factory.mktemp("npz_scalar")
    calib = _npz_dir(tmp / "calib", rows=(6, 6), seed=1)
    heldout = _npz_dir(tmp / "heldout", rows=(5, 5), seed=2)
    r = build(BuildOptions(model=str(_model(tmp / "temp.onnx", total=True)), target="t4", out_dir=str(tmp / "out"),
                           precision="int8", calib=str(calib), heldout=str(heldout), latency_iterations=2))
    return r, heldout


def test_the_build_calibrates_and_validates_on_dirs_with_a_scalar_input(scalar_build):
    r, heldout = scalar_build
    rep = r.report
    assert rep["validation"]["samples"] == 10 and "--heldout" in rep["validation"]["inputs"]
    comp = rep["compression"]
    assert comp["mode"] == "static" and comp["calibration_batches"] == 1 and comp["gate"] == "cosine:0.99"
    assert comp["values"]["cosine"] > 0.99
    int8 = next(v for v in rep["variants"] if v["name"] == "int8")["accuracy"]
    assert int8["output"] == "y" and int8["n"] == 10 and int8["cosine_min"] > 0.95


def test_golden_io_stores_the_scalar_output_once_and_verify_passes(scalar_build, capsys):
    r, heldout = scalar_build
    m = verify_bundle(r.bundle)
    g = load_golden(r.bundle, m)
    assert g.rows == 8 and g.inputs["temperature"].shape == () and float(g.inputs["temperature"]) == 2.0
    assert np.array_equal(g.inputs["x"][0], _x(heldout)[0])
    np.testing.assert_allclose(g.outputs["y"], g.inputs["x"] @ W / 2.0, rtol=1e-5, atol=1e-6)
    assert g.outputs["total"].shape == ()
    np.testing.assert_allclose(g.outputs["total"], g.outputs["y"].sum(), rtol=1e-5)
    assert set(m.variant("int8").golden) == {"y", "total"} and m.variant("fp32").golden["total"]["cosine_min"] == 1.0
    code, out, err = run_main(["verify", r.bundle, "--variant", "all", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["passed"], out + err
    for v in rep["variants"]:
        assert v["outputs"]["total"]["ok"] and v["outputs"]["total"]["cosine_min"] == 1.0


def _rewrite_outputs(bundle, **arrays):
    with np.load(bundle / OUTPUTS_FILE, allow_pickle=False) as z:
        outs = {k: z[k] for k in z.files}
    outs.update(arrays)
    buf = io.BytesIO()
    np.savez(buf, **outs)
    (bundle / OUTPUTS_FILE).write_bytes(buf.getvalue())
    write_manifest(bundle, read_manifest(bundle))  # hash-listed again: the golden I/O is what counts
    return outs


def test_a_wrong_stored_scalar_output_fails_verify(scalar_build, tmp_path, capsys):
    bad = shutil.copytree(scalar_build[0].bundle, tmp_path / "bad.dse")
    with np.load(bad / OUTPUTS_FILE, allow_pickle=False) as z:
        total = z["total"]
    _rewrite_outputs(bad, total=-total)
    code, out, err = run_main(["verify", bad, "--json"], capsys)
    rep = json.loads(out)
    assert code == 1 and not rep["passed"] and "Traceback" not in err, out + err
    v = rep["variants"][0]["outputs"]
    assert v["y"]["ok"] and not v["total"]["ok"] and v["total"]["cosine_min"] == -1.0


def test_a_batched_output_stored_as_one_value_cannot_be_checked_exit_2(scalar_build, tmp_path, capsys):
    bad = shutil.copytree(scalar_build[0].bundle, tmp_path / "one.dse")
    with np.load(bad / OUTPUTS_FILE, allow_pickle=False) as z:
        y = z["y"]
    _rewrite_outputs(bad, y=y.sum())
    code, _, err = run_main(["verify", bad], capsys)
    assert code == 2 and "golden output 'y' is one value" in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------ golden pieces


def test_a_rank_0_output_is_one_value_per_call_and_compared_with_each():
    seen = []

    def run(feed):
        seen.append((np.shape(feed["temperature"]), len(feed["x"])))
        y = feed["x"] / feed["temperature"]
        return {"y": y, "total": np.array(y.sum(), np.float32)}

    x = np.arange(5, dtype=np.float32)[:, None]
    calls: dict = {}
    out = run_rows(run, {"temperature": np.array(2, np.float32), "x": x}, (2, 2), calls)
    assert seen == [((), 2), ((), 2), ((), 2)]  # the last call padded by repeating row 4
    assert out["y"][:, 0].tolist() == [0, 0.5, 1, 1.5, 2]
    assert out["total"].shape == () and float(out["total"]) == 0.5          # the first call's
    assert [float(v) for v in calls["total"]] == [0.5, 2.5, 4.0]           # every call's (padding: 2 + 2)
    ref = {"y": out["y"], "total": np.array(0.5, np.float32)}
    alone = compare(ref, out)["total"]                                               # the first call alone
    assert alone["cosine_min"] == pytest.approx(1.0) and alone["max_abs_diff"] == 0.0
    each = compare(ref, out, calls)["total"]                                         # every call
    assert each["cosine_min"] == pytest.approx(1.0) and each["max_abs_diff"] == pytest.approx(3.5)
    assert compare({"total": np.array(-4.0, np.float32)}, out, calls)["total"]["cosine_min"] == pytest.approx(-1.0)


def test_cap_counts_a_scalar_output_once():
    from dsedge.toolchain.golden import fit_cap

    ins = {"x": np.zeros((8, 8), np.float32)}                                         # 32 B a row
    outs = {"y": np.zeros((8, 8), np.float32), "total": np.array(0, np.float32)}     # 32 B a row, 4 B once
    assert fit_cap(ins, outs, cap=4 + 8 * 64) == (8, ["y", "total"])
    assert fit_cap(ins, outs, cap=4 + 8 * 64 - 1) == (8, ["total"])      # the largest output goes first
    assert fit_cap(ins, {"total": outs["total"]}, cap=4 + 2 * 32) == (2, ["total"])
    assert fit_cap(ins, {"total": outs["total"]}, cap=4 + 2 * 32 - 1) == (1, ["total"])  # not shared out over rows


def test_golden_rows_with_a_scalar_output_fit_one_call(tmp_path):
    """A rank-0 output sums the rows of its call: with a batch range of at most 2, golden I/O keeps 2 rows (one call)
    and the stored total is theirs."""
    from dsedge.toolchain.golden import attach_golden

    model = _model(tmp_path / "m.onnx", total=True)
    val = read_npz_dir(_npz_dir(tmp_path / "heldout", rows=(4, 4)), SPECS)
    variants = [Variant("fp32", "fp32", "models/fp32.onnx")]
    extra = attach_golden(model, {"models/fp32.onnx": model}, variants, val, SPECS,
                          {"batch": {"min": 1, "opt": 2, "max": 2}})
    ins, outs = (np.load(io.BytesIO(extra[f])) for f in (INPUTS_FILE, OUTPUTS_FILE))
    info = json.loads(extra["golden/golden.json"])
    assert info["rows"] == 2 and ins["x"].shape == (2, 4) and ins["temperature"].shape == ()
    np.testing.assert_allclose(outs["total"], (ins["x"] @ W / 2.0).sum(), rtol=1e-5)
    assert variants[0].golden["total"]["measured_max_abs_diff"] == 0.0


def test_golden_rows_cut_by_the_size_cap_get_their_own_scalar_output(tmp_path):
    """The cap leaves out ``y`` and halves 8 rows to 4: the stored total is computed again, on those 4 rows."""
    from dsedge.toolchain.golden import attach_golden

    model = _model(tmp_path / "m.onnx", total=True)
    val = read_npz_dir(_npz_dir(tmp_path / "heldout", rows=(4, 4)), SPECS)
    variants = [Variant("fp32", "fp32", "models/fp32.onnx")]
    # 4 B temperature + 4 B total once, x 16 B a row: 8 + 4 x 16 fits, 8 + 8 x 16 does not
    extra = attach_golden(model, {"models/fp32.onnx": model}, variants, val, SPECS, {}, cap=8 + 4 * 16)
    ins, outs = (np.load(io.BytesIO(extra[f])) for f in (INPUTS_FILE, OUTPUTS_FILE))
    info = json.loads(extra["golden/golden.json"])
    assert info["rows"] == 4 and info["outputs"] == ["total"] and info["left_out"] == ["y"]
    assert ins["x"].shape == (4, 4) and list(outs.keys()) == ["total"]
    np.testing.assert_allclose(outs["total"], (ins["x"] @ W / 2.0).sum(), rtol=1e-5)
