"""Load a finished dsedge run directory as a model to export: the build's source resolver for ``--model RUN_DIR``.

Reads ``RUN/final/model.json`` and ``RUN/final/model.safetensors`` only (JSON + safetensors: no pickle, no code from
the run directory; the model class comes from the ``factory`` named in model.json, imported from the environment).

A run directory may come from someone else (a teacher handed over, a run copied between machines), and its
model.json could name any callable in the environment with any keyword arguments: ``"factory": "os:system"`` ran a
shell command on ``dsedge build --model RUN`` and ``dsedge distill`` (a user's pass, 2026-12-06). So the factory
must be a model factory this environment vouches for (``check_factory``): a ``torch.nn.Module`` class; a function
of dsedge or its samples; a function of your own code (a module found on the path, as a training config names it,
that is neither the standard library nor an installed package in site-packages); or one of the modules listed in
``DSEDGE_TRUST_FACTORIES`` (comma-separated module prefixes, e.g. ``timm,mylib.models``), as a user of transformers
passes ``trust_remote_code``. What it returns must be a ``torch.nn.Module``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...runtime.errors import SourceError

TRUST_ENV = "DSEDGE_TRUST_FACTORIES"
_TRUSTED = ("dsedge", "samples")  # dsedge's own and its samples' model factories
_DTYPES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


def is_run_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a finished dsedge training run (``final/model.json``)."""
    return (Path(path) / "final" / "model.json").is_file()


def read_model_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's ``final/model.json``; SourceError when missing or malformed."""
    f = Path(run_dir) / "final" / "model.json"
    if not f.is_file():
        raise SourceError(f"{run_dir} is not a finished dsedge run (no final/model.json)",
                          # distill's teacher comes here (build checks final/model.json first): it is never a file
                          "train it to the end with `dsedge train CONFIG`, or set [distill] teacher to the out_dir "
                          "of a finished run")
    try:
        meta = json.loads(f.read_text())
    except ValueError as e:
        raise SourceError(f"{f} is not valid JSON ({e})", "re-run training to rewrite it") from None
    for key in ("factory", "kwargs", "input_names", "example_inputs"):
        if key not in meta:
            raise SourceError(f"{f} lacks {key!r}", "re-run training with this dsedge version")
    return meta


def check_factory(spec: str, fn: Any, where: str) -> None:
    """Refuse a model.json factory this environment does not vouch for (see the module doc).

    Raises:
        SourceError: ``fn`` (named ``spec`` in ``where``) is not a ``torch.nn.Module`` class, nor a function of
            dsedge, its samples, your own code (outside the standard library and site-packages) or a module listed
            in ``DSEDGE_TRUST_FACTORIES``.
    """
    import inspect
    import site
    import sysconfig

    import torch

    if inspect.isclass(fn) and issubclass(fn, torch.nn.Module):
        return
    module = getattr(fn, "__module__", None) or ""
    trusted = _TRUSTED + tuple(m.strip() for m in os.environ.get(TRUST_ENV, "").split(",") if m.strip())
    if any(module == t or module.startswith(t + ".") for t in trusted):
        return
    mod = inspect.getmodule(fn)
    file = getattr(mod, "__file__", None)
    if file and inspect.isfunction(fn):
        path = Path(file).resolve()
        places = [p for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")]
        places += [*site.getsitepackages(), site.getusersitepackages()]  # `pip install --user` packages too
        installed = {Path(p).resolve() for p in places if p}
        if not any(path.is_relative_to(d) for d in installed):  # your own code: not the standard library or a package
            return
    raise SourceError(f"{where} names factory {spec!r} ({module or 'built-in'}), which is not a model factory this "
                      "environment vouches for: a run directory cannot make dsedge call any function",
                      "check where the run directory came from: the factory should be the function that builds its "
                      f"model; if it is and you trust it, set {TRUST_ENV}=MODULE (a torch.nn.Module class, dsedge's "
                      "and its samples' factories, and functions of your own modules need nothing)")


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
    where = str(Path(run_dir) / "final" / "model.json")
    check_factory(meta["factory"], factory, where)
    if not isinstance(meta["kwargs"], dict):
        raise SourceError(f"{where}: 'kwargs' is {type(meta['kwargs']).__name__}, not an object",
                          "re-run training to rewrite it")
    model = factory(**meta["kwargs"])
    if not isinstance(model, torch.nn.Module):
        raise SourceError(f"{where}: factory {meta['factory']!r} returned {type(model).__name__}, not a "
                          "torch.nn.Module", "name the function that builds the model in [model] factory")
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
