"""Calibration of the admission plan: how far real completions land from the planned ones, learnt online.

Admission plays the queue forward with the latency profile's figures (runtime/scheduler.py) and gets a planned
completion for the new request. On a shared machine those figures are right on average and wrong in the tail: the
machine's speed drifts over seconds, so per-batch tails measured a second ago are exceeded more often than their
quantile says, and errors of consecutive batches are correlated. Rather than guess a safety margin, the lane
measures its own plan's error: for every admitted request, the residual ``actual latency − planned latency`` in ms
(for one dropped at its deadline, the latency it would at least have had). Admission adds a high quantile of the
recent residuals to a new plan, so a plan that has been optimistic lately becomes stricter; a pessimistic plan
(residuals below 0) adds nothing: the plan itself never admits a request it predicts late.

Which quantile: most admitted requests are planned well inside their deadline, so covering 99 % of residuals makes
far fewer than 1 % of admitted requests miss and rejects more than needed. The level is adapted to the miss rate
actually seen, by adaptive conformal inference (ACI): after each planned request resolves,
``α ← α + γ · (target_miss − missed)`` (``missed`` is 1 for a late, failed or dropped answer) and the offset is the
residuals' ``1 − α`` quantile. Misses rarer than ``target_miss`` raise α (a smaller offset, more admitted); each
miss lowers it by about γ at once.

This is split conformal prediction (Vovk, Gammerman & Shafer, *Algorithmic Learning in a Random World*, 2005) with
absolute residuals as nonconformity scores over a rolling window, its level adapted online as in adaptive conformal
inference under distribution shift (Gibbs & Candès, NeurIPS 2021). It cannot lock: α moves by bounded additive
steps within ``[alpha_min, alpha_max]``; scores come only from requests the plan admitted; queueing the plan
already knew about is in the plan, so late answers it caused leave the residual at ≈ 0; the offset is clamped to
``[0, high_ms]``; and scores older than ``horizon_s`` stop counting, so a lane that rejects everything returns to
the uncalibrated plan (offset 0) within ``horizon_s`` and its next admissions are scored afresh.
"""
from __future__ import annotations

import collections
import math
import threading
import time

_clock = time.perf_counter


class PlanCalibration:
    """A rolling empirical quantile of ``actual − planned`` latency (ms) over a lane's admitted requests.

    Args:
        quantile: the starting quantile level of residuals, ``1 − α`` (0.5 < quantile < 1).
        target_miss: the share of planned requests allowed to miss that α is steered to.
        gamma: the ACI step size (per resolved request).
        alpha_min / alpha_max: bounds of α (the offset stays between the 50th and 99.5th percentile).
        window: most recent scores kept.
        horizon_s: scores older than this no longer count, s.
        min_scores: fewer recent scores than this give the offset 0 (the plan as it is).
        high_ms: the largest offset, ms.
        refresh_s: the offset is recomputed at most this often, s (``offset_ms()`` runs on every admission).
    Raises:
        ValueError: ``quantile`` outside (0.5, 1).
    Thread-safe.
    """

    def __init__(self, quantile: float = 0.99, window: int = 512, horizon_s: float = 1.0, min_scores: int = 20,
                 high_ms: float = 1e4, refresh_s: float = 0.02, *, target_miss: float = 0.005, gamma: float = 0.05,
                 alpha_min: float = 0.005, alpha_max: float = 0.5) -> None:
        if not 0.5 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0.5, 1), got {quantile}")
        self.quantile = float(quantile)
        self.target_miss, self.gamma = float(target_miss), float(gamma)
        self.alpha_min, self.alpha_max = float(alpha_min), float(alpha_max)
        self.alpha = min(max(1.0 - self.quantile, self.alpha_min), self.alpha_max)
        self.horizon_s = float(horizon_s)
        self.min_scores = int(min_scores)
        self.high_ms = float(high_ms)
        self.refresh_s = float(refresh_s)
        self._scores: collections.deque = collections.deque(maxlen=int(window))
        self._lock = threading.Lock()
        self._offset = 0.0
        self._t_offset = -math.inf

    def score(self, planned_ms: float, actual_ms: float, now: float | None = None) -> None:
        """Record one admitted request: ``planned_ms`` at admission, ``actual_ms`` when it was answered (or the
        latency it would at least have had, when dropped at its deadline)."""
        if not (planned_ms > 0.0 and math.isfinite(planned_ms) and math.isfinite(actual_ms)):
            return
        with self._lock:
            self._scores.append((_clock() if now is None else now, actual_ms - planned_ms))

    def outcome(self, missed: bool) -> None:
        """A planned request resolved; ``missed`` when answered late, failed or dropped (one ACI step on α)."""
        with self._lock:
            a = self.alpha + self.gamma * (self.target_miss - (1.0 if missed else 0.0))
            self.alpha = min(max(a, self.alpha_min), self.alpha_max)

    def offset_ms(self, now: float | None = None) -> float:
        """What to add to a plan, ms (0 until ``min_scores`` recent scores exist)."""
        t = _clock() if now is None else now
        if t - self._t_offset < self.refresh_s:
            return self._offset
        with self._lock:
            recent = sorted(s for ts, s in self._scores if t - ts <= self.horizon_s)
            n = len(recent)
            q = 1.0 - self.alpha
            off = recent[min(n - 1, max(0, math.ceil(q * n) - 1))] if n >= self.min_scores else 0.0
            self._offset = min(max(off, 0.0), self.high_ms)
            self._t_offset = t
        return self._offset

    def to_dict(self) -> dict:
        """``{"quantile": 1 − α now, "offset_ms": x, "scores": n recent}`` (JSON-able, for reports)."""
        now = _clock()
        off = self.offset_ms(now)
        with self._lock:
            n = sum(1 for ts, _ in self._scores if now - ts <= self.horizon_s)
        return {"quantile": round(1.0 - self.alpha, 4), "offset_ms": round(off, 3), "scores": n}
