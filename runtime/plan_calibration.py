"""Calibration of the admission plan: how far real completions land from the planned ones, learnt online.

Admission plays the queue forward with the latency profile's figures (runtime/scheduler.py) and gets, for the new
request, an expected latency (medians added up) and a spread (the batches' tail margins added in quadrature). It
plans with ``expected + z · spread``. On a shared machine the profile is right on average and wrong in the tail:
the machine's speed drifts over seconds, so per-batch tails measured a second ago are exceeded more often than
their quantile says, and the errors of consecutive batches are correlated. Rather than guess ``z``, the lane
measures its own plan's error: for every admitted request, the standardized residual
``(actual − expected) / spread`` (for one dropped at its deadline, the latency it would at least have had), and
``z`` is a high quantile of the recent ones. Standardizing by the plan's own spread lets one ``z`` serve a request
planned alone on an idle lane and one planned behind five batches.

Which quantile: most admitted requests are planned well inside their deadline, so covering 99 % of residuals makes
far fewer than 1 % of admitted requests miss and rejects more than needed. The level is adapted to the miss rate
actually seen, by adaptive conformal inference (ACI): after each planned request resolves,
``α ← α + γ · (target_miss − missed)`` (``missed`` is 1 for a late, failed or dropped answer) and ``z`` is the
``1 − α`` quantile. Misses rarer than ``target_miss`` raise α (a smaller ``z``, more admitted); each miss lowers it
by about γ at once.

The target is 0.1 %, under the 1 % a budgeted server aims at: misses come in clusters (a slower second on a shared
host), and between clusters each hit raises α by ``γ · target_miss``, so with 0.5 % α had climbed to 0.03–0.07
(a quantile near the 95th) by the time the next cluster came; and α clipped at its floor forgets the misses
beyond it. Measured in process (MiniLM fp32, 2 × 1-thread instances, 50 ms budget, open-loop bursty arrivals, 10 s
runs; benchmarks/streaming.py's schedule), in budget of admitted at 3× the batch-1 capacity: 97.2–99.1 %, median
98.1 %, with 0.5 % (19 runs) against 98.1–99.7 %, median 99.3 %, with 0.1 % (11 runs), goodput 169–188 against
154–205/s; at 1.5×, 98.6–99.6 % against 99.2–100 %, goodput within noise. Through ``dsedge serve`` at 3× (three
interleaved pairs): 92.1–96.3 % against 95.9–97.8 %, the server's own `deadline` drops 30–67 against 13–31.

This is split conformal prediction (Vovk, Gammerman & Shafer, *Algorithmic Learning in a Random World*, 2005) with
normalized nonconformity scores (Papadopoulos, Gammerman & Vovk, 2008; the locally weighted residuals of Lei et
al., JASA 2018) over a rolling window, its level adapted online as in adaptive conformal inference under
distribution shift (Gibbs & Candès, NeurIPS 2021). It cannot lock: α moves by bounded additive steps within
``[alpha_min, alpha_max]``; scores come only from requests the plan admitted; queueing the plan already knew about
is in the plan, so late answers it caused leave the residual at ≈ 0; ``z`` is clamped to ``[0, z_max]``; and
scores older than ``horizon_s`` stop counting once ``min_scores`` newer ones exist, and none older than
``max_horizon_s`` ever counts, so a lane that rejected everything, or came out of a stall, is back to the profile's
own tail (``z = default_z``, or the scheduler's overload prior while arrivals exceed the instances: ``z``'s
``cold_z``) within ``max_horizon_s`` (2 s). The longer reach is for low rates: at 35 requests/s a
one-second horizon never holds 50 scores, and the plan would run on the profile's tail, uncalibrated, however
often it missed. It is kept short because a stall's residuals outlive the stall: with 5 s, the scores of requests
planned at the stall's onset kept z at its cap for 1.5–2.8 s after a 2 s CPU burner ended (MiniLM fp32, 0.5×
load, 48 ms budget), and answers were back within budget 1.55 and 2.8 s after its end; with 2 s, 0.3–0.5 s
(three runs).

Strata (Mondrian conformal prediction: a separate quantile per category of a taxonomy, Vovk, Lindsay,
Nouretdinov & Gammerman, 2003), by the number of batches planned ahead of the request's own: 0, 1, 2 or more.
A request planned alone on an idle lane (stratum 0) is off by its own batch's noise only, which the latency
profile's tail already is (a sliding-window quantile of exactly that service time, runtime/latency_profile.py):
it is planned at the profile's tail (``default_z``), always. A request planned behind other batches is also off
by their errors, and those are correlated (a slow second slows every batch in it): its standardized residuals run
2–3× larger, and strata 1 and 2+ each take their own quantile (with fewer than ``min_scores`` recent scores of
its own, a stratum takes that of strata 1 and 2+ together, then ``default_z``). Never the quantile of all strata:
at light load nearly every score is an idle-lane plan's, whose spread is mostly the 20 % floor, so the same
absolute noise scores 2–4× higher there. Borrowed for the rare request queued behind one batch, it planned that
request at z = 3.4–3.9 (predicted 52–87 ms where 15–19 ms was expected) and refused 1.1–2.0 % of a 0.5× load
through ``dsedge serve`` (MiniLM fp32, 2 × 1-thread instances, 50 ms budget); with ``default_z``, 0–0.6 %, in
budget of offered 98.9–100 % against 98.0–98.9 %, of admitted 99.3–100 % against 99.8–100 % (three interleaved
pairs of 10 s runs). One pooled z made every idle-lane
plan pay for the queue's correlation, and froze there while nothing was admitted: measured on a 2-core host
(MiniLM fp32, b1 p50 6 ms, budget 18 ms, 0.5× load), the pooled z reached 2–3, an idle lane refused every
request for up to 4 s, and in one run 12 % of the offered load was answered within budget.
"""
from __future__ import annotations

import collections
import math
import threading
import time

_clock = time.perf_counter
STRATA = 3  # batches planned ahead of a request's own: 0, 1, 2 or more


class PlanCalibration:
    """A rolling, ACI-levelled quantile of standardized plan residuals over a lane's admitted requests.

    Args:
        quantile: the starting quantile level of residuals, ``1 − α`` (0.5 < quantile < 1).
        window: most recent scores kept.
        horizon_s: scores older than this no longer count once ``min_scores`` newer ones exist, s.
        max_horizon_s: scores older than this never count, s (the reach at low rates).
        min_scores: with fewer recent scores, ``z()`` is ``default_z``.
        default_z: the plan's multiplier of its spread before anything was scored (1: the profile's tail).
        z_max: the largest ``z``.
        refresh_s: ``z`` is recomputed at most this often, s (``z()`` runs on every admission; a pass over the
            window costs ~60 µs, and at 0.9x load every 20 ms cost each request ~20 µs of the caller's CPU, which
            on a 2-core host is taken from the instances' batches).
        target_miss: the share of planned requests allowed to miss that α is steered to.
        gamma: the ACI step size (per resolved request).
        alpha_min / alpha_max: bounds of α (``z`` stays between the recent scores' median and 99th percentile: one outlier among 50 scores does not set it).
    Raises:
        ValueError: ``quantile`` outside (0.5, 1).
    Thread-safe.
    """

    def __init__(self, quantile: float = 0.99, window: int = 512, horizon_s: float = 1.0, min_scores: int = 50,
                 default_z: float = 1.0, z_max: float = 5.0, refresh_s: float = 0.05, *, max_horizon_s: float = 2.0,
                 target_miss: float = 0.001, gamma: float = 0.05, alpha_min: float = 0.01,
                 alpha_max: float = 0.5) -> None:
        if not 0.5 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0.5, 1), got {quantile}")
        self.horizon_s = float(horizon_s)
        self.max_horizon_s = max(float(max_horizon_s), self.horizon_s)
        self.min_scores = int(min_scores)
        self.default_z, self.z_max = float(default_z), float(z_max)
        self.refresh_s = float(refresh_s)
        self.target_miss, self.gamma = float(target_miss), float(gamma)
        self.alpha_min, self.alpha_max = float(alpha_min), float(alpha_max)
        self.alpha = min(max(1.0 - float(quantile), self.alpha_min), self.alpha_max)
        self._scores: collections.deque = collections.deque(maxlen=int(window))
        self._lock = threading.Lock()
        self._z = [self.default_z] * STRATA  # per stratum
        self._known = [True] * STRATA  # per stratum: False while its z is ``default_z`` for want of scores
        self._t_z = -math.inf

    def score(self, expected_ms: float, actual_ms: float, spread_ms: float, now: float | None = None,
              stratum: int = 0) -> None:
        """Record one admitted request: its plan's ``expected_ms`` and ``spread_ms`` at admission, and
        ``actual_ms`` when it was answered (or the latency it would at least have had, when dropped);
        ``stratum``: batches planned ahead of its own (clipped to 2)."""
        if not (spread_ms > 0.0 and math.isfinite(expected_ms) and math.isfinite(actual_ms)):
            return
        k = min(max(int(stratum), 0), STRATA - 1)
        with self._lock:
            self._scores.append((_clock() if now is None else now, (actual_ms - expected_ms) / spread_ms, k))

    def outcome(self, missed: bool) -> None:
        """A planned request resolved; ``missed`` when answered late, failed or dropped (one ACI step on α)."""
        with self._lock:
            a = self.alpha + self.gamma * (self.target_miss - (1.0 if missed else 0.0))
            self.alpha = min(max(a, self.alpha_min), self.alpha_max)

    def z(self, now: float | None = None, stratum: int | None = None, cold_z: float | None = None) -> float:
        """The multiplier of a plan's spread for a request with ``stratum`` batches planned ahead of its own
        (None: the pooled one, reported only): ``default_z`` for stratum 0, always; for the others their own
        quantile, else that of strata 1 and 2+ together, else ``cold_z`` when given (the scheduler's prior for
        plans behind a queue while arrivals exceed what the instances serve: see the module doc), else
        ``default_z``."""
        t = _clock() if now is None else now
        if stratum is None:  # reports only: not on admission's path
            with self._lock:
                pooled = self._quantile(self._recent(t))
            return self.default_z if pooled is None else pooled
        if stratum <= 0:  # an idle lane's plan: the profile's own tail, always (no window pass for it)
            return self.default_z
        if t - self._t_z >= self.refresh_s:
            with self._lock:
                # one pass over the window for every stratum (this runs on admission's path: at light load
                # nearly every submit finds z older than refresh_s, and a pass per stratum cost ~90 µs there)
                # (stratum 0 is always default_z: its scores are not read here)
                within: list[list[tuple[float, float]]] = [[] for _ in range(STRATA)]
                behind: list[tuple[float, float]] = []
                oldest = t - self.max_horizon_s
                for ts, s, k in self._scores:
                    if k and ts >= oldest:
                        within[k].append((ts, s))
                        behind.append((ts, s))
                queued = self._quantile(self._near(t, behind))
                # not the pooled one: idle-lane plans' spreads are mostly the 20 % floor, so the same absolute
                # noise scores 2-4x higher there than behind a batch (see the module doc)
                known = queued is not None
                queued = self.default_z if queued is None else queued
                own = [self._quantile(self._near(t, within[k])) for k in range(1, STRATA)]
                self._z = [self.default_z] + [queued if q is None else q for q in own]
                self._known = [True] + [known or q is not None for q in own]
                self._t_z = t
        k = min(max(int(stratum), 0), STRATA - 1)
        return self._z[k] if cold_z is None or self._known[k] else cold_z

    def _quantile(self, recent: list[float]) -> float | None:
        n = len(recent)
        if n < self.min_scores:
            return None
        q = recent[min(n - 1, max(0, math.ceil((1.0 - self.alpha) * n) - 1))]
        return min(max(q, 0.0), self.z_max)

    def _recent(self, t: float, stratum: int | None = None, queued: bool = False) -> list[float]:
        # under self._lock: the scores (of ``stratum``, of every stratum but 0 when ``queued``, or all) within
        # horizon_s, or, with fewer than min_scores there, the latest min_scores within max_horizon_s; sorted
        within = [(ts, s) for ts, s, k in self._scores if t - ts <= self.max_horizon_s
                  and (k == stratum if stratum is not None else (k > 0 or not queued))]
        return self._near(t, within)

    def _near(self, t: float, within: list[tuple[float, float]]) -> list[float]:
        # of ``within`` ((time, score), window order, none older than max_horizon_s): the scores of the last
        # horizon_s, or the latest min_scores when fewer; sorted
        horizon = t - self.horizon_s
        near = [s for ts, s in within if ts >= horizon]
        if len(near) < self.min_scores:
            near = [s for _, s in within[-self.min_scores:]]
        return sorted(near)

    def to_dict(self) -> dict:
        """``{"quantile": 1 − α now, "z": pooled z, "z_by_ahead": [z per stratum], "scores": n recent}``
        (JSON-able, for reports)."""
        now = _clock()
        z = self.z(now)
        with self._lock:
            n = len(self._recent(now))
        return {"quantile": round(1.0 - self.alpha, 4), "z": round(z, 3),
                "z_by_ahead": [round(self.z(now, k), 3) for k in range(STRATA)], "scores": n}
