"""Spare instances step aside while the front end is busy.

``dsedge serve`` runs each model's variant on several instances (on 2 cores: two 1-thread instances, and a 2-thread
fallback lane). The front end is one Python event loop (plus gRPC's poller thread) that costs 0.6–1 ms of CPU per
call (docs/triton.md). At light load the instances can have every core; under load, calls' budgets run out in
gRPC's queue while the loop waits behind the batches. ``SpareGovernor`` runs on that loop and measures the loop
thread's own CPU share every ``interval_s`` (``time.thread_time``: the batch workers' and ONNX Runtime's pool
threads are not in it; gRPC's poller thread, a few % of it, is left out), and while it is above ``pause_above``
(cores) it
pauses every model's spare lanes (``Session.pause_spare_instances``: every instance but the first, and the
fallback); they resume once it falls under ``resume_below``. The share rises at once and decays over a few
intervals, so a burst pauses the spares quickly and a lull does not flip them back and forth.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable

log = logging.getLogger("dsedge.serve")


class SpareGovernor:
    def __init__(self, sessions: Callable[[], Iterable[Any]], pause_above: float = 0.3, resume_below: float = 0.15,
                 interval_s: float = 0.1, decay: float = 0.3) -> None:
        self._sessions = sessions
        self.pause_above = float(pause_above)
        self.resume_below = min(float(resume_below), self.pause_above)
        self.interval_s = float(interval_s)
        self.decay = float(decay)
        self.share = 0.0  # the front end's CPU, in cores (smoothed)
        self.paused = False
        self.pauses = 0

    def step(self, front_cores: float) -> bool:
        """Feed one interval's front-end CPU share (cores); returns whether the spares are paused now."""
        self.share = front_cores if front_cores > self.share else self.share + self.decay * (front_cores - self.share)
        if not self.paused and self.share > self.pause_above:
            self.paused, self.pauses = True, self.pauses + 1
            self._apply()
        elif self.paused and self.share < self.resume_below:
            self.paused = False
            self._apply()
        return self.paused

    def _apply(self) -> None:
        for s in self._sessions():
            s.pause_spare_instances(self.paused)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("spare instances " + ("paused" if self.paused else "resumed"),
                      extra={"fields": {"front_end_cores": round(self.share, 3)}})

    async def run(self) -> None:
        """Measure and step every ``interval_s``, forever; run it as a task on the front end's event loop."""
        t, cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(self.interval_s)
            t1, cpu1 = time.perf_counter(), time.thread_time()
            self.step((cpu1 - cpu) / max(t1 - t, 1e-6))
            t, cpu = t1, cpu1
