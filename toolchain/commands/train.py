"""``dsedge train CONFIG``: train a model from a TOML/YAML config (see docs/train.md); torchrun-ready."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import click


# torch.distributed.run without its ChildFailedError traceback: the failed rank has printed its own error (a rank's
# DsedgeError the launcher prints, once); the launcher exits with that rank's status (2 when any rank's was a
# DsedgeError, as in one process), and without its SignalException traceback when SIGTERM stops it (128 + 15). A rank
# that exits 2 (a DsedgeError: a config error at its first step fails the same way again) ends the elastic restarts.
# torchrun's own log lines lose their glog prefix ("W1205 06:12:33.123000 1234 torch/distributed/run.py:874]"), and
# its notices that ask nothing of the user (OMP_NUM_THREADS set to 1, SIGTERM sent to the other ranks, a rank that
# exited 2: its DsedgeError, which the launcher prints) are dropped.
_TORCHRUN = """import logging, sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run
_NOISE = ("Setting OMP_NUM_THREADS", "Sending process", "failed (exitcode: 2)")
for _handler in logging.getLogger("torch.distributed").handlers + logging.getLogger("torch").handlers:
    _handler.setFormatter(logging.Formatter("torchrun: %(message)s"))
    _handler.addFilter(lambda r: not r.getMessage().lstrip("\\n*").startswith(_NOISE))
try:  # torchrun's agent internals (torch 2.13): without them, restarts happen as torchrun's own
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    _monitor = LocalElasticAgent._monitor_workers
    def _monitor_workers(self, worker_group):
        result = _monitor(self, worker_group)
        if result.state == WorkerState.FAILED and any(f.exitcode == 2 for f in result.failures.values()):
            self._remaining_restarts = 0
        return result
    LocalElasticAgent._monitor_workers = _monitor_workers
except (ImportError, AttributeError):
    pass
from torch.distributed.elastic.multiprocessing.api import SignalException
try:
    run(parse_args(sys.argv[1:]))
except SignalException as e:  # SIGTERM from the launcher (or SIGINT): its workers are stopped, no traceback
    sys.exit(128 + int(e.sigval))
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    code = failure.exitcode
    if any(f.exitcode == 2 for f in e.failures.values()):  # a rank's DsedgeError, which the launcher prints
        sys.exit(2)
    if code < 0:
        print(f"error: rank {rank} was killed by signal {-code}", file=sys.stderr)
        print("  hint: see the system log (e.g. the OOM killer); --max-restarts N restarts the group", file=sys.stderr)
    sys.exit(code if 0 < code < 256 else 1)
"""


def launch_torchrun(verb: str, config: str, nproc: int, max_restarts: int) -> int:
    """Re-run ``dsedge VERB CONFIG`` under ``torch.distributed.run`` on this node (standalone rendezvous); returns
    0, or the exit status of the first rank that failed (2 for a DsedgeError), after its own error line and
    without torchrun's ChildFailedError traceback. ``max_restarts`` restarts the group after a crash or a killed
    rank, not after a rank's DsedgeError (exit 2): that would fail the same way each time.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with a shared store, restarts after a killed rank hang (measured). torchrun's
    log dir (its error files) is a temporary folder removed at the end: by default each run left a
    ``$TMPDIR/torchelastic_*`` behind. A DsedgeError the ranks raise is printed here, once (``report_rank_errors``),
    not once per rank."""
    with tempfile.TemporaryDirectory(prefix="dsedge-torchrun-") as logs:
        errors = Path(logs) / "rank-errors"
        errors.mkdir()
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{RANK_ERRORS: str(errors)})
        cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", f"--log-dir={logs}", "-m", "dsedge.cli", verb, config]
        proc = subprocess.Popen(cmd, env=env)
        try:
            code = proc.wait()
            if code:
                report_rank_errors(errors)
            return code
        except BaseException:
            # SIGTERM or SIGINT reached this launcher (the CLI turns both into KeyboardInterrupt): torchrun stops
            # its ranks on SIGTERM. subprocess.call's SIGKILL instead left both ranks running, orphaned, to the end
            # of the run (a user's pass, 2026-12-06)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise


# set by launch_torchrun for its ranks: the folder where each leaves its DsedgeError for the launcher to print once
RANK_ERRORS = "DSEDGE_RANK_ERRORS"


def report_rank_errors(folder: Path) -> None:
    """Print the DsedgeErrors the ranks left in ``folder`` (``rank{R}.json``), each distinct one once, lowest rank
    first, as the CLI prints one (``error: …`` and ``  hint: …`` on stderr)."""
    found: list[tuple[str, str]] = []
    for f in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 1 << 30):
        try:
            e = json.loads(f.read_text())
            line = (str(e["message"]), str(e.get("hint") or ""))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if line not in found:
            found.append(line)
    for message, hint in found:
        click.secho(f"error: {message}", fg="red", err=True)
        if hint:
            click.echo(f"  hint: {hint}", err=True)


def leave_for_launcher(err) -> None:  # type: ignore[no-untyped-def]
    """Under ``launch_torchrun``: write ``err`` (a DsedgeError) where the launcher prints it once, then exit with its
    status without printing it (every rank would). Elsewhere, or when that write fails: return (the CLI prints it)."""
    folder = os.environ.get(RANK_ERRORS)
    if not folder or not under_torchrun():
        return
    rank = os.environ.get("RANK", "0")
    try:
        tmp = Path(folder) / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"message": str(err), "hint": err.hint}))
        os.replace(tmp, Path(folder) / f"rank{rank}.json")
    except OSError:
        return
    exit_rank(err.exit_code, err)


def exit_rank(code: int, err: BaseException) -> NoReturn:
    """End this rank with ``code`` after ``err``, freeing first what ``err``'s traceback holds (the model, DDP and its
    process group): left to the interpreter's exit, its C++ threads sometimes aborted the process ("terminate called
    without an active exception", signal 6; 1 run in ~8 of a 2-rank checkpoint-write failure), which torchrun
    reported in place of the rank's error. The run's own teardown (parallel.teardown) frees them the same way."""
    import gc

    err.__traceback__ = err.__context__ = err.__cause__ = None
    gc.collect()
    raise SystemExit(code) from None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def run_rank(run, cfg, verb: str = "train"):  # type: ignore[no-untyped-def]
    """``run(cfg)`` on this rank. Under torchrun, a collective that fails because another rank died (gloo:
    "Connection reset by peer") ends this rank with one line and exit status 1, which torchrun's restarts (if any)
    take over, instead of a Python traceback through torch.distributed printed beside torchrun's own report.
    A write the disk refused is a StorageError whose hint names the config's out_dir (there is no --out); under the
    launcher a DsedgeError is left for it to print once (``leave_for_launcher``)."""
    from ...runtime.errors import DsedgeError

    try:
        return _run_rank(run, cfg)
    except OSError as e:
        from ..train.run_files import run_storage_error

        err = run_storage_error(e, f"dsedge {verb}")
        if err is None:
            raise
        e.__traceback__ = None  # what it holds is freed before this rank exits (exit_rank)
        leave_for_launcher(err)
        raise err from None
    except DsedgeError as e:
        leave_for_launcher(e)
        raise
    except KeyboardInterrupt as e:  # SIGTERM from torchrun (a peer failed, or the launcher was stopped), or Ctrl-C
        if os.environ.get(RANK_ERRORS) and under_torchrun():  # the launcher says so, once, not every rank
            exit_rank(128 + e.args[0] if e.args and isinstance(e.args[0], int) else 130, e)  # the CLI's Terminated
        raise


def _run_rank(run, cfg):  # type: ignore[no-untyped-def]
    try:
        return run(cfg)
    except Exception as e:  # noqa: BLE001 - only a lost peer is turned into a line; anything else re-raised
        import torch.distributed as dist

        text = str(e)
        lost = isinstance(e, getattr(dist, "DistBackendError", ())) or any(p in text for p in _PEER_GONE)
        if not (under_torchrun() and lost):
            raise
        first = text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__
        click.echo(f"error: rank {os.environ.get('RANK', '?')} lost a peer process mid-step ({first})", err=True)
        click.echo("  hint: another rank failed or was killed (its own message, or torchrun's, says why); "
                   "--max-restarts N restarts the group from its latest checkpoint", err=True)
        sys.exit(1)


def check_launch(verb: str, config: str, nproc: int | None, max_restarts: int):  # type: ignore[no-untyped-def]
    """Read and check CONFIG in this process, before anything starts: under ``--nproc-per-node`` a mistake is one
    line here, not one per rank followed by torchrun's ChildFailedError traceback. Returns the TrainConfig.

    Raises:
        click.UsageError: ``--max-restarts`` without ``--nproc-per-node`` (only torchrun restarts).
        ConfigError: what ``load_config`` raises; a mesh ``--nproc-per-node`` processes cannot hold; more processes
            than visible GPUs under CUDA; a factory that cannot be imported; ``dsedge train`` on a config with a
            ``[distill]`` section (it would train without the teacher).
        SourceError: ``dsedge distill`` whose teacher is not a finished run.
    """
    from ...runtime.errors import ConfigError
    from ..train.config import load_config, resolve_callable
    from ..train.validation import check_world

    if max_restarts and nproc is None and not under_torchrun():
        raise click.UsageError("--max-restarts needs --nproc-per-node N (torchrun restarts the group)")
    cfg = load_config(config, distill=verb == "distill")
    if verb == "train" and cfg.distill is not None:
        raise ConfigError(f"{config} has a [distill] section, which `dsedge train` does not use",
                          f"run `dsedge distill {config}` to distill from the teacher, or delete [distill]")
    if nproc is not None and not under_torchrun():
        import torch  # no CUDA context in the launcher: the ranks pick their own device

        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        check_world(cfg, nproc, "cuda" if cuda else "cpu")
        gpus = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
        if cuda and nproc > gpus:  # each rank would refuse (parallel.pick_device), once per rank, under torchrun
            raise ConfigError(f"{cfg.source}: --nproc-per-node {nproc} on CUDA and "
                              + (f"only {gpus} GPU{'s' * (gpus != 1)} visible" if gpus else "no CUDA GPU visible"),
                              f"use --nproc-per-node {gpus} (one process per GPU)" if gpus else "use device = 'auto'")
        resolve_callable(cfg.model.factory, "[model] factory")
        resolve_callable(cfg.data.factory, "[data] factory")
        if verb == "distill":
            from ..train.export_source import read_model_json

            read_model_json(cfg.distill.teacher)
    return cfg


def finished_line(verb: str, result) -> str:  # type: ignore[no-untyped-def]
    """What rank 0 prints at the end of ``dsedge train`` / ``dsedge distill`` (``verb``)."""
    if result.steps == result.resumed_from:
        return (f"nothing to {verb}: {result.run_dir} is already at step {result.steps}, its last checkpoint "
                "(raise `steps` in the config to go on, or choose another out_dir for a new run)")
    done = {"train": "trained", "distill": "distilled"}[verb]
    return f"{done} {result.steps} steps, loss {result.final_loss:.6g}: {result.run_dir}"


@click.command(name="train")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="Start N processes on this node via torchrun (default: run in this process, or as launched).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --nproc-per-node: restart the group this many times after a failure (resumes from the "
                   "latest checkpoint); not after a rank's config or training error (exit status 2).")
def train(config: str, nproc: int | None, max_restarts: int) -> None:
    """Train the model a config describes; writes OUT/config.toml, metrics.jsonl, checkpoints/, final/."""
    cfg = check_launch("train", config, nproc, max_restarts)
    if nproc is not None and not under_torchrun():
        sys.exit(launch_torchrun("train", config, nproc, max_restarts))
    from ..train.train import run

    result = run_rank(run, cfg, "train")
    if int(os.environ.get("RANK", 0)) == 0:
        click.echo(finished_line("train", result))
