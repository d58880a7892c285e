"""Bench reports read back and compared: the baseline check of ``dsedge bench --compare``."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import BenchError, InputError
from .schema import validate

PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def normalize_percentile(p: str | int | float) -> str:
    """``"p99"``, ``"99"`` or ``99`` → ``"p99"``; one of p50/p90/p95/p99. Raises InputError."""
    key = str(p).strip().lower()
    key = key if key.startswith("p") else f"p{key}"
    key = key[:-2] if key.endswith(".0") else key
    if key not in PERCENTILES:
        raise InputError(f"unknown percentile {p!r}", f"choose one of {', '.join(PERCENTILES)}")
    return key


REPORT_SCHEMA = "dsedge.bench-report/1"
LEGACY_SCHEMAS = ("dsedge.bench",)  # the same format, version 1, under its former name
REPORT_SCHEMA_VERSION = 1


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read a report written by ``dsedge bench --json``. Raises BenchError for a missing, malformed or foreign file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"baseline report {str(p)!r} does not exist", "write one with `dsedge bench BUNDLE --json > base.json`") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BenchError(f"baseline report {str(p)!r} is not valid JSON ({e})", "pass a file written by `dsedge bench --json`") from None
    if not isinstance(data, dict) or data.get("schema") not in (REPORT_SCHEMA, *LEGACY_SCHEMAS):
        raise BenchError(f"{str(p)!r} is not a dsedge bench report", "pass a file written by `dsedge bench --json`")
    if data.get("schema_version") != REPORT_SCHEMA_VERSION:
        raise BenchError(f"bench report {str(p)!r} has schema version {data.get('schema_version')!r}; this dsedge "
                         f"reads {REPORT_SCHEMA_VERSION}", "measure the baseline again with this dsedge")
    if not isinstance(data.get("results"), list):
        raise BenchError(f"bench report {str(p)!r} has no results list", "pass a file written by `dsedge bench --json`")
    validate("bench-report", data, BenchError, f"bench report {p.name}")
    return data


@dataclass
class Comparison:
    """One batch size compared with the baseline: ``ratio`` = current / baseline at ``percentile``."""

    variant: str
    batch: int
    percentile: str
    baseline_ms: float | None
    current_ms: float
    tolerance: float
    unmatched: str = ""  # without a baseline: why ("no baseline with concurrency 1 (the baseline has concurrency 3)")

    @property
    def ratio(self) -> float | None:
        return self.current_ms / self.baseline_ms if self.baseline_ms else None

    @property
    def regressed(self) -> bool:
        return self.ratio is not None and self.ratio > 1.0 + self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "batch": self.batch, "percentile": self.percentile,
                "baseline_ms": self.baseline_ms, "current_ms": round(self.current_ms, 6),
                "ratio": None if self.ratio is None else round(self.ratio, 4), "tolerance": self.tolerance,
                "regressed": self.regressed, **({"unmatched": self.unmatched} if self.unmatched else {})}


# what pairs a result with its baseline: (field, what the messages call it); a missing concurrency is 1
KEY_FIELDS = (("variant", "variant"), ("batch", "batch size"), ("shapes", "input shapes"),
              ("concurrency", "concurrency"))


def _key_value(r: Mapping[str, Any], field: str) -> Any:
    v = r.get(field, 1 if field == "concurrency" else None)
    return json.dumps(v, sort_keys=True) if field == "shapes" else v


def _show(field: str, r: Mapping[str, Any]) -> str:
    if field == "shapes":
        return ", ".join(f"{k} {'x'.join(str(d) for d in v)}" for k, v in (r.get("shapes") or {}).items()) or "none"
    return str(r.get(field, 1 if field == "concurrency" else None))


def unmatched_reason(r: Mapping[str, Any], baseline_results: list[Mapping[str, Any]]) -> str:
    """Why ``r`` has no baseline: the key fields in which even the nearest baseline result differs, with the values
    the baseline has, e.g. ``"no baseline with concurrency 1 (the baseline has concurrency 3)"``."""
    if not baseline_results:
        return "the baseline has no results"

    def differs(b: Mapping[str, Any]) -> list[str]:
        return [f for f, _ in KEY_FIELDS if _key_value(b, f) != _key_value(r, f)]

    def per_sample(x: Mapping[str, Any]) -> str:  # the shapes without the batch axis
        return json.dumps({k: list(v)[1:] for k, v in (x.get("shapes") or {}).items()}, sort_keys=True)

    fields = min((differs(b) for b in baseline_results), key=len)
    if "batch" in fields and "shapes" in fields and \
            any(differs(b) == fields and per_sample(b) == per_sample(r) for b in baseline_results):
        fields.remove("shapes")  # the shapes differ by the batch size alone
    label = dict(KEY_FIELDS)
    theirs = []
    for f in fields:
        values = list(dict.fromkeys(_show(f, b) for b in baseline_results if _key_value(b, f) != _key_value(r, f)))
        theirs.append(f"{label[f]} {' or '.join(values)}")
    return (f"no baseline with {' and '.join(f'{label[f]} {_show(f, r)}' for f in fields)} "
            f"(the baseline has {' and '.join(theirs)})")


def compare_reports(current: Mapping[str, Any], baseline: Mapping[str, Any], tolerance: float = 0.10,
                    percentile: str = "p99") -> list[Comparison]:
    """Pair results by (variant, batch, input shapes, concurrency) and flag those slower than
    ``baseline × (1 + tolerance)``.

    A result without a baseline counterpart gets ``baseline_ms=None`` and ``unmatched`` saying why (the key fields
    that differ), and is never a regression.
    Raises:
        InputError: a negative tolerance or unknown percentile; a baseline figure that is not a positive latency.
    """
    if tolerance < 0:
        raise InputError(f"tolerance {tolerance} is negative", "pass --tolerance 0.10 for 10 %")

    percentile = normalize_percentile(percentile)

    def key(r: Mapping[str, Any]) -> tuple:
        return tuple(_key_value(r, f) for f, _ in KEY_FIELDS)

    results = list(baseline.get("results", []))
    base = {key(r): r for r in results}
    out = []
    for r in current.get("results", []):
        b = base.get(key(r))
        base_ms = float(b["latency_ms"][percentile]) if b and percentile in b.get("latency_ms", {}) else None
        if base_ms is not None and not (math.isfinite(base_ms) and base_ms > 0):
            raise InputError(f"the baseline's {percentile} of {r['variant']} at batch {r['batch']} is {base_ms:g} ms, "
                             "not a latency (any slowdown against it would pass)",
                             "measure the baseline again: dsedge bench BUNDLE -o baseline.json")
        why = "" if base_ms is not None else f"the baseline has no {percentile}" if b else unmatched_reason(r, results)
        out.append(Comparison(str(r["variant"]), int(r["batch"]), percentile, base_ms,
                              float(r["latency_ms"][percentile]), tolerance, why))
    return out
