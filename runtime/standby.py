"""Standby: requests refused for overload wait, unadmitted, for an instance that frees up in time.

Admission plans a request behind the batches already running and queued (runtime/scheduler.py), and behind a
running batch its plan must cover that batch's remaining time *and* its noise: on a shared 2-core host (MiniLM
int8, two 1-thread instances, b1 p50 6.2 ms and p98 about 9 ms, budget 13.5 ms, 3× the batch-1 capacity) a
request was admitted behind a running batch only in the last ~1 ms before that batch's expected end. Half the
batches then ended with nothing queued, and each instance idled 15–25 % of a 10 s window of overload while
arrivals every 1.5 ms on average were refused.

A refused request whose plan failed only for what runs ahead of it (it fits alone on an idle instance) goes on
its variant's standby list instead of being answered ``Rejected("overload")`` at once. An instance whose queue
is empty when its batch ends takes from the list, before waiting for new arrivals, the batch of the most recent
entries that meets every member's deadline planned on the idle instance (the profile's tail: stratum 0 of
runtime/plan_calibration.py). The request is admitted then, with what it has left of its budget. Entries whose
deadline no idle instance could meet any more expire: they are answered ``Rejected("overload")`` then (their
``latency_ms`` says how long they waited), by the list's expiry thread (``on_expire``), which wakes ``grace_ms``
after the earliest last start (at most half the time from it to the entry's deadline), or at a batch end of their
variant if that comes first: a refusal reaches its caller before the deadline even when nothing is submitted and
every instance runs a long batch. Before the thread, expiries waited for the next submit or batch end: at 1.5×
the batch-1 capacity (MiniLM int8, 2 × 1-thread instances, 40 ms budget, bursty open-loop arrivals, 10 s) 42 of
738 refusals reached their callers after the budget had passed, the latest 65 ms after its submit. Nothing on the
list was ever admitted: an expiry is a refusal, not a budget miss.

Under a flood (arrivals above what the variant's instances serve at batch 1: runtime/arrival_rate.py), an instance
whose batch would be held open for more arrivals takes its batch-mates from the list first, by the same rule: the
most recent entries that still meet every member's deadline in that batch. Traced at 1.5× the batch-1 capacity
before that (MiniLM int8, 2 × 1-thread instances, 36 ms budget), an instance held a 1-row batch open for 5.5 ms
while four entries that fit it waited here and then expired.

Most recent first (last in, first out) among the entries that can still make it: under overload the freshest
request has the most slack, so it is the least likely to miss, and the older ones would expire soon anyway
(adaptive LIFO under overload: Maurer, "Fail at Scale", ACM Queue 13(8), 2015; deadline-aware load shedding as
in Clipper, Crankshaw et al., NSDI 2017). Higher ``priority`` first. Thread-safe; the list holds at most
``capacity`` entries (the oldest expires first when full).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

_clock = time.perf_counter


class Standby:
    """One variant's standby list (its instances share it).

    Args:
        capacity: most requests waiting; adding one more rejects the entry with the earliest last start.
        on_expire: called with the expired ``(request, detail)`` pairs from the list's expiry thread (started at
            the first ``add``; None: no thread, expiries are found by ``sweep``/``take`` only).
        grace_ms: the expiry thread sweeps this long after the earliest last start (never later than half-way
            from it to that entry's ``deadline``), so that one wake-up finds the entries expiring together, ms.
    """

    def __init__(self, capacity: int = 1024, on_expire: Callable[[Sequence[tuple[Any, str]]], None] | None = None,
                 grace_ms: float = 1.0) -> None:
        self.capacity = max(1, int(capacity))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._items: list[tuple[float, Any, str]] = []  # (last start s, request, refusal detail)
        self.taken = 0
        self.expired = 0
        self.on_expire = on_expire
        self.grace_s = max(float(grace_ms), 0.0) / 1e3
        self._timer: threading.Thread | None = None
        self._wake_at = float("inf")  # when the expiry thread wakes next (inf: when an entry comes)
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def add(self, req: Any, last_start: float, detail: str) -> list[tuple[Any, str]]:
        """Put ``req`` on the list until ``last_start`` (``time.perf_counter()`` s: the latest time an idle
        instance could start it and still meet its deadline); returns the entries pushed out by capacity, as
        ``(request, detail)``, for the caller to reject."""
        with self._lock:
            if self.on_expire is not None and not self._closed:
                if self._timer is None:
                    self._timer = threading.Thread(target=self._expire_loop, name="dsedge-standby-expiry",
                                                   daemon=True)
                    self._timer.start()
                elif last_start < self._wake_at:
                    self._cond.notify()  # the timer waits for nothing, or for a later entry
            self._items.append((last_start, req, detail))
            out = []
            if len(self._items) > self.capacity:
                self._items.sort(key=lambda it: it[0])
                out = [(r, d) for _, r, d in self._items[:len(self._items) - self.capacity]]
                del self._items[:len(self._items) - self.capacity]
                self.expired += len(out)
            return out

    def sweep(self, now: float) -> list[tuple[Any, str]]:
        """Remove and return the entries past their last start, as ``(request, detail)``."""
        with self._lock:
            if not self._items or min(it[0] for it in self._items) >= now:
                return []
            out = [(r, d) for t, r, d in self._items if t < now]
            self._items = [it for it in self._items if it[0] >= now]
            self.expired += len(out)
            return out

    def take(self, now: float, pick: Callable[[list[Any]], tuple[list[Any], list[Any]]]
             ) -> tuple[list[Any], list[tuple[Any, str]]]:
        """The batch an idle instance runs now, and the entries that expired, as ``(request, detail)``.

        ``pick`` gets the live entries, most recent first (higher priority first), and returns ``(run, dead)``:
        those the instance runs now and those no idle instance can start in time any more (they expire now)."""
        expired = self.sweep(now)
        with self._lock:
            if not self._items:
                return [], expired
            order = sorted(self._items, key=lambda it: (-it[1].priority, -it[1].deadline))
            chosen, dead = pick([r for _, r, _ in order])
            if chosen or dead:
                dead_ids = set(map(id, dead))
                gone = dead_ids | set(map(id, chosen))
                expired += [(r, d) for _, r, d in self._items if id(r) in dead_ids]
                self._items = [it for it in self._items if id(it[1]) not in gone]
                self.taken += len(chosen)
                self.expired += len(dead)
            return chosen, expired

    def drain(self) -> list[tuple[Any, str]]:
        """Remove and return every entry (the session is closing)."""
        with self._lock:
            out = [(r, d) for _, r, d in self._items]
            self._items = []
            return out

    def close(self) -> None:
        """Stop the expiry thread (what is still listed stays: ``drain`` it); waits for it, as a session's close
        waits for its lanes, so that the refusals it was answering (a done-callback may hold it) are answered."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()

    def _due(self) -> float:
        # under self._lock, items present: when the timer sweeps next (s)
        last, req, _ = min(self._items, key=lambda it: it[0])
        room = getattr(req, "deadline", last) - last
        return last + min(self.grace_s, 0.5 * max(room, 0.0))

    def _expire_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    self._wake_at = self._due() if self._items else float("inf")
                    wait = self._wake_at - _clock()
                    if wait <= 0:
                        break
                    self._cond.wait(wait if self._items else None)
            gone = self.sweep(_clock())
            if gone and self.on_expire is not None:
                try:
                    self.on_expire(gone)
                except BaseException:  # the answers' callbacks are the callers' (even a SystemExit): keep running
                    pass
