"""``BuildConfig``: read from flags or ``--config build.toml`` (flags override), immutable, validated up front."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from dsedge.runtime.errors import ConfigError, PrecisionNotSupported
from dsedge.toolchain.config import BuildConfig, dump_config, plan_build, read_config_file
from tiny_models import mlp_onnx
from cli_helpers import run_main

TIMING_KEYS = {"latency_ms", "wall_time_s", "timings_s"}


def _without_timings(obj):
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [_without_timings(v) for v in obj]
    return obj


def _build(args, out):
    from dsedge.cli import cli

    r = CliRunner().invoke(cli, ["build", *args, "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    bundle = next(out.glob("*.dse"))
    return json.loads((bundle / "manifest.json").read_text()), json.loads((bundle / "report.json").read_text())


def test_build_from_flags_and_from_build_toml_give_the_same_bundle(tmp_path):
    model = mlp_onnx(tmp_path / "m.onnx")
    flags = ["--target", "jetson", "--precision", "int4", "--model", str(model), "--block-size", "64"]
    m1, r1 = _build(flags, tmp_path / "a")
    cfg = tmp_path / "build.toml"
    cfg.write_text(dump_config(BuildConfig(model=str(model), target="jetson", precision="int4", block_size=64)))
    m2, r2 = _build(["--config", str(cfg)], tmp_path / "b")
    for m in (m1, m2):
        m["files"].pop("report.json")                 # it holds the timings, compared below without them
    assert _without_timings(m1) == _without_timings(m2)
    assert _without_timings(r1) == _without_timings(r2)
    assert r1["compression"]["block_size"] == 64
    # a flag given on the command line overrides the file; flags left at their defaults do not
    m3, r3 = _build(["--config", str(cfg), "--block-size", "128"], tmp_path / "c")
    assert r3["compression"]["block_size"] == 128 and r3["precision"] == "int4" and m3["target"]["name"] == "jetson-orin"


def test_config_file_round_trips_and_refuses_unknown_keys_and_wrong_types(tmp_path):
    cfg = BuildConfig(model="m.onnx", target="cpu", precision="int8", fallback=True, threads=2, accuracy_gate="cosine:0.99")
    path = tmp_path / "build.toml"
    path.write_text(dump_config(cfg))
    assert read_config_file(path) == cfg
    path.write_text('[build]\ntarget = "cpu"\nprecison = "int8"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'precison' \(did you mean 'precision'\?\)"):
        read_config_file(path)
    path.write_text('[build]\nblock_size = "32"\n')
    with pytest.raises(ConfigError, match="block_size = '32' is not an integer") as e:
        read_config_file(path)
    assert e.value.hint == "write block_size as an integer"
    path.write_text('[build]\nthreads = -4\n')
    with pytest.raises(ConfigError, match="threads = -4 is not an integer >= 1"):
        read_config_file(path)
    for n in (0, -3, 10**20):  # was accepted: the build timed a single run and wrote it as every percentile, or
        # ran until it was killed
        path.write_text(f'[build]\nlatency_iterations = {n}\n')
        with pytest.raises(ConfigError, match=f"latency_iterations = {n} is not an integer from 1 to 100000"):
            read_config_file(path)
    path.write_text('target = "cpu"\n[build]\nprecision = "int8"\n')  # a key above [build]: was dropped silently
    with pytest.raises(ConfigError, match="key 'target' is outside \\[build\\], and only \\[build\\] is read") as e:
        read_config_file(path)
    assert "move 'target' under [build]" in e.value.hint
    path.write_text('[build]\nprecision = "int8"\n[extra]\nfoo = 1\n')
    with pytest.raises(ConfigError, match="table 'extra' is outside \\[build\\]"):
        read_config_file(path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.precision = "int4"  # type: ignore[misc]


def test_bad_combinations_are_refused_before_any_work(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(PrecisionNotSupported, match="t4 does not support int4"):
        plan_build(BuildConfig(target="t4", precision="int4", out_dir=str(out)))
    with pytest.raises(ConfigError, match="--qat-steps fine-tunes for INT4"):
        plan_build(BuildConfig(target="jetson", precision="int8", qat_steps=10, out_dir=str(out)))
    with pytest.raises(ConfigError, match="block size 48"):
        plan_build(BuildConfig(block_size=48))
    plan = plan_build(BuildConfig(target="jetson", precision="int4", prune="2:4"))
    assert plan.config.algorithm == "rtn" and plan.prune.pattern == "2:4"   # auto would refill the 2:4 zeros
    # INT4-only options on another precision were ignored without a word
    for kw, flag in ((dict(block_size=64), "--block-size"), (dict(algorithm="awq"), "--algorithm"),
                     (dict(embeddings=False), "--no-embeddings")):
        for precision in ("int8", "fp32"):
            with pytest.raises(ConfigError, match=f"{flag} applies to INT4 weight-only quantization, and this "
                                                  f"build's precision is {precision}"):
                plan_build(BuildConfig(target="cpu", precision=precision, **kw))
        assert plan_build(BuildConfig(target="cpu", precision="auto", **kw)).precision  # auto may pick INT4
    assert not out.exists()


def test_heldout_data_that_is_the_calibration_data_is_refused(tmp_path):
    """The report said "--heldout cal (12 samples, not calibrated on)" while every figure was measured on the
    calibration data itself."""
    cal, held = tmp_path / "cal", tmp_path / "held"
    cal.mkdir()
    held.mkdir()
    for i in range(2):
        np.savez(cal / f"{i}.npz", x=np.zeros((1, 4), np.float32))
    (held / "0.npz").symlink_to(cal / "0.npz")
    for h, words in ((cal, "is the same as --calib"), (str(cal) + "/", "is the same as --calib"),
                     (held, "shares 1 file(s) with --calib"), (cal / "1.npz", "shares 1 file(s) with --calib")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            plan_build(BuildConfig(target="cpu", calib=str(cal), heldout=str(h)))
    (held / "0.npz").unlink()
    np.savez(held / "0.npz", x=np.ones((1, 4), np.float32))
    assert plan_build(BuildConfig(target="cpu", calib=str(cal), heldout=str(held))).config.heldout == str(held)


def test_verbosity_flags_and_third_party_warnings_go_to_the_log():
    import warnings

    import click

    from dsedge.cli import with_verbosity

    @click.command()
    def noisy():
        warnings.warn("TracerWarning: converting a tensor to a Python boolean", UserWarning)
        click.echo("done")

    cmd = with_verbosity(noisy)
    quiet, verbose = CliRunner().invoke(cmd, []), CliRunner().invoke(cmd, ["-v"])
    assert quiet.output == "done\n" and "TracerWarning" not in quiet.output
    assert "TracerWarning" in verbose.output and verbose.output.endswith("done\n")


def test_prune_json_prints_the_report_last(tmp_path):
    from dsedge.cli import cli

    model = mlp_onnx(tmp_path / "m.onnx")
    r = CliRunner().invoke(cli, ["prune", str(model), "-o", str(tmp_path / "p.onnx"), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["output"] == str(tmp_path / "p.onnx") and len(report["layers"]) == 2


def test_accuracy_gate_thresholds_outside_the_metric_range_are_refused_at_plan_time(tmp_path, capsys):
    model = mlp_onnx(tmp_path / "m.onnx")
    code, _, err = run_main(["build", "--target", "cpu", "--model", model, "--out", tmp_path / "o",
                          "--accuracy-gate", "cosine:-1"], capsys)
    assert code not in (0, None) and "Traceback" not in err and not (tmp_path / "o").exists()
    assert err.splitlines() == ["error: accuracy gate 'cosine:-1': a cosine threshold must be in (0, 1]",
                                "  hint: a cosine gate at or below 0 passes almost any model; e.g. cosine:0.99"]
    for spec, text in (("cosine:0", "a cosine threshold must be in (0, 1]"),
                       ("top1:0", "a top1 threshold must be in (0, 1]"),
                       ("cosine-min:nan", "the threshold is not a finite number"),
                       ("cosine:0.99,top1:1.5", "can never be judged: top1 lies in [0, 1]")):
        with pytest.raises(ConfigError, match=re.escape(text)):
            plan_build(BuildConfig(model=str(model), target="cpu", accuracy_gate=spec))
    from dsedge.toolchain.quantize.mixed import parse_gate

    for spec in ("auc-drop:-0.01", "accuracy-drop:1", "auc-drop:inf"):
        with pytest.raises(ConfigError, match=r"threshold (must be in \[0, 1\)|is not a finite number)"):
            parse_gate(spec)
    assert parse_gate("cosine:1").threshold == 1.0 and parse_gate("auc-drop:0").threshold == 0.0


def test_a_negative_qat_steps_is_a_usage_error_naming_the_option(capsys):
    for args in (["--qat-steps", "-1"], ["--qat-steps=-1"]):
        code, _, err = run_main(["build", "--target", "cpu", "--model", "nowhere.onnx", *args], capsys)
        assert code == 2 and "Error: Invalid value for '--qat-steps': -1 is not a non-negative integer" in err
        assert "No such option" not in err
    code, _, err = run_main(["build", "--model", "nowhere.onnx", "--finetune-steps", "-3"], capsys)
    assert code == 2 and "Invalid value for '--finetune-steps': -3 is not in the range x>=0" in err


def test_build_threads_must_be_positive(capsys):
    from cli_helpers import run_main

    for bad in ("0", "-2"):
        code, _, err = run_main(["build", "--model", "never-read.onnx", "--target", "cpu", "--threads", bad], capsys)
        assert code == 2 and "Invalid value for '--threads'" in err, err


def test_a_build_key_that_is_not_a_table_is_one_line(tmp_path, capsys):
    """`build = 3` at the top of a build.toml crashed with an AttributeError traceback."""
    path = tmp_path / "build.toml"
    path.write_text("build = 3\n")
    with pytest.raises(ConfigError, match="build = 3 is not a table"):
        read_config_file(path)
    code, _, err = run_main(["build", "--config", path, "--out", tmp_path / "never"], capsys)
    assert code == 2 and "Traceback" not in err and "is not a table" in err
    assert not (tmp_path / "never").exists()


def test_calib_and_heldout_dirs_from_a_build_toml_are_checked_before_any_work(tmp_path):
    """The CLI checks --calib/--heldout itself; from a build.toml a missing directory was found after the export."""
    from dsedge.runtime.errors import CalibrationError

    (tmp_path / "a.npz").write_bytes(b"")
    for key, what in (("calib", "calibration"), ("heldout", "held-out")):
        with pytest.raises(CalibrationError, match=f"{what} directory '.*nope' does not exist"):
            plan_build(BuildConfig(target="cpu", **{key: str(tmp_path / "nope")}))
        # a file: it failed after the export, saying the (existing) file "does not exist"
        with pytest.raises(CalibrationError, match=f"{key} = '.*a.npz' is a file, not a {what} directory"):
            plan_build(BuildConfig(target="cpu", **{key: str(tmp_path / "a.npz")}))


def test_out_inside_a_bundle_is_refused_and_the_bundle_left_as_it_was(tmp_path):
    """`--model B.dse/models/fp32.onnx --out B.dse` wrote a second bundle (and the scratch dir) into B."""
    from dsedge.runtime.errors import BundleError
    from dsedge.toolchain import pipeline
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    for out in (bundle, bundle / "models" / "sub"):
        with pytest.raises(BundleError, match="is inside the bundle"):
            pipeline.build(BuildConfig(model=str(bundle / "models" / "fp32.onnx"), target="cpu", precision="fp32",
                                       out_dir=str(out)))
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before


def test_a_decision_logged_during_the_build_is_not_repeated_as_a_note(tmp_path, capsys):
    """Found by a new user: `dsedge build` printed auto's choice twice, as the decision was made and again among the
    closing notes. Each is said once; notes not logged during the build (if any) still close the output."""
    model = mlp_onnx(tmp_path / "m.onnx")
    code, out, err = run_main(["build", "--target", "cpu", "--model", model, "--out", tmp_path / "o"], capsys)
    text = " ".join((out + err).split())
    assert code in (0, None), err
    assert text.count("auto chose") == 1, text
    report = json.loads(next((tmp_path / "o").glob("*.dse/report.json")).read_text())
    assert any("auto chose" in n for n in report["notes"])  # still in the report


def test_the_table_header_names_the_timed_shape_only_when_the_inputs_share_it():
    """A user's pass: the fraud scorer's table said b1×29 (its dense width, as if a sequence length)."""
    from dsedge.toolchain.report import latency_shape

    def report(shapes):
        return {"variants": [{"latency_ms": {"1": {"p50": 1.0, "shape": shapes}}}]}

    assert latency_shape(report({"input_ids": [1, 32], "attention_mask": [1, 32]})) == "b1×32"
    assert latency_shape(report({"dense": [1, 29], "sparse_ids": [1, 4]})) == "b1"
    assert latency_shape(report({"image": [1, 3, 224, 224]})) == "b1×3×224×224"
    assert latency_shape({"variants": [{"latency_ms": {}}]}) == "b1"


def test_int4_block_size_defaults_per_backend_and_tensorrt_takes_64_or_128_only(tmp_path, capsys):
    """A helper's pass with user models: TensorRT's INT4 is per block of 64 or 128 only (TensorRT "Quantization
    Schemes"), and every TensorRT target built INT4 at block 32, the default. The default is now 64 on TensorRT
    targets (32 on ONNX Runtime ones); another size for a TensorRT target is refused before any work."""
    assert plan_build(BuildConfig(target="jetson", precision="int4")).config.block_size == 64
    assert plan_build(BuildConfig(target="cpu", precision="int4")).config.block_size == 32
    assert plan_build(BuildConfig(target="jetson", precision="int4", block_size=128)).config.block_size == 128
    assert plan_build(BuildConfig(target="cpu", precision="int4", block_size=16)).config.block_size == 16
    out = tmp_path / "never"
    code, stdout, err = run_main(["build", "--target", "jetson", "--block-size", "32", "--out", out], capsys)
    assert code == 2 and stdout == "" and "Traceback" not in err and not out.exists()
    assert err.splitlines()[0] == ("error: --block-size 32 on jetson-orin: TensorRT's INT4 takes blocks of 64 or "
                                   "128 only")
    assert "--block-size 64" in err.splitlines()[1]


def test_budget_ms_sets_the_bundles_default_budget_and_bad_ones_are_refused(tmp_path, capsys):
    """A helper's pass on the samples: every bundle's latency_budget_ms was its target's default (50 ms on cpu), with
    no way to set it, so the fraud scorer's bundles (3 ms goal) and their latency tests judged against 50 ms.
    `dsedge build --budget-ms` (and build.toml's budget_ms) sets it; a bad value is refused before any work."""
    model = mlp_onnx(tmp_path / "m.onnx")
    m, _ = _build(["--target", "cpu", "--precision", "fp32", "--model", str(model), "--budget-ms", "3"],
                  tmp_path / "a")
    assert m["latency_budget_ms"] == 3.0
    m, _ = _build(["--target", "cpu", "--precision", "fp32", "--model", str(model)], tmp_path / "b")
    assert m["latency_budget_ms"] == 50.0  # the cpu target's default
    for bad in ("0", "-1", "nan", "1e9"):
        out = tmp_path / f"never-{bad}"
        code, _, err = run_main(["build", "--target", "cpu", "--model", model, "--budget-ms", bad, "--out", out],
                                capsys)
        assert code == 2 and err.startswith("error: budget ") and "Traceback" not in err and not out.exists()
    path = tmp_path / "build.toml"
    path.write_text('[build]\nbudget_ms = "3"\n')
    with pytest.raises(ConfigError, match="budget_ms = '3' is not a number"):
        read_config_file(path)
    path.write_text('[build]\nbudget_ms = 2.5\n')
    assert read_config_file(path).budget_ms == 2.5
