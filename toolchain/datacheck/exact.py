"""Order-independent float sums: a shard's sum merges with another's to the same bits as one pass over all rows.

Each finite float64 ``x = m * 2**e`` (``m`` a 53-bit integer) is added to a Python integer in units of ``2**-1126``
(below the smallest subnormal), so the sum is exact; ``value()`` rounds once, correctly. Squares are summed the same
way (``m**2 * 2**(2e)``, units ``2**-2252``), which makes the mean and the standard deviation identical however the
rows were split into shards.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

_SHIFT = 1126        # 1074 (subnormal exponent) + 52 (mantissa bits)


class ExactSum:
    """Exact running sum and sum of squares of float64 values (non-finite values must be filtered first)."""

    __slots__ = ("total", "squares", "count")

    def __init__(self) -> None:
        self.total = 0      # int, units of 2**-_SHIFT
        self.squares = 0    # int, units of 2**-(2*_SHIFT)
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return
        m, e = np.frexp(v)
        mant = (m * (1 << 53)).astype(np.int64)          # exact: |m| < 1, 53 significant bits
        exp = e.astype(np.int64) - 53 + _SHIFT           # >= 0 for every finite float64
        for x in np.unique(exp):
            sel = mant[exp == x].tolist()
            self.total += sum(sel) << int(x)
            self.squares += sum(s * s for s in sel) << int(2 * x)
        self.count += int(v.size)

    def merge(self, other: "ExactSum") -> None:
        self.total += other.total
        self.squares += other.squares
        self.count += other.count

    def value(self) -> float:
        return float(Fraction(self.total, 1 << _SHIFT))

    def mean(self) -> float | None:
        return float(Fraction(self.total, self.count << _SHIFT)) if self.count else None

    def std(self) -> float | None:
        """Population standard deviation (exact variance, one rounding, then sqrt)."""
        if not self.count:
            return None
        n = self.count
        s = Fraction(self.total, 1 << _SHIFT)
        q = Fraction(self.squares, 1 << (2 * _SHIFT))
        var = q / n - (s / n) ** 2
        return float(var) ** 0.5 if var > 0 else 0.0
