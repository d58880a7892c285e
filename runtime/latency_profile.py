"""Latency profile of one variant: service time per (batch size, sequence-length bucket), learnt online.

The scheduler asks ``predict(batch, seq)`` before it forms a batch or admits a request.

Estimator (per key = (batch size, sequence bucket)): a sliding window of the most recent measured service times of
that key — at most ``window`` samples, and of those only the ones from the last ``horizon_s`` seconds as long as at
least ``min_samples`` are that recent. The tail prediction is the window's empirical ``quantile`` (nearest rank)
once the window holds enough samples for it (n·(1 − quantile) ≥ 1), else the median plus three robust standard
deviations (1.4826 × the median absolute deviation: one outlier among a few samples is not the tail); the expected
time is the median. A sliding-window empirical quantile follows the measured latency from either side
within one window (the sliding-window model of Datar, Gionis, Indyk & Motwani, SIAM J. Comput. 2002; exact here,
the window is small): there is no multiplicative state that a burst of late answers could push to a cap and
keep there, and a stale sample (a stall, an ORT first run on a new shape) ages out after ``horizon_s``.

Only service time (batch start → batch end) is ever observed — never a request's latency — so lateness that came
from queueing the scheduler already accounted for cannot raise an estimate.

Seeds: figures known before anything ran here (the bundle's build-time ``latency_ms`` via ``from_variant``, or
``set``) stand in for a key until it is measured. While some keys are measured and others only seeded, seeds are
scaled by this machine's speed: the geometric mean of measured/seed over keys that have both (``scale_seeds``;
off for a profile that should trust the bundle's figures as they are).

Between known points, latency is interpolated linearly in batch size within a sequence bucket; beyond the largest
known batch the last slope is extended, never to a per-row time below the largest batch's (an unmeasured larger
batch is not assumed to batch better than what was measured); for a bucket never seen, a least-squares fit
``ms = a + c·tokens`` over every known point stands in (tokens = batch·seq).
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np

_MIN_BUCKET = 8
_REFRESH_S = 0.02
_EXPIRE_S = 0.1
_clock = time.perf_counter


def seq_bucket(seq: int | None) -> int:
    """The sequence-length bucket of ``seq`` tokens: the next power of two ≥ seq (at least 8); 0 for no sequence."""
    if not seq:
        return 0
    return max(_MIN_BUCKET, 1 << (int(seq) - 1).bit_length())


class LatencyProfile:
    """Service time (ms) per batch for one variant, keyed by (batch size, sequence bucket).

    Args:
        variant: the variant name (for reports).
        quantile: the tail the scheduler plans with (0.5 < quantile < 1).
        window: most recent samples kept per key.
        horizon_s: samples older than this stop counting once ``min_samples`` newer ones exist, s.
        min_samples: the fewest samples a key's estimate is taken over (older ones are kept until then).
        k_dev: a seed's tail is ``mean + k_dev · deviation`` (``set``/``from_variant`` give mean and deviation).
        scale_seeds: scale unmeasured seeds by measured/seed on this machine (see the module doc).
        refresh_s: new samples of a known key count in predictions at most this late (predicting stays cheap), s.
        alpha: kept for callers of the former moving-mean estimator; unused.
    Thread-safe: the worker observes while submitters predict.
    """

    def __init__(self, variant: str = "", alpha: float = 0.2, k_dev: float = 3.0, *, quantile: float = 0.98,
                 window: int = 64, horizon_s: float = 1.0, min_samples: int = 3, scale_seeds: bool = True,
                 refresh_s: float = _REFRESH_S) -> None:
        self.variant = variant
        self.k_dev = float(k_dev)
        self.quantile = float(quantile)
        self.window = int(window)
        self.horizon_s = float(horizon_s)
        self.min_samples = max(1, int(min_samples))
        self.scale_seeds = scale_seeds
        self.refresh_s = float(refresh_s)
        self._win: dict[tuple[int, int], collections.deque] = {}
        self._seed: dict[tuple[int, int], tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._pts: dict[tuple[int, int], tuple[float, float]] | None = None  # key -> (expected, tail) ms
        self._t_pts = 0.0
        self._dirty = False
        self._fit: tuple[float, float] | None = None
        self._cache: dict[tuple[int, int, float], float] = {}

    # -- updating ---------------------------------------------------------------------------------------------
    def observe(self, batch: int, seq: int | None, ms: float, now: float | None = None) -> None:
        """Record one measured batch: ``batch`` rows padded to ``seq`` tokens ran in ``ms`` milliseconds."""
        key = (int(batch), seq_bucket(seq))
        t = _clock() if now is None else now
        with self._lock:
            win = self._win.get(key)
            if win is None:
                win = self._win[key] = collections.deque(maxlen=self.window)
                self._invalidate()  # a new key counts at once; a new sample of a known one within refresh_s
            else:
                self._dirty = True
            win.append((t, float(ms)))

    def set(self, batch: int, seq: int | None, mean_ms: float, dev_ms: float | None = None) -> None:
        """Seed a point (bundle figures, tests): it stands in until the key is measured. ``dev_ms`` defaults to
        10 % of the mean; the seed's tail is ``mean + k_dev · dev``."""
        key = (int(batch), seq_bucket(seq))
        with self._lock:
            self._seed[key] = (float(mean_ms), float(dev_ms if dev_ms is not None else 0.1 * mean_ms))
            self._invalidate()

    def scale_seed_figures(self, factor: float) -> None:
        """Multiply every seed (mean and deviation) by ``factor``: figures measured with another intra-op thread
        count than this backend has (``runtime/instances.thread_scale``; > 1 when they had more). Measurements here
        rescale seeds anyway (``scale_seeds``); this is the start."""
        with self._lock:
            self._seed = {k: (m * factor, d * factor) for k, (m, d) in self._seed.items()}
            self._invalidate()

    def forget(self) -> None:
        """Drop every measured sample (seeds stay)."""
        with self._lock:
            self._win.clear()
            self._invalidate()

    def _invalidate(self) -> None:
        self._pts = None
        self._fit = None
        self._cache.clear()

    # -- querying ---------------------------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return not self._win and not self._seed

    @property
    def measured(self) -> bool:
        """True once any batch was observed on this machine."""
        return bool(self._win)

    def samples(self, batch: int, seq: int | None = None) -> int:
        """Samples held for the key of ``batch`` rows at ``seq`` tokens."""
        win = self._win.get((int(batch), seq_bucket(seq)))
        return len(win) if win else 0

    def recent_samples(self, batch: int, seq: int | None = None, now: float | None = None) -> int:
        """Samples of the key of ``batch`` rows at ``seq`` tokens from the last ``horizon_s``: with fewer than
        ``min_samples``, its estimate still rests on older ones (or on seeds and interpolation, with none)."""
        t = _clock() if now is None else now
        with self._lock:
            win = self._win.get((int(batch), seq_bucket(seq)))
            return sum(1 for ts, _ in win if t - ts <= self.horizon_s) if win else 0

    def last_observed(self, batch: int, seq: int | None = None) -> float | None:
        """``time.perf_counter()`` of the key's newest sample, or None."""
        win = self._win.get((int(batch), seq_bucket(seq)))
        return win[-1][0] if win else None

    def points(self) -> dict[tuple[int, int], float]:
        """The expected ms per known (batch, bucket): measured keys, then scaled seeds."""
        with self._lock:
            return {k: v[0] for k, v in self._points(_clock()).items()}

    def _points(self, now: float) -> dict[tuple[int, int], tuple[float, float]]:
        # (expected, tail) per key; recomputed at most every refresh_s after new samples (observing stays cheap
        # on the serving path), and every _EXPIRE_S as samples age out of the horizon
        if self._pts is not None:
            age = now - self._t_pts
            if (age < self.refresh_s and age < _EXPIRE_S) or (not self._dirty and age < _EXPIRE_S):
                return self._pts
            self._cache.clear()
        self._dirty = False
        pts: dict[tuple[int, int], tuple[float, float]] = {}
        for key, win in self._win.items():
            recent = [ms for t, ms in win if now - t <= self.horizon_s]
            if len(recent) < self.min_samples:
                recent = [ms for _, ms in list(win)[-self.min_samples:]]
            xs = sorted(recent)
            n = len(xs)
            mid = xs[(n - 1) // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
            if n * (1.0 - self.quantile) >= 1.0:  # enough samples for the empirical quantile
                tail = xs[min(n - 1, max(0, math.ceil(self.quantile * n) - 1))]
            else:  # too few: one outlier would be "the tail"; a robust spread (median absolute deviation) instead
                mad = sorted(abs(x - mid) for x in xs)[(n - 1) // 2]
                tail = mid + 3.0 * 1.4826 * mad
            pts[key] = (mid, max(tail, mid))
        scale = 1.0
        if self.scale_seeds and pts:
            ratios = [pts[k][0] / s[0] for k, s in self._seed.items() if k in pts and s[0] > 0]
            if ratios:
                scale = min(max(math.exp(sum(map(math.log, ratios)) / len(ratios)), 0.05), 20.0)
        for key, (mean, tail) in self._seed_points().items():
            if key not in pts:
                pts[key] = (mean * scale, tail * scale)
        self._pts, self._t_pts, self._fit = pts, now, None
        return pts

    def _seed_points(self) -> dict[tuple[int, int], tuple[float, float]]:
        # (expected, tail) per seeded key, as set: mean, and mean + k_dev · deviation
        return {k: (m, m + self.k_dev * d) for k, (m, d) in self._seed.items()}

    def predict(self, batch: int, seq: int | None = None, k_dev: float | None = None) -> float:
        """Predicted service ms for ``batch`` rows at ``seq`` tokens; ``inf`` when nothing is known.

        The tail (``quantile``) by default; ``k_dev=0`` gives the expected time (for summing a backlog); another
        ``k_dev`` scales the tail margin by ``k_dev / self.k_dev``.
        """
        b, s = int(batch), seq_bucket(seq)
        k = -1.0 if k_dev is None else float(k_dev)
        now = _clock()
        with self._lock:
            pts = self._points(now)
            hit = self._cache.get((b, s, k))
            if hit is not None:
                return hit
            if not pts:
                return math.inf
            mid, tail = self._interp(pts, b, s)
            if k < 0:
                out = tail
            elif self.k_dev > 0:
                out = mid + (k / self.k_dev) * (tail - mid)
            else:
                out = tail
            # fewer rows never cost more than more rows known at the same length (the monotone envelope)
            for (bb, ss), (m, t) in pts.items():
                if ss == s and bb > b:
                    big = t if k < 0 else (m + (k / self.k_dev) * (t - m) if self.k_dev > 0 else t)
                    out = min(out, big)
            self._cache[(b, s, k)] = out
        return out

    def times(self, batch: int, seq: int | None = None) -> tuple[float, float]:
        """``(expected, tail)`` ms for ``batch`` rows at ``seq`` tokens: ``predict(batch, seq, k_dev=0)`` and
        ``predict(batch, seq)`` (``(inf, inf)`` when nothing is known); admission takes both for every batch it
        plans."""
        return self.predict(batch, seq, k_dev=0.0), self.predict(batch, seq)

    def low(self, batch: int, seq: int | None = None, q: float = 0.25) -> float | None:
        """The ``q`` quantile (nearest rank) of the key's window of samples, ms; None when it holds none. A low
        quantile is what a run costs without the waits some of its samples hold (runtime/scheduler.py
        ``Lane.try_inline``: a run on the caller's thread waits for the interpreter lock while the worker has it)."""
        with self._lock:
            win = self._win.get((int(batch), seq_bucket(seq)))
            if not win:
                return None
            xs = sorted(ms for _, ms in win)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    def seed_times(self, batch: int, seq: int | None = None) -> tuple[float, float]:
        """``(expected, tail)`` ms from the seeds alone (as set, not scaled by this machine's measurements);
        ``(inf, inf)`` without seeds. What a run costs where nothing else contends (the build host's figures):
        a stand-in where the measured samples are known to include waits that the asked-about run will not
        have (a run on the caller's thread, runtime/scheduler.py ``Lane.try_inline``)."""
        with self._lock:
            pts = self._seed_points()
            if not pts:
                return math.inf, math.inf
            return self._interp(pts, int(batch), seq_bucket(seq), fit=False)

    def _interp(self, pts: dict, b: int, s: int, fit: bool = True) -> tuple[float, float]:
        if (b, s) in pts:
            return pts[(b, s)]
        row = sorted((bb, m, t) for (bb, ss), (m, t) in pts.items() if ss == s)
        if not row and s:  # figures without a sequence length (bucket 0) stand for any length
            row = sorted((bb, m, t) for (bb, ss), (m, t) in pts.items() if ss == 0)
        if len(row) >= 2 or (row and row[0][0] >= b):
            lo = [p for p in row if p[0] <= b]
            hi = [p for p in row if p[0] >= b]
            if lo and hi:
                (b0, m0, t0), (b1, m1, t1) = lo[-1], hi[0]
                if b1 == b0:
                    return m0, t0
                f = (b - b0) / (b1 - b0)
                return m0 + f * (m1 - m0), t0 + f * (t1 - t0)
            if hi:  # below the smallest known batch: no cheaper than it (fixed overhead dominates)
                return hi[0][1], hi[0][2]
            # beyond the largest: the last slope extended, but never a row cheaper than at the largest known batch
            # (the slope between the two smallest batches is the flattest, the fixed overhead shared; extended,
            # it predicted about 44 ms for a 6-row MiniLM int8 batch that took 81: five answers late at once)
            (b0, m0, t0), (b1, m1, t1) = row[-2], row[-1]
            slope = max(0.0, (m1 - m0) / (b1 - b0))
            mid = max(m1 + slope * (b - b1), m1 * b / b1)
            return mid, mid * max(t1 / max(m1, 1e-9), 1.0)
        if row:  # one point, smaller batch: scale per row (conservative, ignores the fixed overhead it shares)
            b0, m0, t0 = row[0]
            return m0 * b / b0, t0 * b / b0
        if not fit:  # (seed_times: the fit is cached for the measured points)
            return math.inf, math.inf
        a, c = self._token_fit(pts)
        mid = a + c * b * max(s, 1)
        rel = max(max(t / max(m, 1e-9) for m, t in pts.values()), 1.0)
        return mid, rel * mid

    def _token_fit(self, pts: dict) -> tuple[float, float]:
        if self._fit is None:
            keys = list(pts)
            x = np.array([k[0] * max(k[1], 1) for k in keys], dtype=np.float64)
            y = np.array([pts[k][0] for k in keys], dtype=np.float64)
            if len(set(x.tolist())) < 2:
                self._fit = (0.0, float(y.mean() / x.mean()))
            else:
                c, a = np.polyfit(x, y, 1)
                self._fit = (max(float(a), 0.0), max(float(c), 0.0))
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
        """JSON-able: ``{"variant": …, "quantile": 0.98, "points": [{"batch": 8, "seq_bucket": 32, "mean_ms": …,
        "tail_ms": …, "count": n, "seeded": bool}]}`` (``mean_ms`` is the expected time: the window's median)."""
        with self._lock:
            pts = self._points(_clock())
            return {"variant": self.variant, "quantile": self.quantile, "points": [
                {"batch": b, "seq_bucket": s, "mean_ms": round(m, 4), "tail_ms": round(t, 4),
                 "count": len(self._win.get((b, s), ())), "seeded": (b, s) in self._seed}
                for (b, s), (m, t) in sorted(pts.items())]}

    @classmethod
    def from_variant(cls, variant: Any, sequence: bool = True, **kw: Any) -> "LatencyProfile":
        """Seed from a bundle variant's build-time ``latency_ms``.

        Accepted keys: ``"8"`` (batch 8) or ``"8x64"`` (batch 8, 64 tokens); values a number (ms) or a dict with
        ``p50`` and optionally ``p99`` (the deviation is taken as (p99 − p50) / k_dev) and ``shape`` (input name →
        shape, as ``dsedge build`` records it: the sequence length is read from a 2-D input's second dim).
        A figure without a sequence length stands for any length until this machine measures one.
        ``sequence=False``: the model has no sequence axis, and every figure is keyed without a length (a 2-D
        input's second dim is then a feature width: the fraud scorer's 29 had keyed its figures under bucket 32,
        where no request of it ever looks).
        """
        prof = cls(getattr(variant, "name", ""), **kw)
        for key, val in (getattr(variant, "latency_ms", None) or {}).items():
            try:
                b, _, s = str(key).partition("x")
                batch, seq = int(b), int(s) if s and sequence else None
                if batch < 1 or (seq is not None and seq < 1):
                    continue
                if isinstance(val, Mapping):
                    shapes = [v for v in (val.get("shape") or {}).values() if isinstance(v, list) and len(v) == 2]
                    if seq is None and shapes and sequence:
                        seq = int(shapes[0][1])
                    p50 = float(val.get("p50", val.get("median", val.get("mean"))))
                    p99 = float(val.get("p99", p50 * 1.3))
                    if not (math.isfinite(p50) and math.isfinite(p99) and p50 > 0):
                        continue
                    prof.set(batch, seq, p50, max(p99 - p50, 0.05 * p50) / max(prof.k_dev, 1e-9))
                else:
                    if not (math.isfinite(float(val)) and float(val) > 0):
                        continue
                    prof.set(batch, seq, float(val))
            except (TypeError, ValueError, OverflowError):
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
    """Warm up and time ``run`` at each batch size and sequence length; every timed call is observed.

    Batch sizes are tried in increasing order; for a sequence length, larger batches are skipped once one takes
    longer than ``stop_ms`` (no budget could use them). The first call per shape is a discarded warm-up (ORT
    allocates buffers for a new shape on its first run).
    """
    for seq in seqs:
        for b in sorted(set(int(x) for x in batch_sizes)):
            feed = make_inputs(b, seq)
            run(feed)
            samples: list[float] = []
            for _ in range(max(1, repeats)):
                t0 = _clock()
                run(feed)
                samples.append((_clock() - t0) * 1e3)
            for ms in samples:
                profile.observe(b, seq, ms)
            if float(np.median(samples)) > stop_ms:
                break
    return profile
