"""Counters and latency percentiles for a streaming session; optional Prometheus export.

Memory is bounded: counts are integers, latencies live in a ring buffer of the last ``window`` answers (p50/p90/p99
are over that window). Goodput = answers within budget per second since the first request.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Iterator

import numpy as np

from .results import Rejected, Result


class StreamMetrics:
    """Thread-safe tallies of every request's fate.

    ``snapshot()`` keys (stable, for dashboards and ``bench --json``): submitted, admitted, answered, errors,
    within_budget, budget_missed, answered_late, dropped_at_deadline, rejected (dict reason → count, "deadline"
    included), rejected_at_admission (dict reason → count: "budget", "overload", "shutdown"), in_flight, cancelled
    (futures their callers cancelled while queued: dropped unrun, neither answered nor missed), p50_ms,
    p90_ms, p99_ms, mean_ms, queue_p99_ms, mean_batch_size, goodput_per_s, throughput_per_s, rejection_rate,
    budget_miss_rate, elapsed_s, cascaded (dict variant → requests the cascade admitted to that cheaper variant,
    whatever their end: answered, late or dropped at their deadline; ``Result.variant`` says who answered).

    A request is *admitted* unless refused at admission (a "budget"/"overload" rejection, or "shutdown" before
    it ran: not the session's promise to break). Every admitted request is either answered within its budget or
    a *miss*: answered late (``answered_late``), answered with a backend error, or dropped at its deadline
    (``dropped_at_deadline``, reason "deadline"). ``budget_missed`` counts them all and
    ``budget_miss_rate`` = budget_missed / (admitted − cancelled): a request its caller cancelled while queued was
    admitted but never run, and neither kept nor broke its budget (it counted as kept, and 20 cancellations beside
    12 answers, 2 of them late, gave 0.0625 instead of 0.167; a user's pass, 2026-12-06).

    Units and bases: ``p50_ms``/``p90_ms``/``p99_ms``/``mean_ms`` are submit → answer wall-clock ms over answers
    without a backend error (None before the first); ``queue_p99_ms`` submit → batch start, ms; ``elapsed_s`` first
    submit → last answer, s; ``goodput_per_s`` answers within budget and ``throughput_per_s`` all answers (errors
    included) per ``elapsed_s``; ``rejection_rate`` = all rejections ("deadline" and "shutdown" included) / submitted.
    """

    def __init__(self, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._lat: collections.deque[float] = collections.deque(maxlen=window)
        self._queue: collections.deque[float] = collections.deque(maxlen=window)
        self._batch: collections.deque[int] = collections.deque(maxlen=window)
        self.submitted = 0
        self.answered = 0
        self.errors = 0
        self.within = 0
        self.late = 0
        self.cancelled = 0  # futures their callers cancelled while queued: never run, never answered
        self.rejected: collections.Counter[str] = collections.Counter()
        self.cascaded: collections.Counter[str] = collections.Counter()
        self._t0: float | None = None
        self._t_last: float | None = None

    def on_submit(self) -> None:
        with self._lock:
            self.submitted += 1
            now = time.perf_counter()
            if self._t0 is None:
                self._t0 = now

    def on_cascade(self, variant: str) -> None:
        with self._lock:
            self.cascaded[variant] += 1

    def on_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def on_answer(self, r: Result | Rejected) -> None:
        with self._lock:
            self._t_last = time.perf_counter()
            if isinstance(r, Rejected):
                self.rejected[r.reason] += 1
                return
            self.answered += 1
            if r.error is not None:
                self.errors += 1
                return
            self._lat.append(r.latency_ms)
            self._queue.append(r.queue_ms)
            self._batch.append(r.batch_size)
            if r.within_budget:
                self.within += 1
            else:
                self.late += 1

    def snapshot(self) -> dict[str, Any]:
        """A dict of the current figures (see the class docstring); percentiles are None before any answer."""
        with self._lock:
            lat = np.fromiter(self._lat, dtype=np.float64)
            q = np.fromiter(self._queue, dtype=np.float64)
            bs = np.fromiter(self._batch, dtype=np.float64)
            rejected = dict(self.rejected)
            n_rej = sum(rejected.values())
            deadline = rejected.get("deadline", 0)
            admitted = self.submitted - (n_rej - deadline)  # "shutdown" is no promise broken: not admitted
            end = self._t_last if self._t_last is not None else time.perf_counter()
            elapsed = (end - self._t0) if self._t0 is not None else 0.0
            missed = self.late + self.errors + deadline
            at_admission = {k: v for k, v in rejected.items() if k != "deadline"}
            pct = (lambda a, p: round(float(np.percentile(a, p)), 3) if a.size else None)
            return {
                "submitted": self.submitted, "admitted": admitted, "answered": self.answered, "errors": self.errors,
                "within_budget": self.within, "budget_missed": missed, "answered_late": self.late,
                "dropped_at_deadline": deadline, "rejected": rejected, "rejected_at_admission": at_admission,
                "in_flight": self.submitted - self.answered - n_rej - self.cancelled, "cancelled": self.cancelled,
                "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99),
                "mean_ms": round(float(lat.mean()), 3) if lat.size else None,
                "queue_p99_ms": pct(q, 99),
                "mean_batch_size": round(float(bs.mean()), 3) if bs.size else None,
                "goodput_per_s": round(self.within / elapsed, 3) if elapsed > 0 else 0.0,
                "throughput_per_s": round(self.answered / elapsed, 3) if elapsed > 0 else 0.0,
                "rejection_rate": round(n_rej / self.submitted, 5) if self.submitted else 0.0,
                "budget_miss_rate": (round(missed / (admitted - self.cancelled), 5)
                                     if admitted - self.cancelled > 0 else 0.0),
                "elapsed_s": round(elapsed, 3), "cascaded": dict(self.cascaded),
            }

    def register_prometheus(self, registry: Any = None, prefix: str = "dsedge") -> Any:
        """Expose the snapshot to Prometheus through a custom collector read at scrape time.

        Needs ``prometheus-client`` (extra ``serve``). Returns the collector. Raises BackendUnavailable when the
        package is missing, and prometheus-client's ValueError when ``registry`` already holds these names (any
        registry: the collector describes itself).
        """
        try:
            from prometheus_client import REGISTRY
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError:
            from .errors import BackendUnavailable

            raise BackendUnavailable("prometheus-client is not installed",
                                     "pip install 'dsedge[serve]' (prometheus-client>=0.17)") from None
        metrics = self

        class _Collector:
            def describe(self) -> list[Any]:  # lets every registry refuse a second collector with these names
                return list(self.collect())

            def collect(self) -> Iterator[Any]:
                s = metrics.snapshot()
                for key in ("submitted", "answered", "errors", "within_budget", "budget_missed", "answered_late",
                            "dropped_at_deadline"):
                    yield CounterMetricFamily(f"{prefix}_requests_{key}", f"requests {key.replace('_', ' ')}",
                                              value=s[key])
                rej = CounterMetricFamily(f"{prefix}_requests_rejected", "requests rejected, by reason",
                                          labels=["reason"])
                for reason, n in sorted(s["rejected"].items()):
                    rej.add_metric([reason], n)
                yield rej
                lat = GaugeMetricFamily(f"{prefix}_latency_ms", "answer latency percentile over the window, ms",
                                        labels=["quantile"])
                for q in ("p50", "p90", "p99"):
                    if s[f"{q}_ms"] is not None:
                        lat.add_metric([q], s[f"{q}_ms"])
                yield lat
                yield GaugeMetricFamily(f"{prefix}_goodput_per_second", "answers within budget per second",
                                        value=s["goodput_per_s"])
                yield GaugeMetricFamily(f"{prefix}_in_flight", "requests admitted and not yet answered",
                                        value=s["in_flight"])

        collector = _Collector()
        (registry if registry is not None else REGISTRY).register(collector)
        return collector
