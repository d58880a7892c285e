"""Admission by playing the queue forward, and the plan's online calibration (runtime/plan_calibration.py)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsedge.runtime.arrival_rate import ArrivalRate
from dsedge.runtime.batching import BatchLayout
from dsedge.runtime.latency_profile import LatencyProfile
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.plan_calibration import PlanCalibration
from dsedge.runtime.results import Rejected, Result
from dsedge.runtime.scheduler import BudgetScheduler, Lane, Request

from streaming_models import text_request
from test_streaming_parts import TEXT_IO, backend  # noqa: F401  (the module's tiny real ORT text model)


def test_calibration_is_a_rolling_quantile_of_standardized_residuals_that_ages_out():
    cal = PlanCalibration(quantile=0.9, min_scores=10, horizon_s=2.0, refresh_s=0.0, z_max=50.0)
    assert cal.z(now=0.0) == 1.0  # nothing scored: the profile's own tail
    for i in range(9):
        cal.score(10.0, 30.0, 2.0, now=0.0)  # 20 ms late on a 2 ms spread: z-score 10
    assert cal.z(now=0.0) == 1.0  # fewer than min_scores
    for i in range(10):
        cal.score(10.0, 10.0 + i, 1.0, now=1.0)  # z-scores 0..9
    assert cal.z(now=1.0) == 10.0  # 19 scores (0..9 and nine of 10): the 90th percentile, nearest rank
    assert cal.z(now=2.5) == pytest.approx(8.0)  # the first nine aged out: 90th percentile of 0..9
    assert cal.z(now=10.0) == 1.0  # all aged out: no stale bound keeps rejecting
    for _ in range(20):
        cal.score(20.0, 5.0, 1.0, now=11.0)  # a pessimistic plan: z never below 0 (never before the expected time)
    assert cal.z(now=11.0) == 0.0
    cal.score(10.0, 5.0, 0.0)
    cal.score(float("inf"), 5.0, 1.0)  # no spread or unknown: not scored
    assert cal.to_dict()["scores"] <= 20
    with pytest.raises(ValueError):
        PlanCalibration(quantile=1.0)


def test_at_a_low_rate_the_calibration_reaches_back_to_min_scores_within_max_horizon():
    cal = PlanCalibration(quantile=0.9, min_scores=10, horizon_s=1.0, max_horizon_s=4.0, refresh_s=0.0, z_max=50.0)
    for i in range(10):  # one score every 0.3 s: never ten within the one-second horizon
        cal.score(10.0, 10.0 + i, 1.0, now=0.3 * i)  # z-scores 0..9
    assert cal.z(now=2.8) == 8.0  # the latest ten, all within 4 s: calibrated (p90, nearest rank), not the tail
    for _ in range(10):
        cal.score(10.0, 12.0, 1.0, now=3.6)  # ten new ones within the horizon: only they count
    assert cal.z(now=3.6) == 2.0
    assert cal.z(now=20.0) == 1.0  # everything past max_horizon_s: back to the profile's tail
    sparse = PlanCalibration(quantile=0.9, min_scores=10, horizon_s=1.0, max_horizon_s=4.0, refresh_s=0.0)
    for i in range(10):
        sparse.score(10.0, 10.0 + i, 1.0, now=0.5 * i)  # the first two are past 4 s at 4.6: eight left, too few
    assert sparse.z(now=4.6) == 1.0


def _held_lane(backend, gate: threading.Event, ms: float, margin_ms: float = 0.0, fixed: bool = False) -> Lane:
    """A batch-1 lane predicting exactly ``ms`` per request (tail margin ``margin_ms``; ``fixed``: never re-measured)
    whose backend waits for ``gate``."""
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, ms, margin_ms)
    if fixed:
        prof.observe = lambda *a, **k: None

    def run(feed):
        gate.wait(20)
        return backend.run(feed)

    return Lane("fp32", run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0)


def test_admission_plays_the_queue_forward_and_never_displaces_an_admitted_request(backend):
    gate = threading.Event()
    lane = _held_lane(backend, gate, 200.0)
    # refusals answered at once (no standby list: tests/test_streaming_standby.py has what it changes)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics, standby=False)
    rng = np.random.default_rng(0)
    blocker = sched.submit(text_request(rng, 8), 60_000, id="blocker")
    while lane._busy_until == 0.0:  # the blocker is on the backend, predicted to end 200 ms after it started
        time.sleep(0.001)
    # batch 1, 200 ms each behind a batch predicted to end within 200 ms: expected ≈ 400, 600, 800, 1000 ms, planned
    # with a spread of 20 % (a profile without spread) at ≈ 480, 720, 960, 1200 ms (200 ms of slack for a slow
    # machine between the blocker's start and these submits)
    futs = [sched.submit(text_request(rng, 8), 1000, id=f"r{i}") for i in range(4)]
    # an earlier deadline would go first: it fits its own 500 ms, but would push r2 past its 1000 ms
    urgent = sched.submit(text_request(rng, 8), 500, id="urgent")
    assert [f.done() for f in futs] == [False, False, False, True]
    r3, u = futs[3].result(), urgent.result()
    assert isinstance(r3, Rejected) and r3.reason == "overload" and not r3.admitted
    assert isinstance(u, Rejected) and u.reason == "overload" and "queued before it" in u.detail
    plans = sorted(r.plan_ms for _, r in lane._queue)  # expected latencies: ≈ 400, 600, 800 ms
    assert len(plans) == 3 and plans[0] < plans[1] < plans[2] <= 900 and plans[2] - plans[0] == pytest.approx(
        400, abs=30)
    gate.set()
    answers = [f.result(20) for f in (blocker, *futs[:3])]
    assert all(isinstance(a, Result) and a.ok for a in answers)
    sched.close()


def test_a_plan_that_was_optimistic_makes_admission_stricter(backend):
    """Service takes 60 ms where the profile says 20 (and is not allowed to learn it): the residuals of plans made
    behind a running batch grow and admission stops taking such requests the plan alone would have admitted; a
    request alone on an idle lane is still planned at the profile's tail (stratum 0)."""
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 20.0, 0.0)
    prof.observe = lambda *a, **k: None  # a profile that never learns: only the calibration can notice

    def run(feed):
        time.sleep(0.06)
        return backend.run(feed)

    lane = Lane("fp32", run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0)
    lane.calibration = PlanCalibration(min_scores=5, refresh_s=0.0)
    lane.warm.wait(10)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)

    def busy():  # a request the worker has taken (running for 60 ms)
        f = sched.submit(text_request(rng, 8), 1000)
        t_end = time.perf_counter() + 5
        while lane.depth and time.perf_counter() < t_end:
            time.sleep(0.0005)
        return f

    for _ in range(6):  # planned 40 ms behind the running one (spread 8 ms), answered after 120: z-score 10
        pair = [busy(), sched.submit(text_request(rng, 8), 1000)]
        assert all(isinstance(f.result(10), Result) for f in pair)
    assert lane.calibration.z(stratum=1) == 5.0 and lane.calibration.z() == 5.0  # at its cap
    assert lane.calibration.z(stratum=0) == 1.0
    running = busy()
    # behind it: ~40 ms expected, + 8 ms at z = 1 fits 50; + 40 ms at z = 5 does not
    after = sched.submit(text_request(rng, 8), 50).result(10)
    assert isinstance(after, Rejected) and after.reason == "overload" and not after.admitted
    running.result(10)
    alone = sched.submit(text_request(rng, 8), 30).result(10)  # idle: 20 + 4 ms at z = 1 fits 30 (runs 60: late)
    assert isinstance(alone, Result) and alone.latency_ms > 30
    sched.close()


def test_calibration_level_follows_the_miss_rate_seen_within_bounds():
    """ACI: misses rarer than the target lower the quantile (a smaller z), a miss raises it at once."""
    cal = PlanCalibration(quantile=0.99, target_miss=0.01, gamma=0.1, min_scores=1, refresh_s=0.0,
                          alpha_min=0.001, z_max=1000.0)
    for i in range(100):
        cal.score(10.0, 10.0 + i, 1.0, now=0.0)  # z-scores 0..99
    assert cal.z(now=0.0) == 98.0  # the 99th percentile to start with
    for _ in range(200):
        cal.outcome(False)  # 200 hits: alpha grows by 0.1 * 0.01 each
    assert cal.alpha == pytest.approx(0.21, abs=1e-9) and cal.z(now=0.0) == 78.0
    cal.outcome(True)  # one miss: alpha drops by 0.1 * 0.99
    assert cal.alpha == pytest.approx(0.111, abs=1e-9) and cal.z(now=0.0) == 88.0
    for _ in range(100):
        cal.outcome(True)
    assert cal.alpha == cal.alpha_min  # bounded: z tops out at a high percentile, never "reject all"
    for _ in range(100_000):
        cal.outcome(False)
    assert cal.alpha == cal.alpha_max and cal.z(now=0.0) == 49.0  # and bottoms out at the median


def test_calibration_default_target_keeps_the_level_at_its_floor_between_sparse_misses():
    """The default ACI target (0.1 % of planned requests): one miss in 300 (0.33 %, over the target) holds α at
    its floor between misses. With a 0.5 % target α climbed by 0.075 in the 300 hits after each miss, so clustered
    misses met a lax quantile (more admitted, 1.9 % of them late at 3x load, docs/streaming.md)."""
    cal = PlanCalibration()
    for _ in range(5):
        cal.outcome(True)
        for _ in range(299):
            cal.outcome(False)
        assert cal.alpha <= cal.alpha_min + 0.016  # 299 hits: +0.05 * 0.001 each
    old = PlanCalibration(target_miss=0.005)
    old.outcome(True)
    for _ in range(299):
        old.outcome(False)
    assert old.alpha > cal.alpha + 0.05


def test_a_lane_refusing_by_plan_re_measures_and_admits_again(backend):
    """An estimate of 25 ms on a backend that takes ~1 ms: alone it fits a 28 ms budget, its plan (with the spread)
    does not, so every request is refused (``budget``: its batch alone misses at the tail on the idle lane) and none
    runs to correct the estimate — unless the idle lane re-runs a refused one as a probe."""
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 25.0, 0.0)
    lane = Lane("fp32", backend.run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    first = sched.submit(text_request(rng, 8), 28).result(10)
    assert isinstance(first, Rejected) and first.reason == "budget" and "alone on idle" in first.detail
    t0, answered = time.perf_counter(), None
    while time.perf_counter() - t0 < 5.0 and answered is None:
        ans = sched.submit(text_request(rng, 8), 28).result(10)
        answered = ans if isinstance(ans, Result) else None
        time.sleep(0.02)
    assert answered is not None and answered.ok and lane.probes >= 1, prof.to_dict()
    sched.close()


def test_a_later_admission_restates_the_plans_it_changes(backend):
    """r1 joins r0's batch (2 rows in 150 ms beat 1 in 100): r0's expected completion moves ~50 ms later, and r0
    is scored against that plan, not against the one its own admission made (runtime/scheduler.py restate)."""
    gate = threading.Event()
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 100.0, 0.0)
    prof.set(2, 8, 150.0, 0.0)

    def run(feed):
        gate.wait(20)
        return backend.run(feed)

    lane = Lane("fp32", run, prof, layout, StreamMetrics(), max_batch=4, inline_ms=0.0)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    blocker = sched.submit(text_request(rng, 8), 60_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    f0 = sched.submit(text_request(rng, 8), 5000, id="r0")
    r0 = next(r for _, r in lane._queue if r.id == "r0")
    alone = r0.plan_ms  # ≈ 100 (the blocker's rest) + 100
    f1 = sched.submit(text_request(rng, 8), 5000, id="r1")
    r1 = next(r for _, r in lane._queue if r.id == "r1")
    assert r0.plan_ms - alone == pytest.approx(50.0, abs=15.0)
    assert r1.plan_ms == pytest.approx(r0.plan_ms, abs=15.0)  # one batch: the same expected end
    gate.set()
    assert all(isinstance(f.result(20), Result) for f in (blocker, f0, f1))
    sched.close()


def test_calibration_strata_an_idle_lane_plan_keeps_the_profile_tail_and_queued_ones_their_own_quantile():
    """Mondrian strata by batches planned ahead: correlated queue errors do not make an idle lane refuse."""
    cal = PlanCalibration(quantile=0.9, min_scores=10, refresh_s=0.0, z_max=50.0)
    for i in range(10):
        cal.score(10.0, 10.0 + i, 1.0, now=0.0, stratum=0)  # alone on an idle lane: z-scores 0..9
        cal.score(10.0, 10.0 + 3 * i, 1.0, now=0.0, stratum=1)  # one batch ahead: 0..27
    assert cal.z(now=0.0, stratum=0) == 1.0  # the profile's tail, whatever was scored
    assert cal.z(now=0.0, stratum=1) == 24.0  # its own p90 (nearest rank of 0, 3, ..., 27)
    assert cal.z(now=0.0, stratum=2) == 24.0  # too few of its own: strata 1 and 2+ together
    for i in range(10):
        cal.score(10.0, 10.0 + 2 * i, 1.0, now=0.0, stratum=7)  # deeper than 2 counts as 2+: 0..18
    assert cal.z(now=0.0, stratum=2) == 16.0 and cal.z(now=0.0, stratum=5) == 16.0
    assert cal.z(now=0.0) == 18.0  # pooled over all 30: the 27th of 0..9, 0..27 by 3 and 0..18 by 2
    live = PlanCalibration(quantile=0.9, min_scores=10, refresh_s=0.0, z_max=50.0)
    for i in range(10):
        live.score(10.0, 10.0 + 3 * i, 1.0, stratum=1)
    assert live.to_dict()["z_by_ahead"] == [1.0, 24.0, 24.0]
    idle = PlanCalibration(quantile=0.9, min_scores=10, refresh_s=0.0, z_max=50.0)
    for i in range(10):
        idle.score(10.0, 10.0 + i, 1.0, now=0.0, stratum=0)  # only idle-lane plans scored (a light load)
    assert idle.z(now=0.0) == 8.0  # their own p90, reported as the pooled z
    # a queued plan does not borrow it: idle-lane spreads are the 20 % floor, their z-scores run 2-4x higher
    assert idle.z(now=0.0, stratum=1) == 1.0 and idle.z(now=0.0, stratum=2) == 1.0


def test_a_plan_counts_the_batches_ahead_and_an_idle_lane_admits_at_the_profile_tail(backend):
    gate = threading.Event()
    lane = _held_lane(backend, gate, 10.0, fixed=True)
    layout = lane.layout
    lane.calibration = PlanCalibration(min_scores=5, refresh_s=0.0, z_max=50.0)
    for _ in range(5):
        lane.calibration.score(10.0, 50.0, 2.0, stratum=1)  # queued plans were 20 spreads late
    lane.warm.wait(10)
    # no standby list: a refusal is answered at once, not when the held batch frees the lane
    sched = BudgetScheduler([lane], layout, lane.metrics, standby=False)
    rng = np.random.default_rng(0)
    now = time.perf_counter()
    z = lambda k: lane.calibration.z(now, k)  # noqa: E731
    first = sched.submit(text_request(rng, 8), 15)  # idle lane: 10 ms + 20 % spread at z = 1 + margin fits 15
    deadline = time.perf_counter() + 5
    while lane.depth and time.perf_counter() < deadline:  # the worker took it: it runs (held at the gate)
        time.sleep(0.001)
    time.sleep(0.03)  # and runs past its expected end (10 ms), the profile's tail margin 0: still a batch ahead
    feed = text_request(rng, 8)
    probe = Request(0, feed, 1, 8, layout.group_key(feed), 100.0, 0, time.perf_counter(), time.perf_counter() + 0.1)
    plan = lane.plan(probe, time.perf_counter(), z)
    assert plan.ahead == 1  # behind the running batch: stratum 1, planned at z = 20
    assert (plan.done - plan.expected) > 20 * plan.spread * 0.99
    second = sched.submit(text_request(rng, 8), 40).result(10)  # ~20 ms expected but 20 spreads: refused
    assert isinstance(second, Rejected) and second.reason == "overload"
    gate.set()
    assert isinstance(first.result(10), Result)
    sched.close()


def test_a_plan_scales_every_batch_and_the_running_ones_rest_by_the_callers_extra_cpu(backend):
    """``slow`` (runtime/caller_load.py) scales the planned times of the running batch's rest and of each batch after
    it: a request behind one 10 ms batch on a 10 ms profile is expected ~20 ms from now at 1, ~40 ms at 2."""
    gate = threading.Event()
    lane = _held_lane(backend, gate, 10.0, 2.0, fixed=True)
    layout = lane.layout
    lane.warm.wait(10)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    first = sched.submit(text_request(rng, 8), 1000)
    while not lane._running:
        time.sleep(0.001)
    feed = text_request(rng, 8)
    now = time.perf_counter()
    probe = Request(0, feed, 1, 8, layout.group_key(feed), 1000.0, 0, now, now + 1.0)
    at1, at2 = lane.plan(probe, now), lane.plan(probe, now, slow=2.0)
    assert at1.ahead == at2.ahead == 1
    assert at2.expected - now == pytest.approx(2 * (at1.expected - now), rel=1e-9)
    assert at2.spread == pytest.approx(2 * at1.spread, rel=1e-9)
    assert 0.015 < at1.expected - now <= 0.020
    gate.set()
    assert isinstance(first.result(10), Result)
    sched.close()


def test_caller_load_rises_with_a_tight_loop_of_submits_and_stays_at_1_for_a_sleeping_caller():
    """``CallerLoad.factor``: a thread that keeps its core busy between calls, after a second of sleeping ones,
    gets plans about twice as long (weight 1); one that sleeps between calls, 1; weight 0 is off."""
    from dsedge.runtime.caller_load import CallerLoad

    def spin(s):
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    load = CallerLoad(1.0)
    calm = []
    for _ in range(100):  # 1 s of a caller that sleeps 10 ms between submits
        calm.append(load.factor())
        time.sleep(0.01)
    busy = []
    for _ in range(100):  # then 50 ms of a tight loop
        spin(0.0005)
        busy.append(load.factor())
    assert max(calm) < 1.1
    assert busy[-1] > 1.4 and max(busy) <= load.cap  # (a share under 1 on a loaded machine)
    off = CallerLoad(0.0)
    assert [off.factor() for _ in range(3)] == [1.0, 1.0, 1.0]


def test_arrival_rate_reads_rows_per_second_over_its_window_and_nothing_from_too_few_arrivals():
    rate = ArrivalRate(window_s=0.25, min_span_s=0.02, min_count=10)
    for i in range(9):
        rate.add(i * 0.001)
    assert rate.rows_per_s(0.009) is None  # 9 arrivals: too few to read
    rate.add(0.009)
    assert rate.rows_per_s(0.009) is None  # 10, but within 9 ms: too short a span
    for i in range(10, 100):
        rate.add(i * 0.001, rows=2)  # 2 rows every ms from 10 ms on
    # rows after the first arrival over the span from it: 9 single rows then 90 double ones, over 99 ms
    assert rate.rows_per_s(0.099) == pytest.approx((9 * 1 + 90 * 2) / 0.099)
    # at 300 ms only the last 250 ms count: arrivals from 50 ms on (2 rows each), the first of them excluded
    assert rate.rows_per_s(0.3) == pytest.approx(2 * 49 / 0.25)
    assert rate.rows_per_s(0.5) is None  # every arrival older than the window: nothing left to read


def test_calibration_cold_z_stands_in_only_for_a_queued_stratum_with_no_quantile_yet():
    cal = PlanCalibration(quantile=0.9, min_scores=10, refresh_s=0.0, z_max=50.0)
    assert cal.z(now=0.0, stratum=0, cold_z=3.0) == 1.0  # an idle lane's plan: the profile's tail, always
    assert cal.z(now=0.0, stratum=1, cold_z=3.0) == 3.0 and cal.z(now=0.0, stratum=2, cold_z=3.0) == 3.0
    assert cal.z(now=0.0, stratum=1) == 1.0  # no prior given: default_z
    for i in range(10):
        cal.score(10.0, 10.0 + 0.1 * i, 1.0, now=0.0, stratum=1)  # queued plans 0..0.9 spreads late
    # its own quantile now, for stratum 2 too (strata 1 and 2+ together): the prior no longer applies
    assert cal.z(now=0.0, stratum=1, cold_z=3.0) == pytest.approx(0.8)
    assert cal.z(now=0.0, stratum=2, cold_z=3.0) == pytest.approx(0.8)


@pytest.mark.parametrize("flood, cold_z, admitted", [(False, 5.0, True), (True, 5.0, False), (True, None, True)])
def test_a_plan_behind_a_batch_takes_the_overload_prior_only_while_arrivals_exceed_the_instances(
        backend, flood, cold_z, admitted):
    """No calibration yet for plans behind a batch: at z = 1 the request fits its 300 ms budget (at most 100 ms left
    of the running batch, 100 ms its own, a spread of about 40 ms: ~240 ms); at the prior z = 5 it cannot (~370 ms
    with the running batch ~30 ms in). The prior applies while arrivals (refused ones too) exceed what the lane
    serves at batch 1 (here 10 rows/s)."""
    gate = threading.Event()
    lane = _held_lane(backend, gate, 100.0, 20.0, fixed=True)
    lane.warm.wait(10)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics, standby=False, overload_cold_z=cold_z)
    rng = np.random.default_rng(0)
    blocker = sched.submit(text_request(rng, 8), 60_000)
    deadline = time.perf_counter() + 5
    while lane.depth and time.perf_counter() < deadline:  # on the backend, held at the gate: a batch ahead
        time.sleep(0.001)
    if flood:  # 12 requests over ~24 ms, each refused at once ("budget": 50 ms < 100 ms alone), all arrivals
        for _ in range(12):
            assert sched.submit(text_request(rng, 8), 50).result(1).reason == "budget"
            time.sleep(0.002)
    late = sched.submit(text_request(rng, 8), 300)
    assert late.done() is not admitted  # a refusal is answered at once (no standby list), an admission waits
    if not admitted:
        assert isinstance(late.result(), Rejected) and late.result().reason == "overload"
    gate.set()
    assert isinstance(blocker.result(10), Result)
    if admitted:
        assert isinstance(late.result(10), Result)
    sched.close()


def test_arrival_rate_keeps_its_window_ordered_when_threads_add_out_of_order_and_never_divides_by_zero():
    rate = ArrivalRate(window_s=0.25, min_span_s=0.0, min_count=2)
    for _ in range(12):
        rate.add(5.0)
    assert rate.rows_per_s(5.0) is None  # twelve arrivals at one instant: no span, no rate (was a ZeroDivisionError)
    late = ArrivalRate(window_s=0.25, min_span_s=0.02, min_count=10)
    late.add(1.0)
    late.add(0.5)  # read the clock before another thread's add: stored at 1.0, not left behind at the tail
    for i in range(12):
        late.add(1.0 + i * 0.002)
    assert late.rows_per_s(1.03) == pytest.approx(13 / 0.03)  # 14 arrivals from 1.0 s on, the first excluded
    late.add(float("nan"))  # stored at the last time too: the count goes on
    assert late.rows_per_s(1.03) == pytest.approx(14 / 0.03) and late.rows_per_s(float("nan")) is None
    # at 1.3 s nothing is within the window: the out-of-order 0.5 s entry did not linger at the tail
    assert late.rows_per_s(1.3) is None and len(late._arrivals) == 0


def test_a_request_whose_own_batch_misses_at_the_tail_on_an_idle_lane_is_refused_budget_at_once(backend):
    """Alone at the median it fits (10 ms + the margin < 11 ms), at the profile's tail it does not (10 + 2 ms): with
    nothing running or queued anywhere, backing off changes nothing, so the refusal says ``budget`` (a user's pass
    found an idle server refusing such calls ``overload``); it comes at once, with a standby list too."""
    gate = threading.Event()
    gate.set()
    lane = _held_lane(backend, gate, 10.0, 2.0, fixed=True)
    lane.warm.wait(10)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)  # with a standby list
    rng = np.random.default_rng(0)
    fut = sched.submit(text_request(rng, 8), 11.0)
    assert fut.done()
    r = fut.result()
    assert isinstance(r, Rejected) and r.reason == "budget" and "alone on idle fp32 at its tail" in r.detail, r
    ok = sched.submit(text_request(rng, 8), 30.0).result(10)  # room for its tail: answered
    assert isinstance(ok, Result)
    sched.close()


def test_the_fallback_lane_takes_requests_too_slow_at_the_median_not_those_missing_only_at_an_idle_tail(backend):
    """The variant's fallback backend is offered what its instances cannot meet alone at the median (9 ms against
    10 ms), as before; a request that fits the median but not the idle instance's tail (11 ms against 10 + 2 ms) is
    refused ``budget`` there and not offered to the fallback, as it was not when it was refused ``overload``."""
    gate = threading.Event()
    gate.set()
    inst = _held_lane(backend, gate, 10.0, 2.0, fixed=True)
    layout = inst.layout
    fast = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    fast.set(1, 8, 1.0, 0.1)
    fast.observe = lambda *a, **k: None
    fallback = Lane("fp32", backend.run, fast, layout, inst.metrics, max_batch=1, inline_ms=0.0, fallback=True)
    inst.warm.wait(10)
    fallback.warm.wait(10)
    sched = BudgetScheduler([inst, fallback], layout, inst.metrics, standby=False)
    rng = np.random.default_rng(0)
    # first, while the instance is idle (a refused request may then run on it as a re-measuring probe)
    tail_only = sched.submit(text_request(rng, 8), 11.0).result(10)
    assert isinstance(tail_only, Rejected) and tail_only.reason == "budget" and "alone on idle" in tail_only.detail
    slow_at_median = sched.submit(text_request(rng, 8), 9.0).result(10)  # the median check: running or not
    assert isinstance(slow_at_median, Result) and slow_at_median.ok
    sched.close()


def test_the_plan_of_an_empty_queue_is_the_queue_playback_of_its_one_batch():
    """``Lane.plan`` computes an empty queue's plan inline (most plans below capacity; the playback's Python was a
    measurable share of the caller's CPU per request): it must be the plan ``_play`` gives, idle lane or behind a
    running batch, whether the request fits, misses at its tail, or cannot make it at all."""
    rng = np.random.default_rng(0)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    for _ in range(40):
        prof.observe(1, 32, 5.0 + 2.0 * rng.random())
    lane = Lane("fp32", lambda feed: feed, prof, BatchLayout.of(*TEXT_IO), StreamMetrics())
    z = lambda ahead: 1.0 + 0.7 * ahead  # noqa: E731
    outcomes = set()
    for i in range(400):
        now = time.perf_counter()
        budget = float(rng.uniform(3.0, 30.0))
        req = Request(i, {}, 1, 32, ("g",), budget, 0, now, now + budget / 1e3)
        running = bool(rng.random() < 0.6)
        lane._running = running
        lane._run_mid = now + float(rng.uniform(-0.002, 0.01)) if running else 0.0
        lane._run_dev = float(rng.uniform(0.0, 0.003)) if running else 0.0
        got = lane.plan(req, now, z)
        ref = lane._play([req], now, max(lane._run_mid - now, 0.0), lane._run_dev ** 2, z, {}, int(running))
        want = ref.get(id(req))
        if want is None:
            assert got.done == float("inf") and got.expected == float("inf")
            outcomes.add("cannot")
        else:
            assert (got.done, got.expected, got.spread, got.ahead) == pytest.approx(
                (want.done, want.expected, want.spread, want.ahead), rel=1e-12, abs=1e-12)
            outcomes.add("fits" if got.done <= req.deadline else "misses")
    lane._running = False
    assert outcomes == {"fits", "misses", "cannot"}  # every branch was compared
