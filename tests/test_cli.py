"""The `dsedge` command as a user runs it: real processes, exit codes, one-line errors, no tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiny_models import mlp_onnx, tiny_bundle


def dsedge(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dsedge", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def assert_clean_error(out, *fragments):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    err_lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1, out.stderr
    for f in fragments:
        assert f in out.stderr
    assert "hint:" in out.stderr


def test_build_json_is_the_last_thing_printed(tmp_path):
    model = mlp_onnx(tmp_path / "mlp.onnx")
    out = dsedge("build", "--model", str(model), "--target", "cpu", "--precision", "int4", "--out",
                 str(tmp_path / "out"), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["bundle"] == "mlp-cpu.dse" and report["precision"] == "int4"
    assert "variant" in out.stderr  # the human table went to stderr
    insp = dsedge("inspect", str(tmp_path / "out" / "mlp-cpu.dse"), "--json")
    assert insp.returncode == 0 and json.loads(insp.stdout)["verified"] is True


@pytest.mark.parametrize("args, fragments", [
    (["build", "--target", "moon"], ["unknown target 'moon'", "jetson-orin"]),
    (["build", "--model", "nope/model.onnx", "--target", "cpu"], ["does not exist"]),
    (["build", "--target", "cpu", "--precision", "fp16"], ["cpu does not support fp16"]),
    (["inspect", "no-such.dse"], ["does not exist"]),
])
def test_user_errors_exit_nonzero_with_one_line(tmp_path, args, fragments):
    out = dsedge(*args, "--out", str(tmp_path / "o")) if args[0] == "build" else dsedge(*args)
    assert_clean_error(out, *fragments)
    if "--model" in args:  # found by a user: a progress line ("target cpu: precision auto …") came before it
        assert "target cpu: precision" not in out.stderr + out.stdout
    assert not (tmp_path / "o").exists() or list((tmp_path / "o").iterdir()) == []


def test_not_onnx_file_and_tampered_bundle(tmp_path):
    bad = tmp_path / "x.onnx"
    bad.write_text("hello")
    out = dsedge("build", "--model", str(bad), "--target", "cpu", "--out", str(tmp_path / "o"))
    assert_clean_error(out, "is not a valid ONNX model")
    assert "target cpu: precision" not in out.stderr + out.stdout
    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    (b / "models/fp32.onnx").write_bytes(b"truncated")
    assert_clean_error(dsedge("inspect", str(b)), "corrupt or was modified")


def test_usage_error_and_doctor():
    out = dsedge("build", "--precision", "int3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    doc = dsedge("doctor", "--json")
    assert doc.returncode == 0
    info = json.loads(doc.stdout)
    assert "CPUExecutionProvider" in info["providers"] and info["onnxruntime"]


def test_every_command_and_subcommand_takes_quiet_and_verbose():
    import click

    from dsedge.cli import COMMANDS, cli

    def lacking(cmd, path):
        names = {p.name for p in cmd.params}
        yield from [] if {"quiet", "verbose"} <= names else [path]
        for name, sub in getattr(cmd, "commands", {}).items():  # groups: `export triton`, `data check`
            yield from lacking(sub, f"{path} {name}")

    ctx = click.Context(cli)
    assert [p for name in COMMANDS for p in lacking(cli.get_command(ctx, name), name)] == []
