"""A rank-0 (scalar) input or output where rows are counted or an output is judged: synthetic inputs (a build with no
``--calib``), ``dsedge bench --inputs``, and the accuracy judged on a model whose first output is rank-0 or with
``--gate-output`` naming one. Real ONNX models (onnx.helper), real ONNX Runtime, real files, the real CLI.

The model (as tests/test_npz_scalar_inputs.py's): ``temperature`` float [] FIRST, then ``x`` float [batch, 4];
y = (x @ W) / temperature, total = ReduceSum(y) (rank 0). With ``total_first`` the outputs are (total, y)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
import pytest

from cli_helpers import run_main
from dsedge.runtime.bench import synthetic_inputs
from dsedge.runtime.bench_load import input_windows, read_inputs_dir
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.runtime.errors import ConfigError

from scalar_models import SPECS, W, npz_dir, scalar_model, stacked_x


def _model(path, total_first: bool = True, only_total: bool = False):
    """The scalar model (tests/scalar_models.py): outputs (total, y) with ``total_first``, else (y, total);
    ``only_total``: total alone."""
    return scalar_model(path, ("total",) if only_total else ("total", "y") if total_first else ("y", "total"))


def _npz_dir(d, rows=(3, 2), temperatures=None, seed=1):
    return npz_dir(d, rows, temperatures, seed)


_x = stacked_x


# ------------------------------------------------------------------------------------- 1. synthetic inputs


def test_synthetic_inputs_keep_a_rank_0_input_0_d_and_the_model_runs_on_them(tmp_path):
    feeds = synthetic_inputs(SPECS, batch=3)
    assert feeds["temperature"].shape == () and feeds["temperature"].dtype == np.float32
    assert feeds["x"].shape == (3, 4) and feeds["x"].flags.c_contiguous
    sess = ort.InferenceSession(str(_model(tmp_path / "m.onnx")), providers=["CPUExecutionProvider"])
    total, y = sess.run(None, feeds)
    np.testing.assert_allclose(y, feeds["x"] @ W / feeds["temperature"], rtol=1e-5, atol=1e-5)
    assert total.shape == () and float(total) == pytest.approx(float(y.sum()), rel=1e-4, abs=1e-5)


def test_a_build_without_calib_validates_on_synthetic_rows_and_judges_the_first_batched_output(tmp_path):
    """No --calib: the ONNX file's example inputs (``synthetic_inputs``, batch 2) are what the variants are judged
    on: 2 samples (the rank-0 temperature is no row), judged on ``y`` since the first output ``total`` is rank-0."""
    from dsedge.toolchain.pipeline import BuildOptions, build

    r = build(BuildOptions(model=str(_model(tmp_path / "m.onnx")), target="t4", out_dir=str(tmp_path / "out"),
                           precision="fp16", latency_iterations=2))
    rep = r.report
    assert rep["validation"]["samples"] == 2, rep["validation"]
    for v in rep["variants"]:
        acc = v["accuracy"]
        assert acc["output"] == "y" and acc["n"] == 2 and acc["cosine_min"] > 0.999, (v["name"], acc)


# ---------------------------------------------------------------------------------- 2. dsedge bench --inputs


@pytest.fixture(scope="module")
def scalar_bundle(tmp_path_factory):
    """A real bundle (``write_bundle``) of the scalar-first model: batch range 1..16, a 1000 ms budget."""
    from dsedge.toolchain.bundle_writer import write_bundle

    tmp = tmp_path_factory.mktemp("scalar_bench")
    return write_bundle(
        tmp / "temp-cpu.dse", name="temp", target={"name": "cpu"}, inputs=SPECS,
        outputs=[IOSpec("total", "float32", ()), IOSpec("y", "float32", ("batch", 4))],
        models={"models/fp32.onnx": _model(tmp / "m.onnx")},
        variants=[Variant(name="fp32", precision="fp32", file="models/fp32.onnx")], default_variant="fp32",
        shape_ranges={"batch": {"min": 1, "opt": 1, "max": 16}}, latency_budget_ms=1000.0)


def test_real_inputs_with_a_scalar_first_are_read_once_and_windowed_on_the_batched_rows(tmp_path):
    d = _npz_dir(tmp_path / "in", rows=(3, 2))
    real = read_inputs_dir(d, SPECS)
    assert real["temperature"].shape == () and float(real["temperature"]) == 2.0
    assert np.array_equal(real["x"], _x(d))
    windows = input_windows(real, 2)  # 5 rows: windows of rows 0-1 and 2-3
    assert len(windows) == 2
    assert [w["x"].tolist() for w in windows] == [real["x"][:2].tolist(), real["x"][2:4].tolist()]
    assert all(w["temperature"].shape == () and float(w["temperature"]) == 2.0 for w in windows)
    wrapped = input_windows(real, 8)  # fewer rows than the batch: one window, the rows repeated
    assert len(wrapped) == 1 and np.array_equal(wrapped[0]["x"], real["x"][np.arange(8) % 5])
    sess = ort.InferenceSession(str(_model(tmp_path / "m.onnx")), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(["y"], windows[1])[0], real["x"][2:4] @ W / 2.0, rtol=1e-5, atol=1e-6)


def test_bench_with_real_inputs_holding_a_scalar_first(scalar_bundle, tmp_path, capsys):
    d = _npz_dir(tmp_path / "in", rows=(3, 2))
    code, out, err = run_main(["bench", scalar_bundle, "--batch", "2,8", "--iterations", 3, "--warmup", 1,
                               "--inputs", d, "--json"], capsys)
    assert code == 0 and "Traceback" not in err, out + err
    rep = json.loads(out)
    assert [(r["batch"], r["shapes"], r["iterations"]) for r in rep["results"]] == [
        (2, {"temperature": [], "x": [2, 4]}, 3), (8, {"temperature": [], "x": [8, 4]}, 3)]
    assert rep["settings"]["inputs"] == str(d)
    tiled = [n for n in rep["notes"] if "repeated" in n]
    assert tiled == [f"--inputs {str(d)!r} holds 5 rows, fewer than batch size 8: the rows are repeated to fill "
                     "each batch"], rep["notes"]


def test_bench_inputs_whose_scalar_differs_between_files_is_a_usage_error(scalar_bundle, tmp_path, capsys):
    d = _npz_dir(tmp_path / "in", rows=(3, 2), temperatures=(2.0, 0.5))
    code, out, err = run_main(["bench", scalar_bundle, "--iterations", 2, "--inputs", d], capsys)
    assert code == 2 and "Traceback" not in err, out + err
    assert "rank-0 input 'temperature' holds 2.0 in 0.npz but 0.5 in 1.npz" in err
    assert "save one value of 'temperature' in every file" in err


# ------------------------------------------------------------------------------- 3. judging a rank-0 output


@pytest.fixture(scope="module")
def gate_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scalar_gate")
    return (_model(tmp / "m.onnx"), _npz_dir(tmp / "calib", rows=(6, 6), seed=1),
            _npz_dir(tmp / "heldout", rows=(4, 4), seed=2))


def test_quantize_gates_on_the_first_batched_output_when_the_first_is_rank_0(gate_data, tmp_path, capsys):
    from dsedge.toolchain.evaluate import compare_models
    from dsedge.toolchain.npz_inputs import read_npz_dir

    model, calib, heldout = gate_data
    q = tmp_path / "q.onnx"
    code, out, err = run_main(["quantize", model, "-o", q, "--precision", "int8", "--calib", calib,
                               "--heldout", heldout, "--accuracy-gate", "cosine:0.99", "--json"], capsys)
    assert code == 0 and "Traceback" not in err, out + err
    values = json.loads(out.strip().splitlines()[-1])["values"]
    acc = compare_models(model, q, read_npz_dir(heldout, SPECS))  # the build's accuracy record: y, 8 samples
    assert acc["output"] == "y" and acc["n"] == 8
    assert values["cosine"] == pytest.approx(acc["cosine_mean"], abs=1e-5)
    assert values["cosine-min"] == pytest.approx(acc["cosine_min"], abs=1e-5) and values["cosine"] > 0.99


def test_quantize_refuses_a_gate_on_a_rank_0_output_in_one_line(gate_data, tmp_path, capsys):
    model, calib, heldout = gate_data
    q = tmp_path / "q.onnx"
    code, out, err = run_main(["quantize", model, "-o", q, "--precision", "int8", "--calib", calib,
                               "--heldout", heldout, "--accuracy-gate", "cosine:0.99", "--gate-output", "total"],
                              capsys)
    assert code == 2 and "Traceback" not in err and not q.exists(), out + err
    assert "error: --gate-output 'total' is a rank-0 output: one value per call, no samples to judge accuracy on" in err
    assert "hint: gate on a batched output such as 'y'" in err


def test_build_refuses_gate_output_naming_a_rank_0_output(gate_data, tmp_path, capsys):
    model, _, _ = gate_data
    code, out, err = run_main(["build", "-m", model, "-t", "t4", "-p", "fp16", "--out", tmp_path / "out",
                               "--gate-output", "total"], capsys)
    assert code == 2 and "Traceback" not in err, out + err
    assert "error: --gate-output 'total' is a rank-0 output" in err and "gate on a batched output such as 'y'" in err
    assert not list((tmp_path / "out").glob("*.dse"))


def test_compare_models_picks_the_first_batched_output_and_refuses_rank_0_ones(tmp_path):
    from dsedge.toolchain.evaluate import compare_models, judged_output

    feeds = {"temperature": np.array(2.0, np.float32),
             "x": np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)}
    ref = _model(tmp_path / "ref.onnx")
    test = tmp_path / "test.onnx"  # W halved: y halved, so cosine 1 and max abs diff = max |y| / 2
    m = onnx.load(str(ref))
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(W / 2, "w"))
    onnx.save(m, str(test))
    acc = compare_models(ref, test, feeds)
    y = feeds["x"] @ W / 2.0
    assert acc["output"] == "y" and acc["n"] == 5 and acc["cosine_min"] == pytest.approx(1.0, abs=1e-5)
    assert acc["max_abs_diff"] == pytest.approx(float(np.abs(y).max()) / 2, rel=1e-4)
    with pytest.raises(ConfigError, match="--gate-output 'total' is a rank-0 output") as e:
        compare_models(ref, test, feeds, output="total")
    assert "\n" not in e.value.message and e.value.hint == "gate on a batched output such as 'y'"
    with pytest.raises(ConfigError, match=r"every output of only.onnx is rank-0 \(total\)") as e:
        judged_output({"total": 0}, None, "only.onnx")
    assert "batched output" in e.value.hint
    only = _model(tmp_path / "only.onnx", only_total=True)
    with pytest.raises(ConfigError, match="every output of only.onnx is rank-0"):
        compare_models(only, only, feeds)
