"""The JSON Schemas of dsedge's files, and the checks every reader and writer runs against them.

Four documents have a schema (``runtime/schemas/*.schema.json``, package data; copies in ``docs/schemas/``):

========================  =====================================  ==============================
kind                      ``schema`` field / title               file
========================  =====================================  ==============================
``manifest``              ``dsedge.manifest/1``                  ``NAME-TARGET.dse/manifest.json``
``build-report``          ``dsedge.build-report/1``              ``NAME-TARGET.dse/report.json``
``bench-report``          ``dsedge.bench-report/1``              ``dsedge bench --json``
``target-profile``        ``dsedge.target-profile/1``            ``targets/profiles/*.toml``
========================  =====================================  ==============================

A document is checked in three steps, the same at write and at read: every number is finite (JSON has no NaN or
Infinity; Python's ``json`` would write them), it validates against its schema (Draft 2020-12, through
``jsonschema``), and it passes the consistency rules of ``check_consistency`` (what a schema cannot say: min ≤ opt
≤ max, the default variant exists, listed files are present inside the bundle, …). The first problem raises the
caller's ``DsedgeError`` subclass with one line naming the field, e.g. ``manifest.json field
shape_ranges.batch.max: 1000000000000 is greater than the maximum of 65536``.
"""
from __future__ import annotations

import functools
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterator

from .errors import DsedgeError

SCHEMA_DIR = Path(__file__).parent / "schemas"
KINDS = ("manifest", "build-report", "bench-report", "target-profile")
SCHEMA_IDS = {kind: f"dsedge.{kind}/1" for kind in KINDS}
MAX_ELEMENTS = 2**31 - 1  # largest tensor an optimization profile may ask for (TensorRT's int32 volume)

_HINTS = {
    "manifest": "rebuild the bundle with `dsedge build` (a manifest edited by hand must still match its schema)",
    "build-report": "rebuild the bundle with `dsedge build`",
    "bench-report": "pass a file written by `dsedge bench --json`",
    "target-profile": "compare with a built-in profile (`dsedge targets jetson`) and the schema in docs/schemas/",
}


@functools.lru_cache(maxsize=None)
def load_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of ``kind`` (one of ``KINDS``) as a dict. Raises KeyError for an unknown kind."""
    if kind not in KINDS:
        raise KeyError(kind)
    return json.loads((SCHEMA_DIR / f"{kind}.schema.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def _validator(kind: str) -> Any:
    import jsonschema

    schema = load_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def field_path(parts: Any) -> str:
    """``["variants", 0, "file"]`` → ``variants[0].file`` (``(root)`` when empty)."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def non_finite(data: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every (path, value) in ``data`` that is a NaN or infinite float, in document order (iterative: any depth)."""
    stack = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
            if not math.isfinite(float(value)):
                yield where, value
        elif isinstance(value, dict):
            stack.extend(reversed([((*where, k), v) for k, v in value.items()]))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed([((*where, i), v) for i, v in enumerate(value)]))


def problems(kind: str, data: Any, root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """Every problem of ``data`` as a ``kind`` document: ``[(field path, message), …]``, best first; [] when sound.

    ``root`` (a bundle directory, for ``manifest``) also checks that listed files exist inside it.
    """
    out = [(field_path(p), f"is {v!r}; numbers must be finite") for p, v in non_finite(data)]
    if out:
        return out
    import jsonschema

    errors = list(_validator(kind).iter_errors(data))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        return [(field_path(best.absolute_path), _message(best))] + [
            (field_path(e.absolute_path), _message(e)) for e in errors if e is not best]
    return check_consistency(kind, data, root)


def _message(err: Any) -> str:
    """A schema error in one short line: a pattern failure says what the pattern means (its ``description``)."""
    if err.validator == "pattern" and isinstance(err.schema, dict) and err.schema.get("description"):
        return _short(f"{err.instance!r} {err.schema['description']}")
    if err.validator in ("oneOf", "anyOf"):
        return _short(f"{err.instance!r} is not of an allowed type or range")
    return _short(err.message)


def _short(message: str, limit: int = 160) -> str:
    message = message.replace("\n", " ")
    return message if len(message) <= limit else message[:limit - 1] + "…"


def validate(kind: str, data: Any, error: type[DsedgeError] = DsedgeError, what: str | None = None,
             root: str | os.PathLike | None = None, hint: str | None = None) -> None:
    """Raise ``error`` (one line naming the field) unless ``data`` is a sound ``kind`` document.

    Args:
        what: how the message names the document (default: the kind, e.g. ``manifest``).
        root: see ``problems``.
    """
    found = problems(kind, data, root)
    if found:
        path, message = found[0]
        raise error(f"{what or kind} field {path}: {message}", hint or _HINTS[kind])


def check_consistency(kind: str, data: dict[str, Any], root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """The rules of a schema-valid ``kind`` document that JSON Schema cannot express: ``[(field, message), …]``.

    manifest: names unique (inputs, outputs, variants), the default variant exists, every variant's file has a hash,
    shape ranges min ≤ opt ≤ max, value ranges lo ≤ hi, an input's largest tensor within ``MAX_ELEMENTS``, the
    target's opset and shapes ordered; with ``root``, every listed file is a regular file inside ``root`` (after
    resolving links). target-profile: precision_order ⊆ precisions, opset min ≤ max, shapes min ≤ opt ≤ max, a
    tensorrt target has compute_capability and tensorrt.version. build-report: the variants include ``precision``.
    """
    out: list[tuple[str, str]] = []

    def ordered(prefix: str, rng: dict[str, Any]) -> None:
        keys = [k for k in ("min", "opt", "max") if k in rng]
        vals = [rng[k] for k in keys]
        if vals != sorted(vals):
            out.append((prefix, f"needs min <= opt <= max, got {'/'.join(map(str, vals))}"))

    def unique(field: str, items: list[dict[str, Any]]) -> None:
        seen: set[str] = set()
        for i, item in enumerate(items):
            if item["name"] in seen:
                out.append((f"{field}[{i}].name", f"{item['name']!r} appears twice"))
            seen.add(item["name"])

    if kind == "manifest":
        for field in ("inputs", "outputs", "variants"):
            unique(field, data[field])
        names = [v["name"] for v in data["variants"]]
        if data["default_variant"] not in names:
            out.append(("default_variant", f"{data['default_variant']!r} is not one of the variants {names}"))
        for i, v in enumerate(data["variants"]):
            if v["file"] not in data["files"]:
                out.append((f"variants[{i}].file", f"{v['file']!r} has no hash in files"))
        ranges = data.get("shape_ranges", {})
        for sym, rng in ranges.items():
            ordered(f"shape_ranges.{sym}", rng)
        for i, spec in enumerate(data["inputs"]):
            vr = spec.get("value_range")
            if vr is not None and vr[0] > vr[1]:
                out.append((f"inputs[{i}].value_range", f"lower bound {vr[0]} is above upper bound {vr[1]}"))
            volume = 1
            for d in spec["shape"]:
                volume *= ranges[d]["max"] if isinstance(d, str) and d in ranges else max(int(d), 1) if isinstance(d, int) else 1
            if volume > MAX_ELEMENTS:
                out.append((f"inputs[{i}].shape", f"allows {volume} elements at its ranges' max (limit {MAX_ELEMENTS})"))
        target = data["target"]
        if "opset" in target and target["opset"]["min"] > target["opset"]["max"]:
            out.append(("target.opset", f"min {target['opset']['min']} is above max {target['opset']['max']}"))
        for sym, rng in target.get("shapes", {}).items():
            ordered(f"target.shapes.{sym}", rng)
        if root is not None:
            out += _files_inside(Path(root), data["files"])
    elif kind == "target-profile":
        precisions = data.get("precisions", ["fp32"])
        extra = [p for p in data.get("precision_order", []) if p not in precisions]
        if extra:
            out.append(("precision_order", f"lists {extra[0]!r}, which is not in precisions {precisions}"))
        if "opset" in data and data["opset"]["min"] > data["opset"]["max"]:
            out.append(("opset", f"min {data['opset']['min']} is above max {data['opset']['max']}"))
        for sym, rng in data.get("shapes", {}).items():
            ordered(f"shapes.{sym}", rng)
            if not rng["min"] >= 1:
                out.append((f"shapes.{sym}.min", "must be >= 1"))
        if data.get("backend") == "tensorrt":
            if not data.get("compute_capability"):
                out.append(("compute_capability", "is required for a tensorrt target"))
            if not data.get("tensorrt", {}).get("version"):
                out.append(("tensorrt.version", "is required for a tensorrt target (e.g. \"10.3\")"))
    elif kind == "build-report":
        precisions = [v["precision"] for v in data["variants"]]
        if data["precision"] not in precisions:
            out.append(("precision", f"{data['precision']!r} is not among the variants' {precisions}"))
    return out


def _files_inside(root: Path, files: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    base = root.resolve()
    for rel in files:
        p = (root / rel).resolve()
        if base not in p.parents:
            out.append((f"files.{rel}", "resolves outside the bundle"))
        elif not p.is_file():
            out.append((f"files.{rel}", "is missing from the bundle"))
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:  # RFC 8259 leaves a repeated name to the reader: two readers could see two documents
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def loads(text: str, error: type[DsedgeError] = DsedgeError, what: str = "document",
          hint: str = "rewrite the file as standard JSON") -> Any:
    """Parse standard JSON: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json`` accepts) are refused,
    and so is a key repeated within one object (Python's ``json`` keeps the last; another reader may keep the
    first, so a signed manifest could read one way here and another elsewhere).

    Raises:
        error: not JSON, a non-standard constant, or a repeated key.
    """
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise error(f"{what} is not valid JSON ({getattr(e, 'msg', e)})", hint) from None
    except RecursionError:
        raise error(f"{what} nests deeper than this reader allows", hint) from None


def dumps(kind: str, data: Any, error: type[DsedgeError] = DsedgeError, what: str | None = None,
          root: str | os.PathLike | None = None) -> str:
    """``data`` as the indented JSON text of a ``kind`` document, after checking it (see ``validate``).

    What is checked is what would be read back: the text's own parse (``default=str`` writes non-JSON values, e.g.
    paths, as strings). Raises ``error`` naming the first bad field; nothing is written by this function.
    """
    bad = next(non_finite(data), None)
    if bad is not None:
        raise error(f"{what or kind} field {field_path(bad[0])}: is {bad[1]!r}; numbers must be finite",
                    "this is a dsedge bug if it comes from a build: report it with the build log")
    text = json.dumps(data, indent=2, default=str, allow_nan=False) + "\n"
    validate(kind, json.loads(text), error, what, root=root,
             hint="this is a dsedge bug if it comes from a build: report it with the build log")
    return text
