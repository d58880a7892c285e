"""A writer for protobuf text format (``config.pbtxt``) from plain Python data, so the export needs no protobuf.

Messages are dicts, repeated fields lists, enum values :class:`Enum` strings (written bare), map fields lists of
``{"key": …, "value": …}`` entries. tritonclient's ``ModelConfig`` reads the result back (tests do, field by field).
"""
from __future__ import annotations

import json
from typing import Any


class Enum(str):
    """An enum value (``KIND_CPU``, ``TYPE_FP32``): written without quotes."""


def _scalar(v: Any) -> str:
    if isinstance(v, Enum):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # double-quoted, C-style escapes, UTF-8 kept as is
    raise TypeError(f"cannot write {type(v).__name__} in protobuf text format")


def _field(name: str, value: Any, indent: int, out: list[str]) -> None:
    pad = "  " * indent
    if isinstance(value, dict):
        out.append(f"{pad}{name} {{")
        for k, v in value.items():
            _field(k, v, indent + 1, out)
        out.append(f"{pad}}}")
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value):
            for v in value:
                _field(name, v, indent, out)
        elif value:
            out.append(f"{pad}{name}: [ {', '.join(_scalar(v) for v in value)} ]")
    elif value is not None:
        out.append(f"{pad}{name}: {_scalar(value)}")


def to_pbtxt(message: dict[str, Any], comments: list[str] | tuple[str, ...] = ()) -> str:
    """``message`` as protobuf text, after ``comments`` written as ``#`` lines. None values and empty lists are
    left out (proto3 defaults)."""
    out = [f"# {c}" for c in comments]
    for k, v in message.items():
        _field(k, v, 0, out)
    return "\n".join(out) + "\n"
