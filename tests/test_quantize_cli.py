"""`dsedge quantize` and `dsedge prune` end to end on a tiny real ONNX model (the CLI entry point, real ORT)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest


from quantize_models import cosine, inputs, mlp, run
from cli_helpers import run_main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    onnx.save(mlp(), str(d / "mlp.onnx"))
    (d / "calib").mkdir()
    (d / "held").mkdir()
    for i, b in enumerate(inputs()):
        np.savez(d / "calib" / f"{i}.npz", **b)
    for i, b in enumerate(inputs(n_batches=2, seed=7)):
        np.savez(d / "held" / f"{i}.npz", **b)
    return d


def test_quantize_int4_gptq_with_gate_writes_model_and_report(files, capsys):
    out, rep = files / "q4.onnx", files / "q4.json"
    code, stdout, _ = run_main(["quantize", files / "mlp.onnx", "-o", out, "--algorithm", "gptq", "--block-size", 16,
                            "--calib", files / "calib", "--heldout", files / "held", "--accuracy-gate", "cosine:0.99",
                            "--report", rep], capsys)
    assert code == 0 and "wrote" in stdout
    report = json.loads(rep.read_text())
    assert report["gate"] == "cosine:0.99" and report["value"] >= 0.99 and report["precision"] == "int4"
    q = onnx.load(str(out))
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 3
    x = inputs(n_batches=1, seed=7)[0]
    assert cosine(run(mlp(), x), run(q, x)) >= 0.99
    assert not list(files.glob(".q4.onnx.tmp-*"))


@pytest.mark.parametrize("args", [["--precision", "fp16"], ["--precision", "int8", "--int8-mode", "dynamic"]])
def test_quantize_other_precisions(files, capsys, args):
    out = files / f"q_{args[1]}.onnx"
    code, stdout, _ = run_main(["quantize", files / "mlp.onnx", "-o", out, *args], capsys)
    assert code == 0 and args[1] in stdout
    x = inputs(n_batches=1, seed=3)[0]
    assert cosine(run(mlp(), x), run(onnx.load(str(out)), x)) > 0.99


def test_quantize_user_errors_are_one_line(files, capsys):
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "x.onnx", "--algorithm", "awq"], capsys)
    assert code == 2 and "AWQ needs calibration data" in err and "Traceback" not in err
    assert not (files / "x.onnx").exists()
    code, _, err = run_main(["quantize", files / "nope.onnx", "-o", files / "x.onnx"], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "x.onnx", "--calib", files / "calib",
                         "--accuracy-gate", "cosine:0.99"], capsys)
    assert code == 2 and "--heldout" in err
    # an output path that cannot be a file: one line, exit 2, nothing left behind (was a FileExistsError /
    # IsADirectoryError traceback)
    (files / "afile").write_text("x")
    for bad, why in ((files / "afile" / "q.onnx", "a file is in the way"),
                     (files / "calib", "the path is a directory")):
        code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", bad, "--algorithm", "rtn"], capsys)
        assert code == 2 and why in err and "Traceback" not in err and err.count("\n") <= 2, err
    assert sorted(p.name for p in files.iterdir() if p.name.startswith(".")) == []


def test_prune_2_4(files, capsys):
    out = files / "p.onnx"
    code, stdout, _ = run_main(["prune", files / "mlp.onnx", "-o", out, "--calib", files / "calib"], capsys)
    assert code == 0 and "2:4 sparsity on 3 layers" in stdout
    w = onnx.numpy_helper.to_array(next(t for t in onnx.load(str(out)).graph.initializer if t.name == "w2"))
    assert (w == 0).mean() == 0.5


def test_quantize_refuses_heldout_that_is_the_calibration_data(files, capsys):
    """Found by a user: `--heldout` = `--calib` passed the gate on the data it calibrated on (dsedge build refuses
    it); the report's gate value was optimistic by construction."""
    for held, what in ((files / "calib", "is the same as"), (files / "calib" / "1.npz", "shares 1 file(s) with")):
        code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "hc.onnx", "--precision", "int8",
                                 "--calib", files / "calib", "--heldout", held, "--accuracy-gate", "cosine:0.99"],
                                capsys)
        assert code == 2 and f"{what} --calib" in err and "Traceback" not in err, err
    assert not (files / "hc.onnx").exists()


def test_prune_2_4_refuses_an_explicit_sparsity(files, capsys):
    """Found by a user: `--pattern 2:4 --sparsity 0.3` was silently ignored (only values other than the default
    were refused)."""
    code, _, err = run_main(["prune", files / "mlp.onnx", "-o", files / "s.onnx", "--sparsity", "0.3"], capsys)
    assert code == 2 and "--sparsity applies to --pattern channels" in err and "Traceback" not in err
    assert not (files / "s.onnx").exists()
