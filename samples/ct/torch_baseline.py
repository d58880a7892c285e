"""Host side: the plain PyTorch fp32 sliding window the bundles are compared against, and loading a finished
``dsedge train`` run for it (``final/model.json`` + ``final/model.safetensors``: JSON and safetensors only)."""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import numpy as np

from .infer import RunBatch
from .volume import SeriesError


def load_run(run_dir: str | os.PathLike):
    """The trained model of a dsedge run directory, eval mode, fp32, CPU.

    Raises:
        SeriesError: not a finished run (no final/model.json or weights).
    """
    import torch
    from safetensors.torch import load_file

    d = Path(run_dir) / "final"
    if not (d / "model.json").is_file() or not (d / "model.safetensors").is_file():
        raise SeriesError(f"{run_dir} is not a finished dsedge run (final/model.json, final/model.safetensors)",
                          "run `dsedge train samples/ct/teacher.toml` (and `dsedge distill …`) first")
    meta = json.loads((d / "model.json").read_text())
    mod, fn = meta["factory"].split(":")
    kwargs = dict(meta.get("kwargs", {}))
    kwargs["checkpointing"] = False
    model = getattr(importlib.import_module(mod), fn)(**kwargs)
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    return model.eval().to(torch.float32)


def torch_runner(model, threads: int | None = None) -> RunBatch:
    """A batch function running ``model`` in PyTorch eager fp32 under ``torch.inference_mode`` (the baseline)."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    def run(patches: np.ndarray, meta: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(patches), torch.from_numpy(meta)).numpy()

    return run
