"""``model_warmup`` of an exported Triton model: the requests Triton runs before it marks the model ready (a model
whose warm-up fails is not loaded)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.bundle import Manifest
from .pbtxt import Enum
from .policy import BatchingPolicy

TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
                 "int32": "TYPE_INT32", "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL"}
_TERM = re.compile(r"\s*([+-])?\s*([A-Za-z_][\w.]*|\d+)\s*")


def _symbol_value(manifest: Manifest, name: str) -> int:
    r = manifest.shape_ranges.get(name) or (manifest.target.get("shapes") or {}).get(name) or {}
    return int(r.get("opt", r.get("min", 1)))


def _resolve_dim(manifest: Manifest, d: Any) -> int | None:
    """A dim's warm-up size: a number as it is; a symbol at its opt size (else min, else 1); a sum or difference of
    symbols and numbers (``"past_sequence_length + sequence_length"``, as optimum names a decoder's mask) from the
    same symbol values, so that every input agrees. None: an expression this cannot read, or a size below 1."""
    if isinstance(d, int):
        return d if d >= 0 else None
    text, total, pos = str(d), 0, 0
    while pos < len(text):
        m = _TERM.match(text, pos)
        if not m or m.end() == pos or (pos and not m.group(1)) or (not pos and m.group(1) == "+"):
            return None
        value = int(m.group(2)) if m.group(2).isdigit() else _symbol_value(manifest, m.group(2))
        total += -value if m.group(1) == "-" else value
        pos = m.end()
    return total if pos and total >= 1 else None


def _warmup(manifest: Manifest, policy: BatchingPolicy, model_dir: Path, seed: int = 0,
            notes: list[str] | None = None) -> list[dict] | None:
    """Warm-up at batch 1 and at the largest preferred batch, at the optimization profile's opt sizes.

    Every symbolic dim takes one value for all inputs (its opt size, else min, else 1), and a dim written as an
    expression of symbols (a decoder's ``attention_mask`` is ``past_sequence_length + sequence_length`` wide) is
    computed from those same values: sized alone, the mask got 1 column where the model needs 2, the warm-up failed,
    and Triton does not load a model whose warm-up fails. A dim that cannot be sized: no warm-up (None), with a note.
    Float inputs use Triton's ``random_data``; integer inputs with a value range (token ids < vocabulary) get random
    values inside it, written to ``warmup/<input>`` (raw row-major bytes), since Triton's random integers would index
    outside an embedding table; an ``attention_mask`` is all ones (every position attends); other integer inputs
    without a range get ``zero_data``.
    """
    batched = policy.max_batch_size > 0
    rng = np.random.default_rng(seed)
    fields: dict[str, dict] = {}
    sized: dict[str, int] = {}
    files: dict[str, bytes] = {}
    for s in manifest.inputs:
        dims = []
        for i, d in enumerate(s.shape):
            if i == 0 and batched and not (isinstance(d, int) and d >= 0):
                continue
            value = _resolve_dim(manifest, d)
            if value is None:
                if notes is not None:
                    notes.append(f"no model_warmup: the dim {d!r} of input {s.name!r} cannot be sized from the "
                                 "bundle (warm up with perf_analyzer on the server)")
                return None
            if not isinstance(d, int):
                sized[str(d)] = value
            dims.append(value)
        entry: dict[str, Any] = {"data_type": Enum(TRITON_DTYPES[s.dtype]), "dims": dims}
        dt = np.dtype(s.dtype)
        if dt.kind in "iu" and s.name == "attention_mask":
            files[s.name] = np.ones(dims, dtype=dt.newbyteorder("<")).tobytes()
            entry["input_data_file"] = s.name
        elif s.value_range is not None and dt.kind in "iu":
            lo, hi = s.value_range
            data = rng.integers(lo, hi + 1, size=dims, dtype=np.int64).astype(dt.newbyteorder("<"))
            files[s.name] = data.tobytes()
            entry["input_data_file"] = s.name
        elif dt.kind in "biu":  # integers without a known range: zeros are always a valid index
            entry["zero_data"] = True
        else:
            entry["random_data"] = True
        fields[s.name] = entry
    for name, data in files.items():
        (model_dir / "warmup").mkdir(exist_ok=True)
        (model_dir / "warmup" / name).write_bytes(data)
    if notes is not None and any(not _TERM.fullmatch(k) for k in sized):
        notes.append("model_warmup dims: " + ", ".join(f"{k} = {v}" for k, v in sized.items()))
    inputs = [{"key": k, "value": v} for k, v in fields.items()]
    sizes = sorted({1, *(policy.preferred_batch_sizes[-1:] if batched else ())})
    return [{"name": f"random_batch_{b}", "batch_size": b, "inputs": inputs, "count": 1}
            for b in sizes]
