"""Resolve ``--model`` into a ``Source``: the reference model, a Hugging Face directory, an ONNX file, a training run
directory, or a Python ``module:function`` returning ``(torch.nn.Module, example_inputs[, dynamic_axes])``."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.files import sha256_file
from ..runtime.errors import SourceError
from ..runtime.token_bounds import graph_token_bounds
from . import reference
from .weights_policy import hf_source_files

TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class Source:
    """A model ready to export (``module``) or already ONNX (``onnx_path``).

    Attributes:
        kind: ``reference`` | ``hf`` | ``onnx`` | ``callable`` | ``run``.
        example_inputs: name → numpy array used for export and the parity check.
        dynamic_axes: name → {axis: symbol}, e.g. ``{"input_ids": {0: "batch", 1: "sequence"}}``.
        calibration / validation: name → numpy array batches of real inputs (validation never overlaps calibration).
        validation_kind: ``"held-out real inputs"``, ``"calib dir"`` or ``"example inputs"`` (said in the report).
        calibration_kind: where ``calibration`` came from (said in the report), e.g. ``"--calib DIR (64 samples)"``.
        task: ``"sentence-embedding"`` (metrics on mean-pooled embeddings) or ``"generic"``.
        fingerprint: sha256 over the source's files (weights / ONNX / callable spec).
    """

    kind: str
    name: str
    example_inputs: dict[str, np.ndarray]
    dynamic_axes: dict[str, dict[int, str]]
    output_names: list[str] | None = None
    module: Any = None
    onnx_path: Path | None = None
    calibration: dict[str, np.ndarray] | None = None
    validation: dict[str, np.ndarray] | None = None
    validation_kind: str = "example inputs"
    calibration_kind: str = ""
    task: str = "generic"
    fingerprint: str = ""
    ref: str = ""
    vocab_size: int | None = None
    value_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _fingerprint(paths: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def _text_source(kind: str, name: str, model_path: Path, fingerprint: str, ref: str = "") -> Source:
    tok = reference.load_tokenizer(model_path)
    ranges = _text_value_ranges(model_path, int(tok.vocab_size))
    if len(tok) > ranges["input_ids"][1] + 1:
        raise SourceError(f"{model_path}: the tokenizer has {len(tok)} tokens but the model's vocab_size is "
                          f"{ranges['input_ids'][1] + 1}, so its ids would index past the embedding table",
                          "save the tokenizer the model was trained with beside its weights")
    calib = reference.tokenize(tok, reference.sentences("calibration"))
    val = reference.tokenize(tok, reference.sentences("heldout"))
    example = {k: v[:2] for k, v in calib.items()}
    dyn = {k: {0: "batch", 1: "sequence"} for k in TEXT_INPUTS}
    return Source(kind=kind, name=name, example_inputs=example, dynamic_axes=dyn,
                  output_names=["last_hidden_state", "sentence_embedding"],
                  module=reference.sentence_encoder(model_path), calibration=calib, validation=val,
                  validation_kind="held-out real inputs (60 sentences)", task="sentence-embedding",
                  fingerprint=fingerprint, ref=ref or str(model_path), vocab_size=int(tok.vocab_size),
                  value_ranges=ranges)


def _text_value_ranges(model_path: Path, vocab_size: int) -> dict[str, tuple[int, int]]:
    """Valid integer ranges of the text inputs, from the tokenizer and config.json (ids outside them index past
    the embedding tables: ORT's INT4 Gather would return garbage instead of failing)."""
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    vocab = int(cfg.get("vocab_size", vocab_size))
    return {"input_ids": (0, vocab - 1), "attention_mask": (0, 1),
            "token_type_ids": (0, int(cfg.get("type_vocab_size", 2)) - 1)}


def _reference() -> Source:
    d = reference.verified_model_dir()
    return _text_source("reference", reference.NAME, d, reference.UPSTREAM_SHA256, ref=reference.UPSTREAM)


def _hf_dir(path: Path) -> Source:
    weights = hf_source_files(path)
    name = path.resolve().name.lower().replace("_", "-")
    return _text_source("hf", name, path, _fingerprint(weights))


def load_onnx_source(path: str | os.PathLike, external_data: bool = True) -> Any:
    """The ``onnx.ModelProto`` at ``path``, checked as a source: readable, valid by ``onnx.checker`` and with at
    least one node (an empty file parses as an empty ModelProto). ``external_data``: load the weights kept beside
    the model too.

    Raises:
        SourceError: any of those fails (one line, the checker's first).
    """
    import onnx

    try:
        model = onnx.load(os.fspath(path), load_external_data=external_data)
        # by path: external data (model.onnx + weights file) is resolved beside the model, not in the working dir
        onnx.checker.check_model(os.fspath(path))
        if not model.graph.node:
            raise ValueError("the graph has no nodes")
    except Exception as e:  # onnx raises DecodeError, ValidationError, …
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise SourceError(f"{path} is not a valid ONNX model ({type(e).__name__}: {first})",
                          "pass a .onnx file written by torch.onnx.export or another ONNX exporter") from None
    return model


def _onnx_file(path: Path) -> Source:
    model = load_onnx_source(path, external_data=False)
    from .export import io_specs

    from ..runtime.bench import synthetic_inputs

    inputs, outputs = io_specs(model)
    static = {int(s.shape[0]) for s in inputs if s.shape and not isinstance(s.shape[0], str)}
    example = synthetic_inputs(inputs, batch=static.pop() if len(static) == 1 else 2, seq_len=16)  # a static batch axis: its size
    dyn = {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in inputs}
    name = path.stem.lower().replace("_", "-")
    return Source(kind="onnx", name=name, example_inputs=example, dynamic_axes=dyn, onnx_path=path,
                  task=onnx_task(outputs),
                  fingerprint=_fingerprint([path]), ref=str(path), **graph_token_bounds(model))


def onnx_task(outputs: list[Any]) -> str:
    """``"sentence-embedding"`` for an ONNX file with a rank-2 output ``sentence_embedding`` [N, D] (a
    sentence-transformers export: ``token_embeddings`` [N, T, D] beside it), judged like the reference encoder
    (cosine and nearest-neighbour top-1 of the sentence embeddings); else ``"generic"``. ``outputs``: IOSpecs."""
    return "sentence-embedding" if any(o.name == "sentence_embedding" and len(o.shape) == 2 for o in outputs) \
        else "generic"


def _to_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _callable(spec: str) -> Source:
    module_name, _, fn_name = spec.partition(":")
    hint = "use module.path:function, importable from this directory"
    if not module_name or module_name.startswith(".") or not fn_name:
        raise SourceError(f"--model {spec!r} is not module.path:function", hint)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--model mypkg.models:make` resolves from the working directory
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SourceError(f"cannot import {spec!r}: {e}", hint) from None
    except Exception as e:  # the user's module fails while it is imported: one line, not its traceback
        raise SourceError(f"importing {module_name!r} failed: {type(e).__name__}: {_first_line(e)}",
                          "fix the module so that it imports") from None
    if not callable(fn):
        raise SourceError(f"{spec} is a {type(fn).__name__}, not a function", hint)
    try:
        result = fn()
    except Exception as e:
        raise SourceError(f"{spec}() failed: {type(e).__name__}: {_first_line(e)}",
                          "run it in Python to see the full traceback") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise SourceError(f"{spec} must return (torch.nn.Module, example_inputs[, dynamic_axes])",
                          "return the model and a tuple or dict of example tensors")
    module, example = result[0], result[1]
    if isinstance(example, dict):
        example_np = {str(k): _to_numpy(v) for k, v in example.items()}
    else:
        example = example if isinstance(example, (tuple, list)) else (example,)
        example_np = {f"input_{i}": _to_numpy(v) for i, v in enumerate(example)}
    from ..runtime.io import check_finite

    check_finite(example_np, SourceError, where=f"{spec}: example inputs")  # NaN parity failed only at report.json
    for k, v in example_np.items():  # a scalar or an empty batch failed in the parity check with a traceback
        if v.ndim == 0 or len(v) == 0:
            raise SourceError(f"{spec}: example input {k!r} has shape {list(v.shape)}, without a batch axis 0 of at "
                              "least one row", "return example inputs shaped [batch, …] with batch >= 1, e.g. "
                              "x.unsqueeze(0) for a single sample; pass a scalar setting as a module attribute")
    dyn = result[2] if len(result) == 3 else {k: {0: "batch"} for k in example_np}
    _check_dynamic_axes(spec, dyn, example_np)
    import torch

    if not isinstance(module, torch.nn.Module):
        raise SourceError(f"{spec} returned a {type(module).__name__} where a torch.nn.Module goes",
                          "return (model, example_inputs) with model a torch.nn.Module")
    module.eval()
    with torch.no_grad():  # name the outputs: "output", or output_0, output_1 … for a tuple
        try:
            out = module(*[torch.from_numpy(v) for v in example_np.values()])
        except Exception as e:  # the user's forward: say which call failed, in one line
            shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in example_np.items())
            raise SourceError(f"{spec}: the model fails on its own example inputs ({shapes}): "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                              "return example inputs the model's forward() accepts, in its argument order") from None
    flat = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) for o in flat):  # a dict, a nested tuple: a traceback at the parity check
        what = (f"a {type(out).__name__} of " + ", ".join(type(o).__name__ for o in flat)
                if isinstance(out, (tuple, list)) else f"a {type(out).__name__}")
        raise SourceError(f"{spec}: the model's forward() returns {what:.80}, not a tensor or a flat tuple of tensors",
                          "wrap it so that forward() returns a tensor or a tuple of tensors, e.g. "
                          "tuple(out.values()) for a dict")
    n_out = len(flat)
    names = ["output"] if n_out == 1 else [f"output_{i}" for i in range(n_out)]
    name = f"{module_name.rsplit('.', 1)[-1]}-{fn_name}".lower().replace("_", "-")
    return Source(kind="callable", name=name, example_inputs=example_np, dynamic_axes=dyn, output_names=names,
                  module=module, fingerprint=hashlib.sha256(spec.encode()).hexdigest(), ref=spec)


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0][:200] if text else ""


def _check_dynamic_axes(spec: str, dyn: Any, example: dict[str, np.ndarray]) -> None:
    """``dynamic_axes`` as a callable source returns it: ``{input name: {axis: symbol}}`` over its own inputs."""
    hint = 'return e.g. {"input_0": {0: "batch"}}: input names (input_0, … for a tuple) → {axis: symbol}'
    if not isinstance(dyn, dict):
        raise SourceError(f"{spec} returned dynamic_axes as a {type(dyn).__name__}, not a dict", hint)
    for name, axes in dyn.items():
        if name not in example:
            raise SourceError(f"{spec}: dynamic_axes names {name!r}, not one of its inputs "
                              f"({', '.join(example)})", hint)
        if not isinstance(axes, dict) or not all(
                isinstance(a, int) and not isinstance(a, bool) and 0 <= a < example[name].ndim
                and isinstance(sym, str) and sym for a, sym in axes.items()):
            raise SourceError(f"{spec}: dynamic_axes[{name!r}] must map axes of its {example[name].ndim}-d "
                              f"input to names, got {axes!r:.80}", hint)


def _run_dir(path: Path) -> Source:
    try:
        from .train.export_source import load_trained
    except ImportError:
        raise SourceError(f"{path} looks like a training run, but this dsedge cannot read runs yet",
                          "export the model yourself and pass an ONNX file") from None
    module, example = load_trained(path)
    example_np = {k: _to_numpy(v) for k, v in example.items()}
    meta = json.loads((path / "final" / "model.json").read_text())
    files = [p for p in (path / "final").iterdir() if p.is_file()]
    return Source(kind="run", name=path.resolve().name.lower().replace("_", "-"), example_inputs=example_np,
                  dynamic_axes={k: {0: "batch"} for k in example_np}, output_names=meta.get("output_names"),
                  module=module, fingerprint=_fingerprint(files), ref=str(path))


def unfinished_run(path: Path) -> str | None:
    """Why ``path`` is a training run that has not finished (``dsedge train``/``distill`` stopped before writing
    ``final/``: a ``config.toml`` beside ``checkpoints/`` or ``metrics.jsonl``), e.g. ``"no final/model.json; its
    latest checkpoint is step_80"``; None for a finished run or a directory that is no run."""
    if (path / "final" / "model.json").is_file() or not (path / "config.toml").is_file():
        return None
    if not ((path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()):
        return None
    steps = sorted((p.name for p in (path / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file()),
                   key=lambda n: int(n.split("_")[1]) if n.split("_")[1].isdigit() else -1)
    return "no final/model.json" + (f"; its latest checkpoint is {steps[-1]}" if steps else
                                    "; it has no complete checkpoint")


def resolve_source(model: str | None) -> Source:
    """Turn ``--model`` into a Source. ``None`` means the reference model.

    Raises:
        SourceError: missing path, a file that is not ONNX, an unimportable callable, a directory of unknown kind.
    """
    if model is None or model == reference.NAME:
        return _reference()
    if not model.strip():  # Path("") is the working directory: "  is a directory but not a Hugging Face model"
        raise SourceError("--model is empty", "pass an ONNX file, a HF model directory, a training run directory or "
                          "module:function, or leave --model out for the reference model")
    path = Path(model)
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".onnx":
                raise SourceError(f"{model} is not an ONNX file", "pass a .onnx file, a HF model directory, a "
                                  "training run directory or module:function")
            return _onnx_file(path)
        if (path / "final" / "model.json").is_file():
            return _run_dir(path)
        if (path / "config.json").is_file():
            return _hf_dir(path)
        why = unfinished_run(path)
        if why is not None:
            raise SourceError(f"{model} is a training run that has not finished ({why})",
                              "finish it first: rerun the `dsedge train` / `dsedge distill` command that started it "
                              "(it resumes from the latest checkpoint), then build")
        raise SourceError(f"{model} is a directory but not a Hugging Face model or a dsedge training run",
                          "a HF directory has config.json + model.safetensors; a run has final/model.json")
    if ":" in model and not model.endswith(".onnx") and "/" not in model.split(":")[0]:
        return _callable(model)
    raise SourceError(f"model path {model!r} does not exist",
                      "pass an existing .onnx file, a HF model directory, a run directory or module:function")
