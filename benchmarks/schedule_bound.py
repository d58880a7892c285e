"""What a scheduler that knew every service time exactly could answer within budget, on the same arrival schedule.

The streaming benchmarks judge dsedge by shares of offered requests answered within budget. Some of those shares
are out of reach of any scheduler: one backend serves one batch at a time, a batch of ``b`` rows takes ``t(b)`` ms,
and a burst that arrives while a batch runs can only wait. This module replays a schedule through a noise-free
server with exact knowledge of ``t(b)`` (the batch p50s measured in the same run), so a measured figure can be read
against what the arrival process allows:

* admission control: a request is admitted iff, playing the admitted queue forward with the worker's batching (no
  later arrivals), it and every request admitted before it still finish within budget; otherwise it is rejected at
  once (rejecting it cannot hurt anyone, admitting it might);
* batching: when the backend frees, the queue's head and the requests after it, in arrival order, form the largest
  batch whose completion meets the head's deadline (every budget is the same, so the head's is the earliest).

Served one request at a time (``max_batch=1``) with one budget for all, arrival order is deadline order (agreeable
release and due dates), and this admission rule maximises the number of requests answered on time: the problem
``1 | r_j, p_j = p | Σ U_j`` with agreeable deadlines, solvable exactly (Kise, Ibaraki & Mine, *Operations Research*
26(1), 1978); tests/test_schedule_bound.py checks it against exhaustive search on small instances. With batching
it is a reference, not a proof: an omniscient scheduler might hold a batch open for arrivals it knows are coming,
or keep a batch small so that the next one starts sooner. Under overload that matters: this server starts a batch
with whatever is queued the moment the backend frees, and dsedge, which holds a batch open while arrivals outpace
it, answered more within budget than this row at 3× load with an 8× p50 budget. Read it below capacity. Holding (Triton-style: dispatch at P queued or after D ms) was tried on the benchmark's schedules and
never beat dispatching at once.

``servers=c`` replays the same rules on ``c`` identical backends sharing one queue (an instance group such as
dsedge's default two 1-thread instances on two cores; give the batch times measured with all ``c`` running side by
side, which is slower per backend than alone): the backend that frees first takes the next batch, and admission
plays the queue forward over every backend's free time. With one request at a time and one budget this is still
the order-preserving, earliest-free rule that the ``P | r_j, p_j = p | Σ U_j`` problem's list schedules use; it is
not proved optimal for ``c > 1``, so read it as what exact knowledge reaches with this layout, not a bound.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence


def service_ms(t_ms: Mapping[int, float], rows: int) -> float:
    """``t(rows)``, ms: measured batch sizes as given, linear between them, the last slope extended beyond."""
    sizes = sorted(t_ms)
    if rows in t_ms:
        return float(t_ms[rows])
    lo = max((b for b in sizes if b < rows), default=sizes[0])
    hi = min((b for b in sizes if b > rows), default=None)
    if hi is None:
        if len(sizes) == 1:
            return float(t_ms[lo]) * rows / lo
        a, b = sizes[-2], sizes[-1]
        return float(t_ms[b]) + (rows - b) * (t_ms[b] - t_ms[a]) / (b - a)
    return float(t_ms[lo]) + (rows - lo) * (t_ms[hi] - t_ms[lo]) / (hi - lo)


def _batch(queue: Sequence[float], start: float, budget_ms: float, t_ms: Mapping[int, float], max_batch: int) -> int:
    # rows of the batch started at ``start`` from ``queue`` (arrival times, ms, oldest first): the largest prefix
    # whose completion meets the head's deadline (at least the head)
    k = 1
    while k < min(len(queue), max_batch) and start + service_ms(t_ms, k + 1) <= queue[0] + budget_ms:
        k += 1
    return k


def _fits(queue: Sequence[float], free_at: Sequence[float], budget_ms: float, t_ms: Mapping[int, float],
          max_batch: int) -> bool:
    # does every request of ``queue`` finish within budget if served by backends free from ``free_at`` (one time
    # per backend), the first to free taking the next batch, with nothing arriving later?
    free, left = list(free_at), list(queue)
    while left:
        i = min(range(len(free)), key=free.__getitem__)
        t = max(free[i], left[0])
        k = _batch(left, t, budget_ms, t_ms, max_batch)
        free[i] = t + service_ms(t_ms, k)
        if any(free[i] > a + budget_ms for a in left[:k]):
            return False
        left = left[k:]
    return True


def exact_knowledge(arrivals_ms: Sequence[float], budget_ms: float, t_ms: Mapping[int, float],
                    max_batch: int = 32, servers: int = 1) -> dict:
    """Replay ``arrivals_ms`` (one-row requests, ms, ascending) through the exact-knowledge server above.

    Args:
        arrivals_ms: arrival times, ms.
        budget_ms: every request's latency budget, ms.
        t_ms: service ms per batch size (at least batch 1) of one backend, e.g. the run's measured batch p50s.
        max_batch: most rows per batch.
        servers: identical backends sharing the queue (see the module doc).
    Returns:
        ``{"offered", "within_budget", "rejected", "in_budget_of_offered", "goodput_per_s"}`` (goodput over the
        arrival window, like the benchmarks).
    Raises:
        ValueError: ``t_ms`` has no batch size 1, a budget under ``t(1)`` (nothing could ever be answered), or
            ``servers`` < 1.
    """
    if 1 not in t_ms:
        raise ValueError("t_ms needs the batch-1 service time")
    if budget_ms < t_ms[1]:
        raise ValueError(f"budget {budget_ms} ms is under the batch-1 time {t_ms[1]} ms")
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    queue: list[float] = []
    free = [0.0] * int(servers)
    within, rejected = 0, 0

    def dispatch_until(now: float) -> None:
        # run every batch that starts no later than ``now`` (only requests already queued can join it), each on
        # the backend that frees first
        nonlocal within, queue
        while queue:
            i = min(range(len(free)), key=free.__getitem__)
            start = max(free[i], queue[0])
            if start > now:
                return
            ready = [a for a in queue if a <= start]
            k = _batch(ready, start, budget_ms, t_ms, max_batch)
            free[i] = start + service_ms(t_ms, k)
            within += sum(1 for a in ready[:k] if free[i] <= a + budget_ms)
            queue = queue[k:]

    for a in arrivals_ms:
        dispatch_until(a)
        if _fits(queue + [a], [max(f, a) for f in free], budget_ms, t_ms, max_batch):
            queue.append(a)
        else:
            rejected += 1
    dispatch_until(math.inf)
    n = len(arrivals_ms)
    window_s = max((arrivals_ms[-1] if n else 0.0) / 1e3, 1e-9)
    return {"offered": n, "within_budget": within, "rejected": rejected,
            "in_budget_of_offered": round(within / n, 4) if n else None,
            "goodput_per_s": round(within / window_s, 1)}


def equivalent_service_ms(arrivals_ms: Sequence[float], budget_ms: float, t_ms: Mapping[int, float],
                          goodput_per_s: float, max_batch: int = 32, servers: int = 1, rel_tol: float = 0.005
                          ) -> float | None:
    """The batch-1 time, ms, at which the exact-knowledge server answers ``goodput_per_s`` within budget on this
    schedule, with every batch time of ``t_ms`` scaled by one factor: a served figure read as the service time that
    would explain it with no noise, no overhead and no wrong guess. Set beside the measured ``t_ms[1]``, the ratio
    is what noise, overhead and the server's guessing cost it, in units of service time, on any host.

    Args:
        arrivals_ms, budget_ms, t_ms, max_batch, servers: as ``exact_knowledge``.
        goodput_per_s: the measured server's answers within budget per second on the same schedule.
        rel_tol: the bisection stops once the factor is known to this relative width.
    Returns:
        ms, or None when no scale between 0.25x and the budget's own limit (``budget_ms / t_ms[1]``) gives it:
        the server answered more than exact knowledge at a quarter of the time, or fewer than at the budget.
    Raises:
        ValueError: as ``exact_knowledge``.
    """
    t1 = float(t_ms[1]) if 1 in t_ms else math.nan
    if not math.isfinite(t1) or t1 <= 0:
        raise ValueError("t_ms needs a positive batch-1 service time")

    def goodput(k: float) -> float:
        return exact_knowledge(arrivals_ms, budget_ms, {b: k * v for b, v in t_ms.items()}, max_batch,
                               servers)["goodput_per_s"]

    # exact knowledge's goodput falls as the factor grows; at the top, batch 1 takes the whole budget (a hair under:
    # budget / t1 * t1 can round above the budget, which exact_knowledge refuses)
    lo, hi = 0.25, budget_ms / t1 * (1 - 1e-9)
    if goodput(lo) < goodput_per_s or goodput(hi) > goodput_per_s:
        return None
    while hi - lo > rel_tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if goodput(mid) >= goodput_per_s else (lo, mid)
    return round((lo + hi) / 2 * t1, 2)


if __name__ == "__main__":
    import sys

    sys.exit("schedule_bound.py is the module benchmarks/streaming.py imports for its exact-knowledge rows; run "
             "python benchmarks/streaming.py --bundle BUNDLE")
