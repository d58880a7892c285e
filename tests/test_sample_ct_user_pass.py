"""A new user's pass over samples/ct (README commands and plausible mistakes): each test fails without its fix."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from samples.ct.scans import read_volume
from samples.ct.volume import SeriesError

REPO = Path(__file__).resolve().parents[1]
DICOM = "ct-chest-lung-pet-ct-dx-a0002"
NIFTI = "ct-totalsegmentator-example/example_ct.nii.gz"


def _ct(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "samples.ct", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _one_line_error(p: subprocess.CompletedProcess, error: str, hint: str) -> None:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert error in p.stderr and hint in p.stderr, p.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------- readers
def test_one_dicom_file_instead_of_its_folder_says_pass_the_folder(shared_data):
    """Was: "not a readable NIfTI file (Cannot work out file type …)", hint "check the file is complete (.nii)"."""
    f = shared_data / DICOM / "1-01.dcm"
    with pytest.raises(SeriesError, match="one DICOM file") as e:
        read_volume(f)
    assert "NIfTI" not in str(e.value) and str(shared_data / DICOM) in e.value.hint


def test_a_folder_holding_a_nifti_file_says_pass_the_file(shared_data, tmp_path):
    """Was: "no DICOM files in …", hint "a DICOM file has 'DICM' at byte 128", not naming the .nii.gz there."""
    shutil.copy(shared_data / NIFTI, tmp_path / "example_ct.nii.gz")
    with pytest.raises(SeriesError, match="NIfTI file") as e:
        read_volume(tmp_path)
    assert str(tmp_path / "example_ct.nii.gz") in e.value.hint


# -------------------------------------------------------------------------------------------- evaluate / build
def _builds(tmp_path: Path) -> Path:
    b = tmp_path / "b"
    b.mkdir()
    (b / "builds.json").write_text(json.dumps(
        {"builds": [{"model": "student", "target": "cpu", "precision": "fp32", "ok": True, "bundle": "x.dse"}]}))
    return b


def test_evaluate_out_that_is_a_file_is_refused_up_front(tmp_path, shared_data):
    """Was: the whole evaluation ran, then a FileExistsError traceback from report.write_json."""
    out = tmp_path / "report"
    out.write_text("not a directory")
    p = _ct(REPO, "evaluate", "--bundles", str(_builds(tmp_path)), "--out", str(out),
            "--volume", str(shared_data / NIFTI), "--timing-volume", "")
    _one_line_error(p, f"error: --out {out}: it is a file, not a directory", "hint: pass a directory for --out")
    assert out.read_text() == "not a directory"


def test_build_out_under_a_file_is_refused_before_the_inputs(tmp_path):
    """Was: a NotADirectoryError traceback from calibration.write_npz_dir after reading both volumes."""
    (tmp_path / "runs" / "ct-teacher").mkdir(parents=True)
    (tmp_path / "runs" / "ct-student").mkdir(parents=True)
    (tmp_path / "f").write_text("")
    p = _ct(tmp_path, "build", "--runs", "runs", "--out", str(tmp_path / "f" / "bundles"))
    _one_line_error(p, f"error: --out {tmp_path / 'f' / 'bundles'}: {tmp_path / 'f'} is a file, not a directory",
                    "hint: pass a directory for --out")
    assert "$ dsedge build" not in p.stderr and "calibration:" not in p.stderr


def test_evaluate_reads_the_timing_volume_before_any_model_runs(tmp_path, shared_data):
    """Was: a bad --timing-volume failed only after the whole held-out evaluation (models loaded, planned, run) with
    an error that did not name the option. Now it is read first: the missing bundle x.dse is never reached."""
    p = _ct(REPO, "evaluate", "--bundles", str(_builds(tmp_path)), "--out", str(tmp_path / "rep"),
            "--volume", str(shared_data / NIFTI), "--timing-volume", str(tmp_path / "no-such-series"))
    _one_line_error(p, f"error: no such CT volume: {tmp_path / 'no-such-series'} (the --timing-volume path)",
                    "hint: pass a DICOM series folder")
    assert not (tmp_path / "rep").exists()


def test_evaluate_names_the_volume_option_in_its_error(tmp_path, shared_data):
    p = _ct(REPO, "evaluate", "--bundles", str(_builds(tmp_path)), "--out", str(tmp_path / "rep"),
            "--volume", str(shared_data / DICOM / "1-01.dcm"), "--timing-volume", "")
    _one_line_error(p, f"error: {shared_data / DICOM / '1-01.dcm'}: one DICOM file (a single slice), not a volume "
                       "(the --volume path)", "hint: pass the folder holding the whole series")
    assert not (tmp_path / "rep").exists()


def _unfinished(run: Path) -> Path:
    """A run stopped by Ctrl-C during `python -m samples.ct train`: config, metrics, checkpoints, no final/."""
    for step in (40, 80):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("")
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")
    return run


def test_build_names_each_unfinished_run_once_and_tries_none_of_its_builds(tmp_path):
    """Was: the calibration inputs (~15 s), then one `dsedge build` per target and precision, each printing the same
    "… is a training run that has not finished" error: 6 times for 2 unfinished runs."""
    runs, out = tmp_path / "runs", tmp_path / "bundles"
    for model in ("teacher", "student"):
        _unfinished(runs / f"ct-{model}")
    p = _ct(REPO, "build", "--runs", str(runs), "--out", str(out))  # from the repo root: the CT data paths resolve
    _one_line_error(p, "error: 6 of 6 builds failed: teacher cpu fp32, student cpu fp32, student cpu int8, student "
                       "cpu auto, student jetson fp16, student jetson int8\n", "hint: their errors are above")
    for model in ("teacher", "student"):
        said = f"{runs / f'ct-{model}'} is a training run that has not finished (no final/model.json; its latest " \
               "checkpoint is step_80)"
        assert p.stderr.count(said) == 1, p.stderr
    assert p.stderr.count("hint: finish it: `python -m samples.ct train` resumes") == 2, p.stderr
    assert "$ dsedge build" not in p.stderr and "calibration:" not in p.stderr
    assert not (out / "inputs").exists()  # no student build ran: no calibration inputs
    builds = json.loads((out / "builds.json").read_text())["builds"]
    assert [(b["model"], b["target"], b["precision"], b["ok"]) for b in builds] == [
        ("teacher", "cpu", "fp32", False), ("student", "cpu", "fp32", False), ("student", "cpu", "int8", False),
        ("student", "cpu", "auto", False), ("student", "jetson", "fp16", False), ("student", "jetson", "int8", False)]
    for b in builds:
        assert f"ct-{b['model']} is a training run that has not finished" in b["error"], b


def test_build_with_an_unfinished_student_still_builds_the_teacher(tmp_path):
    """Only the student is unfinished: the teacher's build still runs (it fails here too: its directory holds no
    run), the student's five are recorded failed with its one error, and no calibration inputs are written."""
    runs, out = tmp_path / "runs", tmp_path / "bundles"
    (runs / "ct-teacher").mkdir(parents=True)
    _unfinished(runs / "ct-student")
    p = _ct(REPO, "build", "--runs", str(runs), "--out", str(out))
    _one_line_error(p, "error: 6 of 6 builds failed: teacher cpu fp32, student cpu fp32", "hint:")
    assert p.stderr.count("is a training run that has not finished") == 1, p.stderr
    assert p.stderr.count("$ dsedge build") == 1 and f"$ dsedge build --model {runs / 'ct-teacher'} " in p.stderr
    assert "calibration:" not in p.stderr and not (out / "inputs").exists()
    builds = json.loads((out / "builds.json").read_text())["builds"]
    assert len(builds) == 6 and not any(b["ok"] for b in builds)
    assert "not a Hugging Face model or a dsedge training run" in builds[0]["error"]
    assert all("ct-student is a training run that has not finished" in b["error"] for b in builds[1:])


def test_build_with_an_unfinished_teacher_still_writes_the_inputs_and_tries_the_student(tmp_path):
    """Only the teacher is unfinished: its one build is recorded failed with its one error and not tried; the
    student's calibration inputs are written and its five builds run (they fail here too: its directory holds no
    run), each with `--calib` and `--heldout` pointing at those inputs."""
    runs, out = tmp_path / "runs", tmp_path / "bundles"
    _unfinished(runs / "ct-teacher")
    (runs / "ct-student").mkdir(parents=True)
    p = _ct(REPO, "build", "--runs", str(runs), "--out", str(out), timeout=300)
    _one_line_error(p, "error: 6 of 6 builds failed: teacher cpu fp32, student cpu fp32", "hint:")
    assert p.stderr.count("is a training run that has not finished") == 1, p.stderr
    assert f"$ dsedge build --model {runs / 'ct-teacher'} " not in p.stderr
    assert p.stderr.count(f"$ dsedge build --model {runs / 'ct-student'} ") == 5, p.stderr
    assert p.stderr.count(f"--calib {out / 'inputs' / 'calib'} --heldout {out / 'inputs' / 'heldout'}") == 5
    assert "calibration:" in p.stderr and any((out / "inputs" / "calib").iterdir())
    builds = json.loads((out / "builds.json").read_text())["builds"]
    assert [(b["model"], b["ok"]) for b in builds] == [("teacher", False)] + [("student", False)] * 5
    assert "ct-teacher is a training run that has not finished" in builds[0]["error"]
    assert all("not a Hugging Face model or a dsedge training run" in b["error"] for b in builds[1:]), builds
