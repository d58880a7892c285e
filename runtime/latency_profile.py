"""Latency profile of one variant: milliseconds per (batch size, sequence-length bucket), refreshed online.

The scheduler asks ``predict(batch, seq)`` before it forms a batch or admits a request. Values come from a short
warm-up at load (``measure``), from the bundle's build-time figures (``from_variant``), and from every batch the
session runs (``observe``: exponentially weighted mean and mean absolute deviation, as in TCP's RTT estimator,
RFC 6298). A prediction is ``mean + k·deviation`` so that the budget holds for the tail, not only the median.

Between measured points, latency is interpolated linearly in batch size within a sequence bucket; for a bucket
never measured, a least-squares fit ``ms = a + c·tokens`` over every observation stands in (tokens = batch·seq).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from .latency import time_calls

_MIN_BUCKET = 8


def seq_bucket(seq: int | None) -> int:
    """The sequence-length bucket of ``seq`` tokens: the next power of two ≥ seq (at least 8); 0 for no sequence."""
    if not seq:
        return 0
    return max(_MIN_BUCKET, 1 << (int(seq) - 1).bit_length())


class LatencyProfile:
    """Milliseconds per batch for one variant, keyed by (batch size, sequence bucket).

    Args:
        variant: the variant name (for reports).
        alpha: weight of a new observation in the moving mean/deviation (0 < alpha ≤ 1).
        k_dev: predictions add ``k_dev`` deviations to the mean (tail margin).
    Thread-safe: the worker observes while submitters predict.
    """

    def __init__(self, variant: str = "", alpha: float = 0.2, k_dev: float = 3.0) -> None:
        self.variant = variant
        self.alpha = float(alpha)
        self.k_dev = float(k_dev)
        self._mean: dict[tuple[int, int], float] = {}
        self._dev: dict[tuple[int, int], float] = {}
        self._count: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._fit: tuple[float, float] | None = None
        self._cache: dict[tuple[int, int, float], float] = {}  # predictions since the last change (submit asks often)

    # -- updating ---------------------------------------------------------------------------------------------
    def observe(self, batch: int, seq: int | None, ms: float) -> None:
        """Record one measured batch: ``batch`` rows padded to ``seq`` tokens took ``ms`` milliseconds."""
        key = (int(batch), seq_bucket(seq))
        with self._lock:
            if key not in self._mean:
                self._mean[key] = float(ms)
                self._dev[key] = 0.1 * float(ms)  # a first sample says little about spread
                self._count[key] = 1
            else:
                m = self._mean[key]
                # a one-off stall (GC, a noisy neighbour) moves the estimate at most 3× per sample: if it swung
                # a batch size above every budget, nothing of that size would run again to correct it
                ms = min(max(float(ms), m / 3.0), m * 3.0)
                self._dev[key] += self.alpha * (abs(ms - m) - self._dev[key])
                self._mean[key] = m + self.alpha * (ms - m)
                self._count[key] += 1
            self._fit = None
            self._cache.clear()

    def set(self, batch: int, seq: int | None, mean_ms: float, dev_ms: float | None = None) -> None:
        """Set a point directly (bundle figures, tests). ``dev_ms`` defaults to 10 % of the mean."""
        key = (int(batch), seq_bucket(seq))
        with self._lock:
            self._mean[key] = float(mean_ms)
            self._dev[key] = float(dev_ms if dev_ms is not None else 0.1 * mean_ms)
            self._count[key] = max(1, self._count.get(key, 0))
            self._fit = None
            self._cache.clear()

    # -- querying ---------------------------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return not self._mean

    def points(self) -> dict[tuple[int, int], float]:
        """A copy of the mean ms per (batch, bucket)."""
        with self._lock:
            return dict(self._mean)

    def predict(self, batch: int, seq: int | None = None, k_dev: float | None = None) -> float:
        """Predicted ms (mean + k·deviation) for ``batch`` rows at ``seq`` tokens; ``inf`` when nothing is known.

        ``k_dev`` overrides the profile's margin (0 = the expected time, for summing a backlog).
        """
        b, s = int(batch), seq_bucket(seq)
        k = self.k_dev if k_dev is None else float(k_dev)
        with self._lock:
            hit = self._cache.get((b, s, k))
            if hit is not None:
                return hit
            if not self._mean:
                return math.inf
            mean, dev = self._interp(b, s)
            out = mean + k * dev
            # fewer rows never cost more than more rows measured at the same length (the monotone envelope)
            for (bb, ss), m in self._mean.items():
                if ss == s and bb > b:
                    out = min(out, m + k * self._dev[(bb, ss)])
            self._cache[(b, s, k)] = out
        return out

    def _interp(self, b: int, s: int) -> tuple[float, float]:
        if (b, s) in self._mean:
            return self._mean[(b, s)], self._dev[(b, s)]
        row = sorted((bb, self._mean[(bb, ss)], self._dev[(bb, ss)]) for (bb, ss) in self._mean if ss == s)
        if not row and s:  # figures without a sequence length (bucket 0) stand for any length
            row = sorted((bb, self._mean[(bb, ss)], self._dev[(bb, ss)]) for (bb, ss) in self._mean if ss == 0)
        if len(row) >= 2 or (row and row[0][0] >= b):
            lo = [p for p in row if p[0] <= b]
            hi = [p for p in row if p[0] >= b]
            if lo and hi:
                (b0, m0, d0), (b1, m1, d1) = lo[-1], hi[0]
                if b1 == b0:
                    return m0, d0
                t = (b - b0) / (b1 - b0)
                return m0 + t * (m1 - m0), d0 + t * (d1 - d0)
            if hi:  # below the smallest measured batch: no cheaper than it (fixed overhead dominates)
                return hi[0][1], hi[0][2]
            (b0, m0, d0), (b1, m1, d1) = row[-2], row[-1]  # beyond the largest: extend the last slope
            slope = max(0.0, (m1 - m0) / (b1 - b0))
            return m1 + slope * (b - b1), d1 * b / b1
        if row:  # one point, smaller batch: scale per row (conservative, ignores the fixed overhead it shares)
            b0, m0, d0 = row[0]
            return m0 * b / b0, d0 * b / b0
        a, c = self._token_fit()
        tokens = b * max(s, 1)
        mean = a + c * tokens
        rel = float(np.mean([self._dev[k] / max(self._mean[k], 1e-9) for k in self._mean]))
        return mean, max(rel, 0.1) * mean

    def _token_fit(self) -> tuple[float, float]:
        if self._fit is None:
            keys = list(self._mean)
            x = np.array([k[0] * max(k[1], 1) for k in keys], dtype=np.float64)
            y = np.array([self._mean[k] for k in keys], dtype=np.float64)
            if len(set(x.tolist())) < 2:
                self._fit = (0.0, float(y.mean() / x.mean()))
            else:
                c, a = np.polyfit(x, y, 1)
                c = max(float(c), 0.0)
                a = max(float(a), 0.0)
                self._fit = (a, c)
        return self._fit

    def max_batch_within(self, ms: float, seq: int | None = None, limit: int = 1) -> int:
        """The largest batch ≤ ``limit`` predicted to finish within ``ms``; 0 when even one row does not fit."""
        lo, hi = 0, max(1, int(limit))  # binary search: predictions grow with batch size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(mid, seq) <= ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- (de)serialising --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"variant": …, "points": [{"batch": 8, "seq_bucket": 32, "mean_ms": …, "dev_ms": …}]}``."""
        with self._lock:
            return {"variant": self.variant, "points": [
                {"batch": b, "seq_bucket": s, "mean_ms": round(m, 4), "dev_ms": round(self._dev[(b, s)], 4),
                 "count": self._count.get((b, s), 0)} for (b, s), m in sorted(self._mean.items())]}

    @classmethod
    def from_variant(cls, variant: Any, **kw: Any) -> "LatencyProfile":
        """Seed from a bundle variant's build-time ``latency_ms``.

        Accepted keys: ``"8"`` (batch 8) or ``"8x64"`` (batch 8, 64 tokens); values a number (ms) or a dict with
        ``p50`` and optionally ``p99`` (the deviation is taken as (p99 − p50) / k_dev) and ``shape`` (input name →
        shape, as ``dsedge build`` records it: the sequence length is read from a 2-D input's second dim).
        A figure without a sequence length stands for any length until this machine measures one.
        """
        prof = cls(getattr(variant, "name", ""), **kw)
        for key, val in (getattr(variant, "latency_ms", None) or {}).items():
            try:
                b, _, s = str(key).partition("x")
                batch, seq = int(b), int(s) if s else None
                if isinstance(val, Mapping):
                    shapes = [v for v in (val.get("shape") or {}).values() if isinstance(v, list) and len(v) == 2]
                    if seq is None and shapes:
                        seq = int(shapes[0][1])
                    p50 = float(val.get("p50", val.get("median", val.get("mean"))))
                    p99 = float(val.get("p99", p50 * 1.3))
                    prof.set(batch, seq, p50, max(p99 - p50, 0.05 * p50) / prof.k_dev)
                else:
                    prof.set(batch, seq, float(val))
            except (TypeError, ValueError):
                continue  # an unknown entry in the bundle is not worth failing a load for
        return prof


def measure(
    profile: LatencyProfile,
    run: Callable[[dict[str, np.ndarray]], Any],
    make_inputs: Callable[[int, int | None], dict[str, np.ndarray]],
    batch_sizes: Iterable[int],
    seqs: Iterable[int | None] = (None,),
    repeats: int = 3,
    stop_ms: float = math.inf,
) -> LatencyProfile:
    """Warm up and time ``run`` at each batch size and sequence length; record the median into ``profile``.

    Batch sizes are tried in increasing order; for a sequence length, larger batches are skipped once one takes
    longer than ``stop_ms`` (no budget could use them). The first call per shape is a discarded warm-up.
    """
    for seq in seqs:
        for b in sorted(set(int(x) for x in batch_sizes)):
            feed = make_inputs(b, seq)
            # one untimed run: ORT allocates buffers for a new shape on its first run
            stats = time_calls(lambda: run(feed), iterations=max(1, repeats), warmup=1)
            med = stats["p50"]
            profile.set(b, seq, med, max(stats["max"] - med, 0.1 * med))
            if med > stop_ms:
                break
    return profile
