"""Distributed checkpoints (torch.distributed.checkpoint), written atomically; resume from the latest complete one.

Layout: ``RUN/checkpoints/step_N/`` holding the DCP shards and ``.metadata`` (model + optimizer state, resharded
on load if the mesh changed), ``rng_rank{R}.pt`` (tensors only), ``trainer.json`` (step, sampler, scaler, LR schedulers,
health counters) and ``COMPLETE`` (JSON: step, world size, size and sha256 of every file). Every rank writes into
``.step_N.tmp``; after a barrier rank 0 hashes the files, writes ``COMPLETE`` and renames the folder into place, so a
crash never leaves a folder named ``step_N`` that is half written. On resume a checkpoint whose ``COMPLETE`` is
missing or whose files do not match it, or that fails to load, is skipped with a log line and the next older one
is tried. Loading runs no code from the folder (checkpoint_reader.py: ``.metadata`` and the non-tensor entries are
read by restricted unpicklers); a checkpoint that would is refused with a ConfigError, not skipped. A write that the
disk refuses (full, a quota or file-size limit) is a one-line StorageError on every rank, with ``.step_N.tmp``
removed and the earlier checkpoints untouched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...runtime.files import sha256_file

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"
# DCP warns on every single-process save and load, even when told so with ``no_dist=True``
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def _dcp_call(fn: Callable, state: dict, **kwargs: Any) -> Any:
    # DCP's save/load; in a single process (no process group) as one, without its warning
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        return fn(state, no_dist=no_dist, **kwargs)


def _all_true(ok: bool) -> bool:
    if not dist.is_initialized():
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _broadcast_obj(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_reasons(reason: Any) -> list[tuple[int, Any]]:
    """``(rank, reason)`` of every rank whose ``reason`` is not None, lowest rank first (collective)."""
    if not dist.is_initialized():
        return [] if reason is None else [(0, reason)]
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, reason)
    return [(r, x) for r, x in enumerate(box) if x is not None]


def _own_failure(err: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException: this rank's, else the lowest failed rank's; ``err`` itself
    for any other exception."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return err
    own = failures.get(dist.get_rank() if dist.is_initialized() else 0)
    return (own or failures[min(failures)])[0]


def _attempt(fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn``; None, or the exception it raised (unwrapped from DCP's CheckpointException). An interrupt that DCP
    caught and wrapped (SIGTERM, Ctrl-C) is raised again, as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        inner = _own_failure(e)
        if isinstance(inner, (KeyboardInterrupt, SystemExit)):
            raise inner from None
        return inner
    return None


def _write_failure(what: str, err: BaseException | None) -> BaseException:
    """The error every rank raises after a write failed on one or more ranks (collective): the lowest failed rank's
    storage OSError as a StorageError (the same line on every rank); otherwise this rank's own exception as it is
    (a bug, with its traceback), or a TrainingError naming the rank that failed."""
    from ...runtime.errors import TrainingError
    from .run_files import run_storage_error

    mine = None
    if isinstance(err, OSError):
        mine = ("os", err.errno, err.strerror, err.filename, err.filename2)
    elif err is not None:
        mine = ("other", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}")
    rank, first = (_all_reasons(mine) or [(0, ("other", "unknown error"))])[0]
    if first[0] == "os":
        found = run_storage_error(OSError(first[1], first[2], first[3], None, first[4]), what)
        if found is not None:
            return found
    if err is not None:
        return err
    return TrainingError(f"{what} failed on rank {rank}: {first[-1] if first[0] == 'other' else first[2]}",
                         "that rank's error says why")


def rng_state() -> dict[str, torch.Tensor]:
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(s: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(s["cpu"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


class Checkpointer:
    """Save/restore ``model`` + ``optimizers`` (+ JSON trainer state and per-rank RNG) under ``run_dir/checkpoints``.

    ``log`` receives one-line messages (skipped checkpoints). ``keep``: newest N complete checkpoints kept.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, keep: int | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.keep = keep
        self.log = log

    def steps(self) -> list[tuple[int, Path]]:
        """Checkpoint folders named step_N (complete or not), newest first."""
        if not self.root.is_dir():
            return []
        out = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(out, reverse=True)

    def save(self, step: int, model: torch.nn.Module, optimizers: list, trainer: dict) -> Path:
        """Write checkpoint ``step`` collectively (all ranks call it); returns the final folder.

        Raises:
            StorageError: on every rank, when a write of any rank failed for lack of space, a quota or file-size
                limit, or permission; ``.step_N.tmp`` is removed, the complete checkpoints are untouched.
        """
        tmp, final = self.root / f".step_{step}.tmp", self.root / f"step_{step}"
        try:
            err = _attempt(lambda: self._prepare(tmp)) if self.rank == 0 else None
            if _all_true(err is None):  # also the barrier: the folder is there for every rank
                err = _attempt(lambda: self._write_shards(tmp, model, optimizers))
                if _all_true(err is None) and self.rank == 0:
                    err = _attempt(lambda: self._publish(step, tmp, final, trainer))
            if _all_true(err is None):
                return final
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:  # an interrupt (SIGTERM, Ctrl-C): no half-written folder left behind
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        raise _write_failure(f"writing checkpoint step_{step} in {self.root}", err)

    def _prepare(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def _write_shards(self, tmp: Path, model: torch.nn.Module, optimizers: list) -> None:
        from torch.distributed.checkpoint import FileSystemWriter, save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizers)
        _dcp_call(save, {"model": msd, "optim": osd}, storage_writer=FileSystemWriter(tmp, sync_files=True))
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")

    def _publish(self, step: int, tmp: Path, final: Path, trainer: dict) -> None:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, sort_keys=True))
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
        world = dist.get_world_size() if dist.is_initialized() else 1
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "world_size": world, "files": files}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()

    def _prune(self) -> None:
        if self.keep is None:
            return
        complete = [(s, p) for s, p in self.steps() if (p / COMPLETE).is_file()]
        for _, p in complete[self.keep:]:
            shutil.rmtree(p, ignore_errors=True)

    def verify(self, path: Path) -> str | None:
        """None when ``path`` is a complete, intact checkpoint; else why not (one line)."""
        marker = path / COMPLETE
        if not marker.is_file():
            return "no COMPLETE marker (partial write)"
        try:
            files = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError) as e:
            return f"unreadable COMPLETE marker ({e})"
        for name, info in files.items():
            if not isinstance(name, str) or (path / name).resolve().parent != path.resolve():
                return f"file name {name!r} in the COMPLETE marker leaves the checkpoint"
            f = path / name
            if not f.is_file():
                return f"missing file {name}"
            if f.stat().st_size != info["bytes"]:
                return f"{name} has {f.stat().st_size} bytes, expected {info['bytes']}"
            if sha256_file(f) != info["sha256"]:
                return f"{name} sha256 mismatch"
        return None

    def load_latest(self, model: torch.nn.Module, optimizers: list) -> dict | None:
        """Restore the newest loadable checkpoint into ``model``/``optimizers`` (collective); returns its trainer
        state (with ``step``) or None when there is none. Corrupt or partial ones are skipped with a log line.

        Raises:
            ConfigError: a checkpoint of another model or optimizer layout (``_refuse_other_model``), or one whose
                files would run code when loaded (checkpoint_reader.py), rather than start the run over.
        """
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from .checkpoint_reader import CheckedPlanner, CheckedReader, UnsafeCheckpoint, unsafe_reason

        candidates = _broadcast_obj([(s, str(p)) for s, p in self.steps()] if self.rank == 0 else None)
        for step, p in candidates:
            path = Path(p)
            reason = _broadcast_obj(self.verify(path) if self.rank == 0 else None)
            if reason is None:
                unsafe = None
                try:
                    # a fresh optimizer has no state: get_state_dict builds it only when grads are None
                    for o in optimizers:
                        o.zero_grad(set_to_none=True)
                    msd, osd = get_state_dict(model, optimizers)
                    state = {"model": msd, "optim": osd}
                    _dcp_call(load, state, storage_reader=CheckedReader(path), planner=CheckedPlanner())
                    ok = True
                except (Exception, CheckpointException, UnsafeCheckpoint) as e:  # noqa: BLE001 - BaseExceptions
                    if isinstance(_own_failure(e), (KeyboardInterrupt, SystemExit)):
                        raise _own_failure(e) from None  # SIGTERM or Ctrl-C inside DCP's load: not a bad checkpoint
                    unsafe = unsafe_reason(e)
                    if unsafe is None:
                        _refuse_other_model(path, e)  # any other failure: try the next older checkpoint
                    ok, reason = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if _all_true(ok):
                    set_state_dict(model, optimizers, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"])
                    rng = path / f"rng_rank{self.rank}.pt"
                    if rng.is_file():
                        set_rng_state(torch.load(rng, weights_only=True))
                    return json.loads((path / "trainer.json").read_text())
                _refuse_unsafe(path, _all_reasons(unsafe))
                reason = reason or "failed to load on another rank"
            if self.rank == 0:
                self.log(f"skipping checkpoint {path}: {reason}")
        return None


def _refuse_unsafe(path: Path, reasons: list[tuple[int, str]]) -> None:
    """A checkpoint whose files would run code (or read outside it) when loaded: someone else's files, whose
    COMPLETE marker was written to match them. Raise ConfigError, as for another model's checkpoint: skipping it
    would start the run over and overwrite the directory, silently."""
    from ...runtime.errors import ConfigError

    if reasons:
        raise ConfigError(f"refusing checkpoint {path}: {reasons[0][1]}",
                          f"checkpoints are loaded as data only, and loading this one could run code: delete "
                          f"{path.name} if this run did not write it, or set another out_dir") from None


_SIZE_MISMATCH = re.compile(r"Size mismatch between saved torch\.Size\((\[[^\]]*\])\) and current: "
                            r"torch\.Size\((\[[^\]]*\])\) for (\S+)")
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: ([^\s{}\"']+?)\.?$", re.M)  # not the source line


def _refuse_other_model(path: Path, err: BaseException) -> None:
    """A checkpoint that loads but does not fit the model (other sizes or another architecture) was written under
    another config: raise ConfigError rather than skip it and start over in the same run directory, whose
    checkpoints the new run would then overwrite; one whose optimizer groups differ (``[optim] lamb_threshold``
    changed) says so. Any other failure returns (the caller skips it as corrupt)."""
    from ...runtime.errors import ConfigError

    text = str(err)
    size, missing = _SIZE_MISMATCH.search(text), _MISSING_KEY.search(text)
    if not (size or missing):
        return
    what = (f"{size.group(3)} is {size.group(1)} there, {size.group(2)} now" if size
            else f"it has no {missing.group(1)}")
    if not size and missing.group(1).startswith("optim."):
        # the optimizer's groups differ: [optim] lamb_threshold moved parameters between LAMB and AdamW (or the
        # model changed); this said "another model" and pointed at [model] alone
        raise ConfigError(f"{path.parent.parent} holds checkpoints of another optimizer layout ({path.name}: {what})",
                          "restore the [optim] lamb_threshold (it sorts parameters into LAMB and AdamW) and the "
                          "[model] section this run was trained with, or set another out_dir") from None
    raise ConfigError(f"{path.parent.parent} holds checkpoints of another model ({path.name}: {what})",
                      "set another out_dir for the changed model, or restore the [model] section this run was "
                      "trained with") from None
