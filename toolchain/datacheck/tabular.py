"""Tabular checks: class balance, constant columns, value ranges and leakage-suspect columns.

Leakage: for each numeric feature, the ROC AUC of the feature alone as a score for each label class (one vs rest;
``max(AUC, 1 − AUC)``, so a feature that predicts by being low counts too). AUC is the Mann-Whitney statistic with
ties counted one half, computed from per-class counts of the feature's distinct values. Each column keeps at most
``AUC_KEYS`` distinct values per class: beyond that, values are coarsened onto an order-preserving grid (the float's
sortable bit pattern shifted right by 32, 40, 44, 48 or 52 bits), which the merge applies to every part, so the result
stays identical under any split into shards (the AUC then counts values that share a grid cell as ties).

Mean and standard deviation use exact sums (``exact.ExactSum``); min/max, counts and out-of-range counts merge
exactly by construction.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .exact import ExactSum

MAX_CLASSES = 20          # a label with more distinct values is not a class label (no balance/AUC)
MAX_LABEL_VALUES = 1000
AUC_KEYS = 1 << 16
_SHIFTS = (0, 32, 40, 44, 48, 52)


def sortable_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys in the same order as the float64 values (finite values only)."""
    bits = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    neg = (bits >> np.uint64(63)).astype(bool)
    return np.where(neg, ~bits, bits | np.uint64(1 << 63))


def label_value(v: object) -> str | None:
    """A label as text: numbers by value (``1``, ``1.0`` and ``"1"`` are one class), missing as None."""
    if v is None or isinstance(v, bool):
        return None if v is None else str(v).lower()
    if isinstance(v, (int, float)):
        f = float(v)
        if f != f:
            return None
        return str(int(f)) if f.is_integer() else repr(f)
    s = str(v).strip()
    if not s:
        return None
    try:
        f = float(s)
    except ValueError:
        return s
    return label_value(f) if f == f else None


class _ValueCounts:
    """Per-class counts of a feature's (coarsened) values."""

    __slots__ = ("level", "keys", "counts")

    def __init__(self) -> None:
        self.level = 0
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)

    def _add(self, keys: np.ndarray, counts: np.ndarray) -> None:
        k = np.concatenate([self.keys, keys])
        c = np.concatenate([self.counts, counts])
        self.keys, inv = np.unique(k, return_inverse=True)
        self.counts = np.bincount(inv.ravel(), weights=c, minlength=self.keys.size).astype(np.int64)
        while self.keys.size > AUC_KEYS and self.level + 1 < len(_SHIFTS):
            self._coarsen(self.level + 1)

    def _coarsen(self, level: int) -> None:
        shift = np.uint64(_SHIFTS[level] - _SHIFTS[self.level])
        self.level = level
        k = self.keys >> shift
        self.keys, inv = np.unique(k, return_inverse=True)
        self.counts = np.bincount(inv.ravel(), weights=self.counts, minlength=self.keys.size).astype(np.int64)

    def add_values(self, x: np.ndarray) -> None:
        k, c = np.unique(sortable_keys(x) >> np.uint64(_SHIFTS[self.level]), return_counts=True)
        self._add(k, c.astype(np.int64))

    def merge(self, other: "_ValueCounts") -> None:
        level = max(self.level, other.level)
        if self.level < level:
            self._coarsen(level)
        if other.level < level:
            other._coarsen(level)
        self._add(other.keys, other.counts)


class ColumnStats:
    """Numeric statistics of one column plus up to two distinct raw values (for the constant-column check)."""

    def __init__(self) -> None:
        self.min = np.inf
        self.max = -np.inf
        self.sum = ExactSum()
        self.nonfinite = 0
        self.out_of_range = 0
        self.distinct: set[str] = set()
        self.auc: dict[str, _ValueCounts] = {}

    def merge(self, o: "ColumnStats") -> None:
        self.min, self.max = min(self.min, o.min), max(self.max, o.max)
        self.sum.merge(o.sum)
        self.nonfinite += o.nonfinite
        self.out_of_range += o.out_of_range
        self.distinct = set(sorted(self.distinct | o.distinct)[:2])
        for c, vc in o.auc.items():
            self.auc.setdefault(c, _ValueCounts()).merge(vc)


class TabularState:
    """Label counts and per-column statistics; ``ranges`` maps a column to its allowed [low, high]."""

    def __init__(self, label: str | None, ranges: dict[str, tuple[float, float]] | None = None) -> None:
        self.label = label
        self.ranges = ranges or {}
        self.classes: Counter = Counter()
        self.label_overflow = False
        self.columns: dict[str, ColumnStats] = {}

    def update(self, columns: dict[str, list], numeric: dict[str, np.ndarray], kinds: dict[str, np.ndarray]) -> None:
        """``numeric[col]``: float64 per row, NaN where the value is not a number; ``kinds`` as in schema."""
        labels = None
        if self.label is not None and self.label in columns:
            labels = np.array([label_value(v) for v in columns[self.label]], dtype=object)
            if self.label in kinds:  # a CSV NA token ("NA", "null", "N/A", ...) is a missing label, not a class
                labels[np.isin(kinds[self.label], ("missing", "empty", "absent"))] = None
            if not self.label_overflow:
                self.classes.update(v for v in labels if v is not None)
                if len(self.classes) > MAX_LABEL_VALUES:
                    self.label_overflow, self.classes = True, Counter()
        use_auc = labels is not None and not self.label_overflow and len(self.classes) <= MAX_CLASSES
        for name, x in numeric.items():
            if name == self.label:
                continue
            st = self.columns.setdefault(name, ColumnStats())
            k = kinds[name]
            present = (k != "missing") & (k != "empty") & (k != "absent")
            if len(st.distinct) < 2:
                raw = columns[name]
                vals = {x_ if isinstance(x_, str) else repr(x_) for x_, p in zip(raw, present) if p}
                st.distinct = set(sorted(st.distinct | {v.strip() for v in vals})[:2])
            fin = np.isfinite(x)
            st.nonfinite += int((np.isinf(x)).sum())
            xf = x[fin]
            if xf.size:
                st.min, st.max = min(st.min, float(xf.min())), max(st.max, float(xf.max()))
                st.sum.add(xf)
                if name in self.ranges:
                    lo, hi = self.ranges[name]
                    st.out_of_range += int(((xf < lo) | (xf > hi)).sum())
            if use_auc:
                lab = labels[fin]
                for c in set(lab) - {None}:
                    st.auc.setdefault(c, _ValueCounts()).add_values(xf[lab == c])
        if labels is not None and (self.label_overflow or len(self.classes) > MAX_CLASSES):
            for st in self.columns.values():
                st.auc.clear()

    def merge(self, other: "TabularState") -> None:
        if other.label_overflow or self.label_overflow:
            self.label_overflow, self.classes = True, Counter()
        else:
            self.classes.update(other.classes)
            if len(self.classes) > MAX_LABEL_VALUES:
                self.label_overflow, self.classes = True, Counter()
        for name, st in other.columns.items():
            self.columns.setdefault(name, ColumnStats()).merge(st)
        if self.label_overflow or len(self.classes) > MAX_CLASSES:
            for st in self.columns.values():
                st.auc.clear()

    def result(self, numeric_columns: list[str], other_columns: list[str]) -> dict:
        """``numeric_columns``: columns whose type (schema) is number; ``other_columns``: scalar non-numeric ones."""
        out: dict = {"label": self.label}
        categorical = self.label is not None and not self.label_overflow and 0 < len(self.classes) <= MAX_CLASSES
        if self.label is not None:
            out["classes"] = dict(sorted(self.classes.items(), key=lambda kv: (-kv[1], kv[0]))) if categorical else None
            if not categorical:
                out["label_note"] = (f"label {self.label!r} has more than {MAX_CLASSES} distinct values"
                                     if self.classes or self.label_overflow else f"label {self.label!r} has no value")
        constant, cols = [], {}
        for name in numeric_columns + other_columns:
            st = self.columns.get(name)
            if st is None:
                continue
            if len(st.distinct) == 1 and (name in other_columns or st.min == st.max):
                constant.append(name)
            if name in numeric_columns and st.sum.count:
                cols[name] = {"min": st.min, "max": st.max, "mean": st.sum.mean(), "std": st.sum.std(),
                              "finite": st.sum.count, "nonfinite": st.nonfinite}
                if name in self.ranges:
                    cols[name].update(range=list(self.ranges[name]), out_of_range=st.out_of_range)
        out["constant_columns"] = constant
        out["columns"] = cols
        if categorical and len(self.classes) >= 2:
            out["auc"] = {name: _best_auc(self.columns[name], self.classes) for name in numeric_columns
                          if name in self.columns and self.columns[name].auc}
        return out


def _best_auc(st: ColumnStats, classes: Counter) -> dict:
    """max over classes (one vs rest) of max(AUC, 1 − AUC), and the class it was reached for."""
    level = max(vc.level for vc in st.auc.values())
    for vc in st.auc.values():
        if vc.level < level:
            vc._coarsen(level)
    keys = np.unique(np.concatenate([vc.keys for vc in st.auc.values()]))
    per = {}
    for c, vc in st.auc.items():
        arr = np.zeros(keys.size, np.int64)
        arr[np.searchsorted(keys, vc.keys)] = vc.counts
        per[c] = arr
    total = sum(per.values())
    best, best_c = 0.5, None
    targets = sorted(per) if len(per) > 2 else [min(per, key=lambda c: (classes[c], c))]
    for c in targets:
        pos = per[c].astype(np.float64)
        neg = (total - per[c]).astype(np.float64)
        n_pos, n_neg = pos.sum(), neg.sum()
        if not n_pos or not n_neg:
            continue
        below = np.cumsum(neg) - neg
        auc = float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg))
        auc = max(auc, 1 - auc)
        if auc > best:
            best, best_c = auc, c
    return {"auc": best, "class": best_c, "grid_level": level}
