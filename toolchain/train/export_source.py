"""Load a finished dsedge run directory as a model to export: the build's source resolver for ``--model RUN_DIR``.

Reads ``RUN/final/model.json`` and ``RUN/final/model.safetensors`` only (JSON + safetensors: no pickle, no code from
the run directory; the model class comes from the ``factory`` named in model.json, imported from the environment).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...runtime.errors import SourceError

_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def is_run_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a finished dsedge training run (``final/model.json``)."""
    return (Path(path) / "final" / "model.json").is_file()


def read_model_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's ``final/model.json``; SourceError when missing or malformed."""
    f = Path(run_dir) / "final" / "model.json"
    if not f.is_file():
        raise SourceError(f"{run_dir} is not a finished dsedge run (no final/model.json)",
                          "train it to the end with `dsedge train CONFIG`, or pass a model file")
    try:
        meta = json.loads(f.read_text())
    except ValueError as e:
        raise SourceError(f"{f} is not valid JSON ({e})", "re-run training to rewrite it") from None
    for key in ("factory", "kwargs", "input_names", "example_inputs"):
        if key not in meta:
            raise SourceError(f"{f} lacks {key!r}", "re-run training with this dsedge version")
    return meta


def load_trained(run_dir: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(torch.nn.Module in eval mode on CPU, example_inputs)`` for a finished run.

    example_inputs maps each input name to a zero tensor of the recorded shape (batch axis 0 of size 1, exported as
    dynamic) and dtype. Raises SourceError: not a run dir, factory not importable, weights missing or not matching
    the model (names listed).
    """
    import torch
    from safetensors.torch import load_file

    from ...runtime.errors import ConfigError
    from .config import resolve_callable

    meta = read_model_json(run_dir)
    weights = Path(run_dir) / "final" / "model.safetensors"
    if not weights.is_file():
        raise SourceError(f"{weights} is missing", "re-run training to the end")
    try:
        factory = resolve_callable(meta["factory"], "model factory")
    except ConfigError as e:
        raise SourceError(str(e), e.hint) from None
    model = factory(**meta["kwargs"])
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SourceError(f"{weights} does not match {meta['factory']}: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}", "the factory or its kwargs changed since training")
    model.eval()
    examples = {}
    for name in meta["input_names"]:
        spec = meta["example_inputs"][name]
        if spec["dtype"] not in _DTYPES:
            raise SourceError(f"model.json: input {name!r} has unsupported dtype {spec['dtype']!r}",
                              "re-run training with this dsedge version")
        examples[name] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    return model, examples
