"""The cores a variant's instances share with its fallback backend: one runs at a time, never both.

On a CPU, ``dsedge.load`` opens a variant as several instances of a few intra-op threads each (Triton's instance
group: two 1-thread ORT sessions on 2 cores) plus a fallback backend with all of their threads, which takes the
requests the instances are too slow for even alone (runtime/scheduler.py). Run side by side, the fallback's threads
and the instances' threads oversubscribe the cores: every run in flight slows, the instances' measured service times
rise, their tail estimate passes the budget, the next requests go to the fallback too, and the lane stays there.
Measured on a 2-core host (MiniLM int8, two 1-thread instances, 2-thread fallback, open-loop bursty load at 1.5×
the batch-1 capacity, 12.2 ms budget, the same 10 s schedule run 4 times): in one run the fallback served 591
requests while the instances refused everything as "predicted 13.9 ms alone" (their p50 is 5.5 ms), goodput 170/s;
in the other three the fallback ran once and goodput was 229–241/s.

A readers–writer lock over the cores: instance batches hold it shared (they run side by side, as designed), a
fallback batch holds it exclusively; a waiting fallback batch keeps new instance batches from starting, so it waits
at most for the batches already running (writer preference, Courtois, Heymans & Parnas, CACM 14(10), 1971). Service
times are measured after the lock is taken, so the profiles hold run times, not waits; admission plans a request on
either side behind the other side's running batch (``Lane.plan``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class CoreShare:
    """Instance batches run together (``shared``), a fallback batch alone (``exclusive``). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0  # instance batches on the cores now
        self._exclusive = False  # a fallback batch on the cores now
        self._waiting = 0  # fallback batches waiting for the instances' batches to end

    @contextlib.contextmanager
    def shared(self, wait: bool = True) -> Iterator[bool]:
        """Around an instance's batch: waits while a fallback batch runs or waits; yields True once the cores are
        held. ``wait=False`` is for a run nobody waits for (a re-measuring probe): it yields False at once, holding
        nothing, when a fallback batch runs or waits, and never counts as waiting itself (a probe queued for the
        cores would hold the other side's real batches back, writer preference, for a whole run)."""
        with self._cond:
            got = wait or not (self._exclusive or self._waiting)
            while got and (self._exclusive or self._waiting):
                self._cond.wait()
            if got:
                self._shared += 1
        try:
            yield got
        finally:
            if got:
                with self._cond:
                    self._shared -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True) -> Iterator[bool]:
        """Around a fallback batch: waits until no instance batch runs (none starts meanwhile); yields True once
        the cores are held. ``wait=False``: False at once, holding nothing, while an instance batch runs."""
        with self._cond:
            got = wait or not (self._exclusive or self._shared)
            if wait:
                self._waiting += 1
                try:
                    while self._exclusive or self._shared:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
                    self._cond.notify_all()  # instance batches held back by this wait may go if it ended by an error
            if got:
                self._exclusive = True
        try:
            yield got
        finally:
            if got:
                with self._cond:
                    self._exclusive = False
                    self._cond.notify_all()
