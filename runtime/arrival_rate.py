"""The recent arrival rate of a scheduler's requests, rows/s, over a sliding window.

Admission uses it for one decision only: whether arrivals exceed what the variant's instances serve at batch 1
(``rows/s × alone ms per row / 1000 / instances > 1``). While they do and a plan behind other batches has no
calibration yet (fewer scores than ``PlanCalibration.min_scores`` in its stratum), it is planned at the
scheduler's ``overload_cold_z`` instead of the profile's own tail (runtime/scheduler.py has the measurement).
The rate is read from arrivals, never from outcomes: refusals cannot feed it, so it cannot lock.

The estimate is ``(n − 1) / span`` over the arrivals of the last ``window_s`` (a sliding-window rate, as a
token-bucket meter reads one), and None until ``min_count`` arrivals span at least ``min_span_s``: a server's first
requests are counted within tens of milliseconds at a high rate, and a few close arrivals at a low rate are not
read as a flood.
"""
from __future__ import annotations

import collections
import threading


class ArrivalRate:
    """Rows per second over the last ``window_s`` seconds of ``add`` calls.

    Args:
        window_s: how far back arrivals count, s.
        min_span_s: the shortest span of arrivals read as a rate, s.
        min_count: the fewest arrivals read as a rate.
    """

    def __init__(self, window_s: float = 0.25, min_span_s: float = 0.02, min_count: int = 10) -> None:
        self.window_s, self.min_span_s, self.min_count = float(window_s), float(min_span_s), int(min_count)
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self._rows = 0
        self._lock = threading.Lock()

    def add(self, now: float, rows: int = 1) -> None:
        """One request of ``rows`` rows arrived at ``now`` (``time.perf_counter()`` s). Submitting threads read
        the clock before this lock, so an arrival may come in a little older than the last: it is stored at the
        last one's time, which keeps the window ordered (what ages out first is at its head)."""
        with self._lock:
            if self._arrivals and not now >= self._arrivals[-1][0]:  # older, or NaN
                now = self._arrivals[-1][0]
            self._arrivals.append((now, rows))
            self._rows += rows
            old = now - self.window_s
            while self._arrivals[0][0] < old:
                self._rows -= self._arrivals.popleft()[1]

    def rows_per_s(self, now: float) -> float | None:
        """The rate at ``now``, rows/s; None while too few arrivals (or too short a span) are in the window."""
        with self._lock:
            while self._arrivals and self._arrivals[0][0] < now - self.window_s:
                self._rows -= self._arrivals.popleft()[1]
            n = len(self._arrivals)
            if n < self.min_count:
                return None
            span = now - self._arrivals[0][0]
            if not span >= self.min_span_s or span <= 0.0:  # too short (or NaN): not a rate yet
                return None
            return (self._rows - self._arrivals[0][1]) / span
