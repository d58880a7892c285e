"""Golden I/O of a model with a rank-0 input (a scalar flag such as ``temperature`` beside batched inputs): the scalar
is stored as it is, one value fed with every chunk of rows, and `dsedge verify` checks the bundle (it used to get no
golden I/O at all: "input(s) 'scale' have no batch axis")."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import dsedge
from cli_helpers import run_main
from dsedge.runtime.bundle import read_manifest, verify_bundle, write_manifest
from dsedge.runtime.golden import INFO_FILE, INPUTS_FILE, OUTPUTS_FILE, load_golden, run_rows
from dsedge.toolchain.golden import fit_cap
from dsedge.toolchain.pipeline import BuildOptions, build


def _scaled_mlp(path):
    """y = (x @ W) * scale, x [batch, 8] float32, scale a rank-0 float32 input."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((8, 8)) / np.sqrt(8)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
         helper.make_node("Mul", ["h", "scale"], ["y"], name="scale_mul")],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def scalar_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden_scalar")
    return build(BuildOptions(model=str(_scaled_mlp(tmp / "scaled.onnx")), target="cpu", out_dir=str(tmp / "out"),
                              precision="int8", latency_iterations=2))


def _rehash(bundle):
    write_manifest(bundle, read_manifest(bundle))  # hash-listed again: the bundle verifies, its golden I/O is what counts


def test_golden_io_is_written_with_the_scalar_stored_rank_0(scalar_build):
    assert not [n for n in scalar_build.report["notes"] if "no golden I/O" in n], scalar_build.report["notes"]
    b = scalar_build.bundle
    m = verify_bundle(b)
    assert {INPUTS_FILE, OUTPUTS_FILE, INFO_FILE} <= set(m.files)
    with np.load(b / INPUTS_FILE, allow_pickle=False) as z:
        scale, x = z["scale"], z["x"]
    assert scale.shape == () and scale.dtype == np.float32 and np.isfinite(scale)
    g = load_golden(b, m)
    assert x.ndim == 2 and x.shape[1] == 8 and g.rows == len(x) == g.info["rows"] >= 1
    assert g.outputs["y"].shape == (g.rows, 8)
    assert set(m.variant("int8").golden) == {"y"} and set(m.variant("fp32").golden) == {"y"}


def test_verify_passes_and_load_checks_outputs(scalar_build, capsys):
    code, out, err = run_main(["verify", scalar_build.bundle, "--variant", "all", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["passed"], out + err
    assert {v["variant"] for v in rep["variants"]} == {"int8", "fp32"} and all(v["passed"] for v in rep["variants"])
    s = dsedge.load(scalar_build.bundle, check_outputs=True)
    s.close()


def test_a_tampered_golden_output_fails_verify(scalar_build, tmp_path, capsys):
    bad = shutil.copytree(scalar_build.bundle, tmp_path / "bad.dse")
    y = np.load(bad / OUTPUTS_FILE, allow_pickle=False)["y"]
    np.savez(bad / OUTPUTS_FILE, y=-y)
    _rehash(bad)
    code, out, err = run_main(["verify", bad, "--json"], capsys)
    assert code == 1 and not json.loads(out)["passed"] and "Traceback" not in err, out + err


def test_a_scalar_stored_with_rows_cannot_be_checked_exit_2(scalar_build, tmp_path, capsys):
    bad = shutil.copytree(scalar_build.bundle, tmp_path / "rows.dse")
    with np.load(bad / INPUTS_FILE, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["scale"] = np.repeat(arrays["scale"], len(arrays["x"]))
    np.savez(bad / INPUTS_FILE, **arrays)
    _rehash(bad)
    code, out, err = run_main(["verify", bad], capsys)
    assert code == 2 and "golden input 'scale' is float32" in err and "manifest's input is float32 []" in err, err


def test_a_bundle_without_golden_io_asks_for_a_rebuild(scalar_build, tmp_path, capsys):
    """Built before golden I/O carried rank-0 inputs: the hint is a rebuild, not "no batch axis"."""
    old = shutil.copytree(scalar_build.bundle, tmp_path / "old.dse")
    m = read_manifest(old)
    for f in (INPUTS_FILE, OUTPUTS_FILE, INFO_FILE):
        (old / f).unlink()
        del m.files[f]
    write_manifest(old, m)
    code, _, err = run_main(["verify", old], capsys)
    assert code == 2 and "no golden I/O" in err and "rebuild it" in err and "'scale'" in err, err


def test_rows_run_with_the_scalar_fed_unchanged_in_every_padded_call():
    calls = []

    def run(feed):
        calls.append((np.shape(feed["scale"]), len(feed["x"])))
        return {"y": feed["x"] * feed["scale"]}

    out = run_rows(run, {"scale": np.array(3, np.float32), "x": np.arange(5, dtype=np.float32)[:, None]}, (4, 4))
    assert calls == [((), 4), ((), 4)] and out["y"][:, 0].tolist() == [0, 3, 6, 9, 12]


def test_cap_counts_a_scalar_input_once():
    ins = {"scale": np.array(2, np.float32), "x": np.zeros((8, 8), np.float32)}  # 4 B once + 32 B a row
    outs = {"y": np.zeros((8, 8), np.float32)}                                   # 32 B a row
    assert fit_cap(ins, outs, cap=4 + 8 * 64) == (8, ["y"])
    assert fit_cap(ins, outs, cap=4 + 8 * 64 - 1) == (4, ["y"])
    assert fit_cap(ins, outs, cap=4 + 4 * 64 - 1) == (2, ["y"])  # the scalar's bytes are not shared out over rows


def test_batch_limits_come_from_the_first_batched_input():
    from dsedge.runtime.bundle import IOSpec
    from dsedge.runtime.golden import batch_limits

    specs = [IOSpec("scale", "float32", ()), IOSpec("x", "float32", ("batch", 8))]
    assert batch_limits(specs, {"batch": {"min": 2, "opt": 4, "max": 4}}) == (2, 4)
    assert batch_limits([specs[0], IOSpec("x", "float32", (4, 8))], {}) == (4, 4)
