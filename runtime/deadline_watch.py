"""Answer a queued request at its deadline, not after the batch that kept it waiting.

A lane's worker drops a queued request that can no longer make its deadline (``Rejected("deadline")``, a counted
miss) when it next picks a batch. While the worker runs a batch, nothing looks: a request whose deadline passed
meanwhile was answered only at that batch's end, up to a batch later (a user's pass measured drops 32 ms past a
40 ms budget in a cold burst). The watch keeps the deadlines of the queued requests that wait behind work (a
running batch or the worker's warm-up; the lane adds a request when it queues behind one, or when the worker starts a
batch without it: ``Lane._watch``) in a heap, and one thread sleeps until the earliest: a request still queued then
is taken out of its lane's queue and answered at once, as the worker would have. One queued on an idle worker is not
added: the worker takes it at once (watching every request woke the thread at each one's deadline, long met, 46-69
µs of CPU per request taken from the batches on a 2-core host). Requests already running or answered are skipped
(lazily: their heap entries lapse at their deadlines). Thread-safe; the thread starts with the first request and ends
at ``close``.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Sequence

_clock = time.perf_counter


class DeadlineWatch:
    """The deadlines of one scheduler's queued requests.

    Args:
        grace_ms: a deadline counts as passed this long after it (one wake-up serves those due together), ms.
    """

    def __init__(self, grace_ms: float = 0.5) -> None:
        self.grace_s = grace_ms / 1e3
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Any, Sequence[Any]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.expired = 0

    def add(self, req: Any, lanes: Sequence[Any]) -> None:
        """Watch queued ``req`` (its ``deadline``, perf_counter s); ``lanes``: those whose queue may hold it (the
        variant's instances, which steal from each other). Called under a lane's lock: takes only its own."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (req.deadline, next(self._order), req, lanes))
            if self._thread is None:
                self._start()
            elif self._heap[0][2] is req:  # earlier than what the thread sleeps until
                self._cond.notify()

    def start(self) -> None:
        """Start the watching thread now (idempotent; a closed watch starts nothing)."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._start()

    def _start(self) -> None:  # under self._cond
        self._thread = threading.Thread(target=self._loop, name="dsedge-deadlines", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    left = self._heap[0][0] + self.grace_s - _clock()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                now = _clock()
                due = []
                while self._heap and self._heap[0][0] + self.grace_s <= now:
                    due.append(heapq.heappop(self._heap))
            for _, _, req, lanes in due:  # no lock of ours held: each lane takes its own
                if req.future.done():
                    continue
                for lane in lanes:
                    if lane.expire(req):
                        self.expired += 1
                        break
