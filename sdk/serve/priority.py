"""Triton's request priority in front of dsedge's EDF scheduler.

Triton numbers priority levels 1…N, 1 being the highest, and 0 means the model's default level; its dynamic batcher
keeps one queue per level and always serves a higher level first. dsedge's scheduler orders by deadline and uses its
own ``priority`` (higher wins) only to break ties between deadlines within ``tie_ms`` of each other, so a Triton
priority passed straight through would almost never change the order. The server therefore does both:

* ``PriorityGate``: at most ``max_inflight`` requests of a model are inside its session at once; the rest wait in
  a bounded queue served strictly by Triton level, then arrival (Triton's priority queues). A waiting request whose
  deadline passes is rejected ("deadline"); a full queue rejects at once ("overload").
* ``PriorityLevels.dsedge_priority``: the level mapped onto dsedge's priority (level 1 → N-1 … level N → 0), so
  among requests inside the session with equal deadlines the Triton order holds too.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools

from .protocol import ServeError, invalid, rejection


class PriorityLevels:
    """Triton priority levels 1 (highest) … ``levels``; 0 (or absent) is ``default`` (the model default)."""

    def __init__(self, levels: int = 3, default: int = 2) -> None:
        if levels < 1 or not 1 <= default <= levels:
            raise ValueError(f"priority levels {levels} with default {default}: need 1 <= default <= levels")
        self.levels = int(levels)
        self.default = int(default)

    def level(self, priority: object) -> int:
        """The Triton level of a request's ``priority`` parameter. Raises ServeError(400) outside 0…levels."""
        if priority is None:
            return self.default
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= self.levels:
            raise invalid(f"parameter 'priority' must be an integer in 0..{self.levels} "
                          f"(1 = highest, 0 = default {self.default}), got {priority!r}")
        return self.default if priority == 0 else int(priority)

    def dsedge_priority(self, level: int) -> int:
        """dsedge's priority (higher wins) for a Triton level (1 wins): ``levels - level``."""
        return self.levels - level


class PriorityGate:
    """Bounded concurrency per model with Triton-ordered waiting (asyncio; one event loop).

    Args:
        max_inflight: requests allowed inside the session at once.
        max_queue: requests allowed to wait; one more is rejected with "overload" (HTTP 429).
    """

    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max(1, int(max_inflight))
        self.max_queue = max(0, int(max_queue))
        self.inflight = 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._closed = False
        self.waiting = 0  # live waiters (the heap may still hold cancelled ones until they surface)

    async def enter(self, level: int, timeout_s: float) -> bool:
        """Wait for a slot (level order); True if it had to wait. Raises ServeError "overload" (queue full), "deadline" (``timeout_s``
        passed while waiting) or "shutdown" (closing)."""
        if self._closed:
            raise rejection("shutdown", "the server is shutting down")
        if self.inflight < self.max_inflight and not self.waiting:
            self.inflight += 1
            return False
        if self.waiting >= self.max_queue:
            raise rejection("overload", f"{self.inflight} requests running and {self.waiting} queued "
                                        f"(--max-inflight {self.max_inflight}, --max-queue {self.max_queue})")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (level, next(self._order), fut))
        self.waiting += 1
        try:
            await asyncio.wait_for(fut, timeout=max(timeout_s, 0.0))
        except asyncio.CancelledError:  # the caller went away: pass on a slot it may have been handed
            if fut.cancelled():
                self.waiting -= 1
            elif fut.exception() is None:
                self.leave()
            raise
        except asyncio.TimeoutError:
            self.waiting -= 1
            raise rejection("deadline", f"budget of {timeout_s * 1e3:.1f} ms ran out while waiting for one of "
                                        f"{self.max_inflight} slots") from None
        return True  # fut carried the slot over from leave() (close() sets an error instead)

    def leave(self) -> None:
        """Release a slot: hand it to the highest-level waiter, if any."""
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)  # the slot passes to it; inflight stays the same
                self.waiting -= 1
                return
        self.inflight -= 1

    def close(self) -> None:
        """Reject every waiter with "shutdown"; later ``enter`` calls are rejected too."""
        self._closed = True
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_exception(rejection("shutdown", "the server is shutting down"))
                self.waiting -= 1


__all__ = ["PriorityGate", "PriorityLevels", "ServeError"]
