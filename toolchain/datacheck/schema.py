"""Format and schema: unreadable rows (with their lines), missing/empty values and value kinds per field.

A field's type is the kind most of its present values have (number, string, bool, list, object); a present value of
another kind is a type mismatch. CSV values are text: an NA token (:data:`CSV_NA_TOKENS`, the strings pandas'
``read_csv`` reads as NA by default: NaN, nan, NA, N/A, null, None, ...) is missing, a blank value empty, a value that
parses as a float (``inf`` included) a number, else a string.
Mergeable: counts add; the example lines kept are the first ``EXAMPLES`` by location, which merge exactly.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .sources import ABSENT, Batch, first_k

EXAMPLES = 5
VALUE_KINDS = ("number", "string", "bool", "list", "object")
# pandas.read_csv's default NA strings (pandas._libs.parsers.STR_NA_VALUES), less "" (blank is "empty" here);
# compared with the stripped value. "inf"/"-inf" are not among them: they stay numbers (tabular.ranges counts them).
CSV_NA_TOKENS = frozenset({
    "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA",
    "NULL", "NaN", "None", "n/a", "nan", "null"})


def json_kind(v: object) -> str:
    if v is ABSENT:
        return "absent"
    if v is None:
        return "missing"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number" if v == v else "missing"      # NaN counts as missing
    if isinstance(v, str):
        return "string" if v.strip() else "empty"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, dict):
        return "object"
    return "string"


def csv_kinds(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(kind per value as a str array, float value per value, NaN where not a number)."""
    import pandas as pd

    s = pd.Series(values, dtype=object)
    num = pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, copy=True)
    stripped = s.str.strip()
    na = stripped.isin(CSV_NA_TOKENS).to_numpy(dtype=bool)
    num[na] = np.nan
    kinds = np.where(stripped == "", "empty", np.where(na, "missing", np.where(np.isnan(num), "string", "number")))
    return kinds.astype(object), num


class SchemaState:
    """Per-field kind counts and example locations; rows and unreadable rows."""

    def __init__(self) -> None:
        self.rows = 0
        self.blank_lines = 0
        self.unreadable = 0
        self.unreadable_examples: list[tuple[int, str]] = []
        self.kinds: dict[str, Counter] = {}
        self.examples: dict[str, dict[str, list[int]]] = {}

    def update(self, batch: Batch, kinds: dict[str, np.ndarray]) -> None:
        """``kinds[field]`` is the kind of each row's value (see :func:`json_kind`, :func:`csv_kinds`); "absent"
        (key not in the row) is not stored: it is ``rows`` minus the kinds counted, which is exact under any split."""
        self.rows += batch.n
        self.blank_lines += batch.blank_lines
        self.unreadable += len(batch.unreadable)
        self.unreadable_examples = sorted(self.unreadable_examples + batch.unreadable)[:EXAMPLES]
        locs = np.asarray(batch.locs, dtype=np.int64)
        for name, k in kinds.items():
            c = self.kinds.setdefault(name, Counter())
            ex = self.examples.setdefault(name, {})
            u, n = np.unique(k, return_counts=True) if len(k) else ((), ())
            for kind, cnt in zip(u, n):
                if kind == "absent":
                    continue
                c[str(kind)] += int(cnt)
                ex[str(kind)] = first_k(ex.get(str(kind), []), locs[k == kind][:EXAMPLES].tolist(), EXAMPLES)

    def merge(self, other: "SchemaState") -> None:
        for name, c in other.kinds.items():
            self.kinds.setdefault(name, Counter()).update(c)
            ex = self.examples.setdefault(name, {})
            for kind, locs in other.examples[name].items():
                ex[kind] = first_k(ex.get(kind, []), locs, EXAMPLES)
        self.rows += other.rows
        self.blank_lines += other.blank_lines
        self.unreadable += other.unreadable
        self.unreadable_examples = sorted(self.unreadable_examples + other.unreadable_examples)[:EXAMPLES]

    def field_summary(self) -> dict[str, dict]:
        """Per field: rows missing, empty, the type, mismatches and example locations."""
        out = {}
        for name, c in self.kinds.items():
            present = {k: c.get(k, 0) for k in VALUE_KINDS if c.get(k, 0)}
            dominant = max(present, key=lambda k: (present[k], -VALUE_KINDS.index(k))) if present else None
            mismatch_kinds = [k for k in present if k != dominant]
            mismatches = sum(present[k] for k in mismatch_kinds)
            ex = self.examples.get(name, {})
            out[name] = {
                "type": dominant,
                "missing": int(c.get("missing", 0)) + self.rows - sum(c.values()),
                "empty": int(c.get("empty", 0)),
                "type_mismatches": int(mismatches),
                "mismatch_kinds": {k: present[k] for k in mismatch_kinds},
                "missing_examples": sorted(ex.get("missing", []) + ex.get("empty", []))[:EXAMPLES],
                "mismatch_examples": sorted(sum((ex.get(k, []) for k in mismatch_kinds), []))[:EXAMPLES],
            }
        return out
