"""`dsedge train` against hostile or failing surroundings: a copied run directory whose checkpoint would run code on
resume, a disk that refuses the checkpoint write, a rank's config error under the launcher, SIGTERM, and hints that
name only what train and distill take. Tiny real models; real `dsedge train` subprocesses and torchrun (gloo)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_models import config

from dsedge.runtime.errors import ConfigError
from dsedge.toolchain.train import train
from dsedge.toolchain.train.checkpoint import Checkpointer
from dsedge.toolchain.train.config import dump_toml, from_dict
from dsedge.toolchain.train.metrics import read_metrics

from test_train_recipe import TESTS, losses, one_thread  # noqa: F401  (one_thread: the module's autouse fixture)

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")


class _Opens:
    """Unpickled, it creates ``path`` (``open(path, "w")``): what a planted pickle could do instead."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(ckpt, files: dict[str, bytes]) -> None:
    """Write ``files`` into checkpoint folder ``ckpt`` and a COMPLETE marker that matches them, as someone handing
    over a run directory can."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
        marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    assert Checkpointer(ckpt.parent.parent).verify(ckpt) is None  # it passes the integrity check


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("robust") / "run"
    train.run(from_dict(config(out)))  # 6 steps, checkpoints at 3 and 6
    return out


def _resume_outcome(run):
    try:
        train.run(from_dict(config(run)))
    except Exception as e:  # noqa: BLE001 - the callers check it is the ConfigError, after the marker file
        return e
    return None


def test_a_planted_metadata_pickle_does_not_run_on_resume(finished, tmp_path, capsys):
    """DCP's FileSystemReader unpickled `.metadata` with plain pickle: a run directory copied from someone else ran
    their code on resume. It is now read by a restricted unpickler, and the run refuses the checkpoint (a ConfigError,
    not a silent start over that would overwrite the directory)."""
    from dsedge.cli import main

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "final")
    _plant(run / "checkpoints" / "step_6", {".metadata": pickle.dumps(_Opens(marker))})
    metrics = (run / "metrics.jsonl").read_text()
    err = _resume_outcome(run)
    assert not marker.exists(), "resuming ran the planted .metadata pickle"
    assert isinstance(err, ConfigError) and "\n" not in str(err), err
    ckpt = run / "checkpoints" / "step_6"
    assert str(err) == f"refusing checkpoint {ckpt}: .metadata references io.open, not allowed"
    assert err.hint == ("checkpoints are loaded as data only, and loading this one could run code: delete step_6 if "
                        "this run did not write it, or set another out_dir")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_6"]
    assert (run / "metrics.jsonl").read_text() == metrics and not (run / "final").exists()
    path = tmp_path / "t.toml"
    path.write_text(dump_toml(config(run)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    out = capsys.readouterr().err
    assert e.value.code == 2 and out.splitlines() == [f"error: {err}", f"  hint: {err.hint}"], out
    assert not marker.exists()
    # the same run without the planted checkpoint resumes as before, from step_3, on the same trajectory
    shutil.rmtree(run / "checkpoints" / "step_6")
    result = train.run(from_dict(config(run)))
    assert result.resumed_from == 3 and result.steps == 6
    assert losses(run) == losses(finished)


def test_a_no_op_rerun_of_a_finished_run_keeps_its_final_model(finished, tmp_path):
    """A rerun of a finished run with another precision resumed at its last step, trained nothing, and rewrote
    final/ saying precision bf16 for a model trained in fp32. Now final/ stays as the run that finished wrote it;
    a finished run whose final/ is missing (a crash after the last checkpoint) still gets one."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = {f: (run / "final" / f).read_bytes() for f in ("model.json", "model.safetensors")}
    cfg = config(run)
    cfg["precision"] = {"mode": "bf16"}
    result = train.run(from_dict(cfg))
    assert (result.steps, result.resumed_from) == (6, 6)
    # its loss is the finished run's last one (it read NaN: nothing trained), in the result and the log alike
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ends = [r for r in records if r.get("event") == "finished"]
    last = read_metrics(finished / "metrics.jsonl")[-1]["loss"]
    assert result.final_loss == pytest.approx(last) and ends[-1]["loss"] == pytest.approx(last)
    assert {f: (run / "final" / f).read_bytes() for f in before} == before
    assert json.loads(before["model.json"])["precision"] != "bf16"
    shutil.rmtree(run / "final")
    train.run(from_dict(config(run)))
    assert json.loads((run / "final" / "model.json").read_text())["step"] == 6


def test_a_planted_non_tensor_entry_does_not_run_on_resume(finished, tmp_path):
    """DCP's load planner read the checkpoint's non-tensor entries (the optimizer's param_groups) with
    torch.load(weights_only=False): a shard entry, named by a well-formed .metadata, ran code too."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    run, marker = tmp_path / "run", tmp_path / "pwned"
    shutil.copytree(finished, run)
    ckpt = run / "checkpoints" / "step_6"
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # this test's own file
    payload = io.BytesIO()
    torch.save(_Opens(marker), payload)
    key = MetadataIndex("optim.param_groups.0.lr")
    assert key in md.storage_data
    md.storage_data[key] = _StorageInfo("planted.distcp", 0, len(payload.getvalue()))
    _plant(ckpt, {"planted.distcp": payload.getvalue(), ".metadata": pickle.dumps(md)})
    err = _resume_outcome(run)
    assert not marker.exists(), "resuming ran the planted shard entry"
    assert isinstance(err, ConfigError), err
    assert "the shard entry optim.param_groups.0.lr references io.open, not allowed" in str(err)


def test_a_metadata_naming_a_file_outside_the_checkpoint_is_refused(finished, tmp_path):
    """A .metadata whose shard path leaves the folder made DCP read (and load into the model) any file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpt = run / "checkpoints" / "step_6"
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("../step_3/__0_0.distcp", 0, 10)
    _plant(ckpt, {".metadata": pickle.dumps(md)})
    err = _resume_outcome(run)
    assert isinstance(err, ConfigError), err
    assert "names shard file '../step_3/__0_0.distcp' outside the checkpoint" in str(err)


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _dsedge(tmp_path, cfg, *args, limit=None):
    path = tmp_path / "train.toml"
    path.write_text(dump_toml(cfg))
    return subprocess.run([sys.executable, "-m", "dsedge.cli", "train", str(path), *args], env=ENV, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size(limit) if limit else None)


@pytest.mark.parametrize("nproc, limit", [(None, 100_000), pytest.param(2, 50_000, marks=pytest.mark.slow)])
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(tmp_path, nproc, limit):
    """A write the disk refused in Checkpointer.save (a real EFBIG: the shards pass the file-size limit, the
    resumed run's config and metrics do not) ended in DCP's CheckpointException traceback, once per rank, exit 1,
    and left .step_6.tmp behind."""
    run = tmp_path / "run"
    train.run(from_dict(config(run, steps=3, device="cpu")))  # step_3 (its shard is 170 kB: past the limit)
    args = ["--nproc-per-node", str(nproc)] if nproc else []
    proc = _dsedge(tmp_path, config(run, device="cpu"), *args, limit=limit)
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert err.count("error:") == 1 and err.count("hint:") == 1, err
    assert (f"error: writing checkpoint step_6 in {run / 'checkpoints'} failed: a file grew past the size limit "
            "(ulimit -f or the filesystem's)") in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]  # no .step_6.tmp left
    assert Checkpointer(run).verify(run / "checkpoints" / "step_3") is None


@pytest.mark.slow
def test_a_ranks_config_error_under_the_launcher_is_printed_once(tmp_path):
    """`--nproc-per-node 2` with an error only the ranks see (the data gives 1 input, input_names 2): each rank
    printed it, interleaved, then torchrun added "failed (exitcode: 2) local_rank: 0 ...". The launcher prints it."""
    cfg = config(tmp_path / "run", device="cpu", model={"input_names": ["a", "b"]})
    proc = _dsedge(tmp_path, cfg, "--nproc-per-node", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert out.splitlines() == [f"error: {tmp_path / 'train.toml'}: [model] input_names has 2 names but the data "
                                "gives 1 inputs", "  hint: list one name per model input"], out
    assert not (tmp_path / "run").exists()


def _stop_while_training(tmp_path, sig, *args):
    run = tmp_path / "run"
    path = tmp_path / "train.toml"
    path.write_text(dump_toml(config(run, device="cpu", steps=100_000, checkpoint={"every": 100_000})))
    # Ctrl-C as at a terminal: a test run in the background of a non-interactive shell (`cmd &`, as CI scripts may
    # start it) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child
    proc = subprocess.Popen([sys.executable, "-m", "dsedge.cli", "train", str(path), *args], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.1)
        assert (run / "metrics.jsonl").exists(), "training never started"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("sig, code, line", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGINT, 130, "aborted")])
def test_sigterm_exits_143_and_ctrl_c_130(tmp_path, sig, code, line):
    """SIGTERM was raised as a KeyboardInterrupt and exited 130, the status of Ctrl-C: a job scheduler or torchrun
    could not tell a stop from an interrupt. 128 + 15 now; still unwinding (the run's finally blocks)."""
    rc, err = _stop_while_training(tmp_path, sig)
    assert rc == code and "Traceback" not in err, err
    assert err.strip().splitlines() == [line], err


@pytest.mark.slow
def test_sigterm_to_the_launcher_exits_143_in_one_line(tmp_path):
    """`kill` of `dsedge train --nproc-per-node 2`: exit 130, each rank's "aborted" and torchrun's SignalException
    traceback. Now the launcher's own line (after torchrun's notice) and 143."""
    rc, err = _stop_while_training(tmp_path, signal.SIGTERM, "--nproc-per-node", "2")
    assert rc == 143 and "Traceback" not in err, err
    assert err.count("terminated (SIGTERM)") == 1 and "aborted" not in err, err


def test_storage_hints_of_a_run_name_out_dir_not_out(tmp_path, capsys):
    """`dsedge train`'s storage errors borrowed build's hints ("choose a shorter --out", "choose another --out"):
    train and distill have no --out; the run directory is the config's out_dir. A real ENAMETOOLONG."""
    import errno

    from dsedge.cli import main

    path = tmp_path / "t.toml"
    path.write_text(dump_toml(config(tmp_path / ("x" * 300), device="cpu")))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: dsedge train failed: a path is too long" in err, err
    assert "--out" not in err and "hint: set a shorter out_dir in the config" in err, err
    from dsedge.toolchain.train.run_files import run_storage_error

    full = run_storage_error(OSError(errno.ENOSPC, "No space left on device", "/r/metrics.jsonl"), "dsedge train")
    assert str(full) == "dsedge train failed: the disk is full (/r/metrics.jsonl)"
    assert full.hint == ("free space on the disk of out_dir (or set another out_dir in the config) and run again; "
                         "nothing half-written was published")


def test_a_teacher_that_is_not_a_run_is_not_offered_a_model_file(tmp_path, capsys):
    """`dsedge distill` with a teacher that is not a finished run hinted "or pass a model file": a teacher is a run."""
    from dsedge.cli import main

    path = tmp_path / "d.toml"
    path.write_text(dump_toml(config(tmp_path / "run", device="cpu", distill={"teacher": str(tmp_path / "none")})))
    with pytest.raises(SystemExit) as e:
        main(["distill", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not a finished dsedge run (no final/model.json)" in err, err
    assert "model file" not in err and "set [distill] teacher to the out_dir of a finished run" in err, err
