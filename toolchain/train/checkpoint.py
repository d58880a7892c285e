"""Distributed checkpoints (torch.distributed.checkpoint), written atomically; resume from the latest complete one.

Layout: ``RUN/checkpoints/step_N/`` holding the DCP shards and ``.metadata`` (model + optimizer state, resharded
on load if the mesh changed), ``rng_rank{R}.pt`` (tensors only), ``trainer.json`` (step, sampler, scaler, LR schedulers,
health counters) and ``COMPLETE`` (JSON: step, world size, size and sha256 of every file). Every rank writes into
``.step_N.tmp``; after a barrier rank 0 hashes the files, writes ``COMPLETE`` and renames the folder into place, so a
crash never leaves a folder named ``step_N`` that is half written. On resume a checkpoint whose ``COMPLETE`` is
missing or whose files do not match it, or that fails to load, is skipped with a log line and the next older one
is tried. Note: DCP's ``.metadata`` is a pickle written by torch; only load checkpoints this run wrote.
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

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def steps(self) -> list[tuple[int, Path]]:
        """Checkpoint folders named step_N (complete or not), newest first."""
        if not self.root.is_dir():
            return []
        out = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(out, reverse=True)

    def save(self, step: int, model: torch.nn.Module, optimizers: list, trainer: dict) -> Path:
        """Write checkpoint ``step`` collectively (all ranks call it); returns the final folder."""
        from torch.distributed.checkpoint import FileSystemWriter, save
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp, final = self.root / f".step_{step}.tmp", self.root / f"step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        msd, osd = get_state_dict(model, optimizers)
        _dcp_call(save, {"model": msd, "optim": osd}, storage_writer=FileSystemWriter(tmp, sync_files=True))
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        self._barrier()
        if self.rank == 0:
            (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer}, sort_keys=True))
            files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
            world = dist.get_world_size() if dist.is_initialized() else 1
            (tmp / COMPLETE).write_text(json.dumps({"step": step, "world_size": world, "files": files}))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self._barrier()
        return final

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
        state (with ``step``) or None when there is none. Corrupt or partial ones are skipped with a log line."""
        from torch.distributed.checkpoint import FileSystemReader, load
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        candidates = _broadcast_obj([(s, str(p)) for s, p in self.steps()] if self.rank == 0 else None)
        for step, p in candidates:
            path = Path(p)
            reason = _broadcast_obj(self.verify(path) if self.rank == 0 else None)
            if reason is None:
                try:
                    # a fresh optimizer has no state: get_state_dict builds it only when grads are None
                    for o in optimizers:
                        o.zero_grad(set_to_none=True)
                    msd, osd = get_state_dict(model, optimizers)
                    state = {"model": msd, "optim": osd}
                    _dcp_call(load, state, storage_reader=FileSystemReader(path))
                    ok = True
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
                    _refuse_other_model(path, e)  # any other failure: try the next older checkpoint
                    ok, reason = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if _all_true(ok):
                    set_state_dict(model, optimizers, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"])
                    rng = path / f"rng_rank{self.rank}.pt"
                    if rng.is_file():
                        set_rng_state(torch.load(rng, weights_only=True))
                    return json.loads((path / "trainer.json").read_text())
                reason = reason or "failed to load on another rank"
            if self.rank == 0:
                self.log(f"skipping checkpoint {path}: {reason}")
        return None


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
