"""The submitting thread's CPU use, now against what the latency profile saw: a factor on admission plans.

The streaming lanes' backends run on the same cores as the threads that call ``submit`` (a user's loop, a
server's event loop). On ONNX Runtime's CPU provider with the lanes laid over every core (two pinned 1-thread
instances on 2 cores, or one backend with a thread per core), a caller that keeps a core busy takes it from a
batch: measured on a 2-core host (MiniLM int8, two 1-thread instances), 200 ``submit`` calls in a tight loop right
after ``warmup()`` kept one core busy for 73–90 ms, a batch of 8 ran 48.7 ms where the profile had just measured
19.9, and of the 40–58 requests each such loop had admitted (30 ms budget), 2–9 were answered in budget.

The profile (runtime/latency_profile.py) learns service times over its horizon (1 s), so it already holds the
caller's average use; what it cannot know is a change within that horizon. ``CallerLoad`` tracks, per calling
thread, its CPU share between consecutive ``submit`` calls (``time.thread_time`` over wall time: a thread that
sleeps or blocks between calls scores low, a tight loop 1), smoothed twice: over ``fast_s`` (now) and over
``slow_s`` (what the profile's samples met). Plans are scaled by ``(1 + weight·now) / (1 + weight·avg)``, clipped to
``[1, cap]``: a core's worth of new caller work doubles the plan of a batch that may share its core (``weight`` 1:
the lanes cover every core; 0 where they leave the caller a core, or do not run on the CPU). The factor only ever
makes a plan longer, and only while the caller works more than it did over the profile's horizon.

Measured on a 2-core host (MiniLM int8, two 1-thread instances; interleaved A/B, without → with):
- 200 ``submit`` calls in a tight loop after ``warmup()``, 30 ms budget, 9 loops per arm: in budget of admitted
  172 of 379 (45 %) → 195 of 300 (65 %). Not solved: the first batches are formed before the factor has risen
  (``fast_s``), start late (the worker waits for the interpreter lock the loop holds) and run 2–3× their profile;
- ``dsedge serve`` at 3× the batch-1 capacity (50 ms budget, cold 8 s windows, the client on the same host; here
  the caller is the server's event loop), 6 pairs: in budget of admitted by the client's clock 96.2 → 97.5 % on
  average, higher in 5 of 6 pairs; at 1.5×, 3 pairs: 99.36 → 99.63 %, goodput per offered request −11, 0, −1.5 %;
- in process, benchmarks/streaming.py's arrivals at 3× (13.5 ms budget, cold 10 s windows), 6 pairs: in budget of
  admitted 99.43 → 99.32 %, goodput 301.9 → 293.3/s (both within the windows' spread);
- ``weight`` 0.5 (a caller on one of two instances' cores, averaged) moved neither serve nor in-process figures
  (4 pairs): the factor is for the batch that does share the caller's core.

Exponentially weighted moving averages over irregular intervals (the weight of an interval of ``dt`` is
``1 − exp(−dt/τ)``; e.g. Eckner, *Algorithms for unevenly spaced time series*, 2019).
"""
from __future__ import annotations

import math
import threading
import time

_clock = time.perf_counter


class CallerLoad:
    """Per calling thread, its CPU share now and over the profile's horizon; ``factor()`` on each submit.

    Args:
        weight: how much a core of caller work slows a batch (1: the lanes cover every core; 0: off).
        fast_s: time constant of "now", s.
        slow_s: time constant of the baseline, s (the latency profile's horizon).
        cap: the largest factor.
    """

    def __init__(self, weight: float = 1.0, fast_s: float = 0.005, slow_s: float = 1.0, cap: float = 3.0) -> None:
        self.weight = float(weight)
        self.fast_s = float(fast_s)
        self.slow_s = float(slow_s)
        self.cap = float(cap)
        self._local = threading.local()

    def factor(self) -> float:
        """The plan factor for a request submitted now on this thread (≥ 1; 1 with ``weight`` 0)."""
        if self.weight <= 0.0:
            return 1.0
        st = self._local
        wall, cpu = _clock(), time.thread_time()
        last = getattr(st, "last", None)
        st.last = (wall, cpu)
        if last is None:
            st.now = st.avg = 0.0
            return 1.0
        dt = wall - last[0]
        if dt > 0.0:
            share = min(max((cpu - last[1]) / dt, 0.0), 1.0)
            st.now += (1.0 - math.exp(-dt / self.fast_s)) * (share - st.now)
            st.avg += (1.0 - math.exp(-dt / self.slow_s)) * (share - st.avg)
        f = (1.0 + self.weight * st.now) / (1.0 + self.weight * st.avg)
        return min(max(f, 1.0), self.cap)
