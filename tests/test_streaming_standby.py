"""The standby list (runtime/standby.py): a request refused for what runs ahead of it waits, unadmitted, for an
instance that frees in time; it is admitted then, or refused ("overload") once no idle instance could meet it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dsedge
from dsedge.runtime.batching import BatchLayout
from dsedge.runtime.errors import InputError
from dsedge.runtime.latency_profile import LatencyProfile
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.results import Rejected, Result
from dsedge.runtime.scheduler import BudgetScheduler, Lane, Request
from dsedge.runtime.standby import Standby

from streaming_models import text_bundle, text_request
from test_streaming_parts import TEXT_IO, backend  # noqa: F401  (the module's tiny real ORT text model)


def _lane(backend, gate: threading.Event, seen: list, ms: float = 400.0) -> Lane:
    """A batch-1 lane predicting ``ms`` per request (no spread: plans take the 20 % floor) whose backend waits
    for ``gate`` and notes each request's first token. (The tiny model itself runs in well under a ms: the
    predictions are large so that a slow machine's delays before a submit do not change which side of a budget a
    plan falls on.)"""
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, ms, 0.0)

    def run(feed):
        gate.wait(20)
        seen.append(int(feed["input_ids"][0, 0]))
        return backend.run(feed)

    return Lane("fp32", run, prof, BatchLayout.of(*TEXT_IO), StreamMetrics(), max_batch=1, inline_ms=0.0,
                observe_warmup=False)


def _request(rng, token: int) -> dict:
    feed = text_request(rng, 8)
    feed["input_ids"][0, 0] = token
    return feed


def _blocked(backend, ms: float = 400.0):
    """A scheduler over one gated lane with a long-budget blocker on its backend (predicted to end ``ms`` after
    it started); returns (scheduler, lane, gate, seen, blocker future)."""
    gate, seen = threading.Event(), []
    lane = _lane(backend, gate, seen, ms)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)
    lane.warm.wait(10)
    blocker = sched.submit(_request(np.random.default_rng(0), 1), 600_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    return sched, lane, gate, seen, blocker


def test_a_request_refused_behind_a_running_batch_waits_and_runs_when_the_lane_frees(backend):
    sched, lane, gate, seen, blocker = _blocked(backend)
    rng = np.random.default_rng(1)
    # behind the blocker: ≈ 400 + 400 ms expected, planned at ≈ 1120 ms (z = 1 + the standby guard's 1, times the
    # 20 % spread) > 800 ms: refused by its plan (still so if this submit came up to 229 ms after the blocker
    # started); alone on an idle lane it fits (400 + 80 + 0.5 ms margin): it waits until ≈ 319 ms after its submit
    fut = sched.submit(_request(rng, 2), 800, id="waits")
    # alone it would take 480.5 ms of its 440: no idle lane could ever meet it, refused at once
    never = sched.submit(_request(rng, 3), 440, id="never")
    assert never.done() and never.result().reason == "overload" and "standby" not in never.result().detail
    assert not fut.done() and len(lane.standby) == 1
    time.sleep(0.02)
    gate.set()  # the blocker ends (the tiny model runs in well under a ms): the lane takes the waiting request
    got = fut.result(10)
    assert isinstance(got, Result) and got.ok and got.latency_ms < 800 and got.queue_ms >= 15
    assert blocker.result(10).ok and seen == [1, 2]
    assert lane.from_standby == 1 and lane.standby.taken == 1 and lane.standby.expired == 0
    snap = lane.metrics.snapshot()
    assert snap["admitted"] == 2 and snap["within_budget"] == 2 and snap["budget_missed"] == 0
    assert snap["rejected_at_admission"] == {"overload": 1}
    sched.close()


def test_a_waiting_request_no_lane_frees_for_in_time_is_refused_not_missed(backend):
    sched, lane, gate, seen, blocker = _blocked(backend)
    fut = sched.submit(_request(np.random.default_rng(2), 2), 800, id="waits")
    assert not fut.done()
    time.sleep(0.45)  # past its last start (≈ 319 ms): the lane frees too late
    gate.set()
    got = fut.result(10)
    assert isinstance(got, Rejected) and got.reason == "overload" and not got.admitted
    assert "no instance free in time" in got.detail and got.latency_ms >= 319
    assert blocker.result(10).ok and seen[0] == 1  # (the idle lane may re-measure it as a probe after its answer)
    snap = lane.metrics.snapshot()
    assert snap["budget_missed"] == 0 and snap["rejected_at_admission"] == {"overload": 1}
    assert lane.standby.expired == 1 and lane.from_standby == 0
    sched.close()


def test_the_freshest_waiting_request_runs_first_then_the_older_one_if_it_still_fits(backend):
    sched, lane, gate, seen, blocker = _blocked(backend)
    rng = np.random.default_rng(3)
    older = sched.submit(_request(rng, 2), 800, id="older")  # last start ≈ +319 ms
    fresher = sched.submit(_request(rng, 3), 900, id="fresher")  # ≈ +419 ms
    assert not older.done() and not fresher.done() and len(lane.standby) == 2
    time.sleep(0.01)
    gate.set()
    assert fresher.result(10).ok and older.result(10).ok
    assert seen == [1, 3, 2]  # most recent first (last in, first out under overload); the older one still fit
    assert lane.from_standby == 2
    sched.close()


def test_closing_without_draining_refuses_what_waits_with_shutdown(backend):
    sched, lane, gate, seen, blocker = _blocked(backend)
    fut = sched.submit(_request(np.random.default_rng(4), 2), 800, id="waits")
    assert not fut.done()
    threading.Timer(0.05, gate.set).start()  # the blocker ends while close() waits for the lane
    sched.close(drain=False)
    got = fut.result(10)
    assert isinstance(got, Rejected) and got.reason == "shutdown" and not got.admitted
    assert blocker.result(10).ok and seen == [1]


def test_draining_runs_what_waits_if_the_lane_frees_in_time_else_refuses_it_for_overload(backend):
    # sent before close(): a drain answers it as the open session would have (a user of close(drain=True) meets
    # no "shutdown" for a request already in flight)
    sched, lane, gate, seen, blocker = _blocked(backend)
    fut = sched.submit(_request(np.random.default_rng(9), 2), 800, id="waits")  # last start ≈ +319 ms
    assert not fut.done()
    threading.Timer(0.05, gate.set).start()  # the blocker ends while close() drains the lane
    sched.close()
    got = fut.result(0)
    assert isinstance(got, Result) and got.ok and seen == [1, 2] and blocker.result(0).ok

    sched, lane, gate, seen, blocker = _blocked(backend)
    late = sched.submit(_request(np.random.default_rng(10), 3), 800, id="too late")
    assert not late.done()
    threading.Timer(0.45, gate.set).start()  # frees past its last start
    sched.close()
    got = late.result(0)
    assert isinstance(got, Rejected) and got.reason == "overload" and "no instance free in time" in got.detail
    assert seen[0] == 1 and 3 not in seen


def test_without_standby_a_refusal_is_answered_at_once(backend):
    gate, seen = threading.Event(), []
    lane = _lane(backend, gate, seen)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics, standby=False)
    lane.warm.wait(10)
    rng = np.random.default_rng(5)
    blocker = sched.submit(_request(rng, 1), 600_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    got = sched.submit(_request(rng, 2), 800, id="refused")  # planned at ≈ 960 ms (z = 1, no guard without a list)
    assert got.done() and got.result().reason == "overload" and lane.standby is None
    gate.set()
    assert blocker.result(10).ok
    sched.close()


def test_standby_list_capacity_and_order():
    class R:
        def __init__(self, deadline, priority=0):
            self.deadline, self.priority = deadline, priority

    sb = Standby(capacity=2)
    a, b, c = R(1.0), R(2.0), R(3.0, priority=1)
    assert sb.add(a, 0.5, "a") == [] and sb.add(b, 1.5, "b") == []
    assert sb.add(c, 2.5, "c") == [(a, "a")]  # full: the earliest last start goes
    assert sb.sweep(1.0) == [] and len(sb) == 2
    seen = []
    taken, expired = sb.take(1.0, lambda entries: (seen.extend(entries), ([entries[0]], []))[1])
    assert seen == [c, b] and taken == [c] and expired == []  # higher priority first, then most recent
    assert sb.sweep(2.0) == [(b, "b")] and len(sb) == 0 and sb.expired == 2 and sb.taken == 1


def test_load_standby_option(tmp_path):
    bundle = text_bundle(tmp_path / "b")
    with dsedge.load(bundle, standby=False, instances=1) as s:
        core = s._core()
        assert core.scheduler.standby is False and all(l.standby is None for l in core.lanes)
    with dsedge.load(bundle, instances=2) as s:
        lanes = [l for l in s._core().lanes if not l.fallback]
        assert lanes[0].standby is not None and lanes[0].standby is lanes[1].standby
        assert all(l.standby is None for l in s._core().lanes if l.fallback)
        assert s._core().lane_stats()["fp32"]["from_standby"] == 0
    with pytest.raises(InputError, match="standby"):
        dsedge.load(bundle, standby="no")


def test_with_standby_a_plan_behind_running_work_takes_one_spread_more(backend):
    # behind the blocker (1.5 s predicted) a 3.9 s budget is planned at ≈ 3000 + z · 600 + 0.5 ms: 3600.5 at the
    # calibration's z = 1 (admitted, queued), 4200.5 with the standby guard (refused by the plan: it waits on the
    # list instead; still so if this submit came up to 214 ms after the blocker started)
    sched, lane, gate, seen, blocker = _blocked(backend, 1500.0)
    fut = sched.submit(_request(np.random.default_rng(6), 2), 3900, id="guarded")
    assert lane.depth == 0 and len(lane.standby) == 1 and not fut.done()
    gate.set()
    assert fut.result(10).ok and lane.from_standby == 1
    sched.close()

    gate, seen = threading.Event(), []
    plain = _lane(backend, gate, seen, 1500.0)
    unguarded = BudgetScheduler([plain], plain.layout, plain.metrics, standby_guard_z=0.0)
    plain.warm.wait(10)
    rng = np.random.default_rng(7)
    blocker = unguarded.submit(_request(rng, 1), 600_000, id="blocker")
    while plain._busy_until == 0.0:
        time.sleep(0.001)
    fut = unguarded.submit(_request(rng, 2), 3900, id="queued")
    assert plain.depth == 1 and len(plain.standby) == 0
    gate.set()
    assert fut.result(10).ok and blocker.result(10).ok and plain.from_standby == 0
    unguarded.close()


def test_a_waiting_request_is_refused_by_its_deadline_while_every_instance_stays_busy(backend):
    # no submit comes and the running batch does not end: the list's expiry timer refuses it soon after its last
    # start (≈ 319 ms after its submit), before its 800 ms deadline (before the timer: only once the batch ended)
    sched, lane, gate, seen, blocker = _blocked(backend)
    t0 = time.perf_counter()
    fut = sched.submit(_request(np.random.default_rng(11), 2), 800, id="waits")
    got = fut.result(5)
    waited = (time.perf_counter() - t0) * 1e3
    assert isinstance(got, Rejected) and got.reason == "overload" and not got.admitted
    assert "no instance free in time" in got.detail
    assert 300 <= got.latency_ms < 800 and waited < 800 and not gate.is_set() and lane._running
    assert lane.standby.expired == 1 and seen == []
    gate.set()
    assert blocker.result(10).ok
    sched.close()
    assert not lane.standby._timer.is_alive()  # close() stopped the expiry thread


def test_a_done_callback_raising_systemexit_ends_neither_the_expiry_thread_nor_a_lane(backend):
    # concurrent.futures hands a callback's Exception to its log, but a SystemExit propagates into the thread that
    # set the result: it ended the lane's worker (its queue never answered) or the expiry thread, and the answer
    # went uncounted
    def leave(_):
        raise SystemExit(0)

    sched, lane, gate, seen, blocker = _blocked(backend)
    rng = np.random.default_rng(12)
    # both wait on the list and expire in one sweep of the expiry thread; the first one's callback leaves
    first = sched.submit(_request(rng, 2), 800, id="first")
    second = sched.submit(_request(rng, 3), 801, id="second")
    first.add_done_callback(leave)
    assert first.result(5).reason == "overload" and second.result(5).reason == "overload"
    time.sleep(0.05)
    assert lane.standby._timer.is_alive()
    blocker.add_done_callback(leave)  # answered on the lane's worker
    queued = sched.submit(_request(rng, 4), 600_000, id="queued")  # behind the blocker, on the same lane
    gate.set()
    assert blocker.result(10).ok and queued.result(10).ok and lane.thread.is_alive()
    snap = lane.metrics.snapshot()
    assert snap["in_flight"] == 0 and snap["answered"] == 2 and snap["rejected_at_admission"] == {"overload": 2}
    sched.close()


def test_close_waits_for_a_slow_callback_on_the_expiry_thread_and_answers_every_waiting_request(backend):
    # close(timeout_s=0) returned after a fixed 5 s join with the expiry thread still inside the callback and the
    # refusals after it unanswered; now it waits for that thread as it waits for the lanes, and every future is done
    sched, lane, gate, seen, blocker = _blocked(backend)
    rng = np.random.default_rng(13)
    inside = threading.Event()

    def slow(_):
        inside.set()
        time.sleep(2.6)

    futs = [sched.submit(_request(rng, 10 + i), 800, id=i) for i in range(2)]  # expire together, in one sweep
    for f in futs:
        f.add_done_callback(slow)  # 5.2 s on the expiry thread in all
    assert inside.wait(5)
    threading.Timer(0.05, gate.set).start()
    sched.close(timeout_s=0)
    assert all(f.done() for f in futs) and blocker.done()
    assert not lane.standby._timer.is_alive()


def test_a_batch_held_open_under_a_flood_takes_the_waiting_requests_that_fit_it(backend):
    """Under a flood (arrivals above what the instances serve at batch 1), a batch held open for more arrivals
    first takes its batch-mates from the standby list: the most recent entries that still meet every member's
    deadline in it, at the profile's tail. (At 3× the batch-1 capacity and an 8× p50 budget, MiniLM int8 on two
    1-thread instances, nine interleaved pairs of cold 10 s windows: 354-367 against 328-345 answered in budget per
    s; docs/streaming.md.) Below a flood it takes none."""
    gate, seen = threading.Event(), []
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    for b in (1, 2, 3, 4):
        prof.set(b, 8, 100.0 * b, 0.0)  # no spread: a batch of b is planned at 120 · b ms (the 20 % floor) + 0.5

    def run(feed):
        gate.wait(20)
        return backend.run(feed)

    lane = Lane("fp32", run, prof, BatchLayout.of(*TEXT_IO), StreamMetrics(), max_batch=4, inline_ms=0.0,
                observe_warmup=False)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)
    lane.warm.wait(10)
    rng = np.random.default_rng(9)
    blocker = sched.submit(_request(rng, 1), 600_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)

    def request(name: str, budget_ms: float):
        feed, now = _request(rng, 2), time.perf_counter()
        return Request(name, feed, 1, 8, lane.layout.group_key(feed), budget_ms, 0, now, now + budget_ms / 1e3)

    held = request("held", 2000)
    older, tight, fresh = request("older", 2000), request("tight", 300), request("fresh", 2000)
    with lane._cond:  # the worker runs the blocker: nothing else touches the queue or the list meanwhile
        lane._insert(held)
        for r in (older, tight, fresh):
            assert lane.standby.add(r, lane.last_start(r), "refused") == []
        lane.flooded = lambda now, rows, alone_ms: False
        assert lane._join_standby(time.perf_counter()) is False and lane.depth == 1 and len(lane.standby) == 3
        lane.flooded = lambda now, rows, alone_ms: True
        assert lane._join_standby(time.perf_counter()) is True
        # fresh joins (2 rows: 240.5 ms), tight would make 3 rows (360.5 ms) past its 300 ms, older fits as the 3rd
        assert sorted(r.id for _, r in lane._queue) == ["fresh", "held", "older"]
        assert [r.id for _, r, _ in lane.standby._items] == ["tight"]
        assert lane.joined == 2 and lane.from_standby == 2
    gate.set()
    assert blocker.result(10).ok
    assert all(r.future.result(10).ok for r in (held, older, fresh))
    # the tiny model ran in well under its prediction: the idle lane then took tight from the list (not joined)
    assert tight.future.result(10).ok and lane.from_standby == 3 and lane.joined == 2
    sched.close()
