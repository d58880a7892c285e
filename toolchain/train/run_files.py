"""What a run writes besides checkpoints and metrics: the resolved ``config.toml`` at the start, and ``final/``
(``model.safetensors`` + ``model.json``) gathered from every rank at the end; both written atomically. A write the
disk refuses is a StorageError whose hint names the config's ``out_dir`` (``run_storage_error``)."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.errors import StorageError
from ...runtime.storage import storage_error
from . import parallel as par
from .config import TrainConfig, dump_toml


def model_state_for_export(model: torch.nn.Module, env: par.DistEnv) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 state dict on CPU, gathered from every pipeline stage; complete on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload keeps the full dict on global rank 0 only: pipeline stages need it on each stage's first rank
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=env.pp == 1))
    sd = {k: v.detach().to("cpu").clone().contiguous() for k, v in sd.items()}
    if env.pp > 1:
        parts: list[Any] = [None] * env.world_size
        dist.all_gather_object(parts, sd if env.dp_rank == 0 and env.tp_rank == 0 else {})
        sd = {k: v for part in parts for k, v in part.items()}
    return sd


def write_final(run_dir: Path, cfg: TrainConfig, state: dict[str, torch.Tensor], example: tuple, step: int) -> Path:
    """``final/model.safetensors`` + ``final/model.json`` (factory, kwargs, io names, example shapes/dtypes), atomic."""
    from safetensors.torch import save_file

    from ...runtime.bundle import atomic_directory
    from ...runtime.files import usual_mode

    names = list(cfg.model.input_names) or [f"input_{i}" for i in range(len(example))]
    meta = {
        "format": "dsedge-trained-model", "version": 1, "step": step,
        "factory": cfg.model.factory, "kwargs": cfg.model.kwargs,
        "input_names": names, "output_names": list(cfg.model.output_names),
        "example_inputs": {n: {"shape": [1, *t.shape], "dtype": str(t.dtype).removeprefix("torch.")}
                           for n, t in zip(names, example)},
        "precision": cfg.precision.mode,
    }
    with atomic_directory(run_dir / "final") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", usual_mode())  # safetensors writes 0600; model.json gets the umask's
        (tmp / "model.json").write_text(json.dumps(meta, indent=2))
    return run_dir / "final"


def write_resolved_config(run_dir: Path, cfg: TrainConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.toml.tmp"
    tmp.write_text(dump_toml(cfg.to_dict()))
    os.replace(tmp, run_dir / "config.toml")


# `dsedge train` and `dsedge distill` write where the config's out_dir says: the generic hints name `--out`, an
# option they do not have
_OUT_DIR_HINTS = {
    errno.ENOSPC: "free space on the disk of out_dir (or set another out_dir in the config) and run again",
    errno.EDQUOT: "free space under your quota, or set another out_dir in the config",
    errno.EROFS: "set a writable out_dir in the config",
    errno.ENAMETOOLONG: "set a shorter out_dir in the config",
}


def run_storage_error(err: OSError, what: str) -> StorageError | None:
    """``runtime.storage.storage_error`` for a run's writes: its one line, with a hint that names the config's
    ``out_dir``; None for an OSError that is not a storage condition."""
    return storage_error(err, what, _OUT_DIR_HINTS)
