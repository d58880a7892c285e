"""Latency profile, batching layout and the EDF lane, on real ORT sessions of tiny models built here."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, wait

import numpy as np
import pytest

from dsedge.runtime.backends.ort import OrtBackend
from dsedge.runtime.batching import BatchLayout, example_feed
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.runtime.latency_profile import LatencyProfile, measure, seq_bucket
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.results import Rejected, Result
from dsedge.runtime.scheduler import BudgetScheduler, Lane

from streaming_models import text_embedder, text_request

TEXT_IO = ([IOSpec("input_ids", "int64", ("batch", "sequence")), IOSpec("attention_mask", "int64", ("batch", "sequence"))],
           [IOSpec("last_hidden_state", "float32", ("batch", "sequence", 32)),
            IOSpec("sentence_embedding", "float32", ("batch", 32))])


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return OrtBackend(text_embedder(tmp_path_factory.mktemp("parts") / "m.onnx", dim=32), threads=1)


def test_ort_threads_do_not_spin_between_runs(backend):
    # a spinning intra-op pool holds the cores the scheduler thread and a server's event loop need (ort.py)
    opts = backend.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_seq_bucket_powers_of_two():
    assert [seq_bucket(s) for s in (None, 0, 1, 8, 9, 16, 17, 100)] == [0, 0, 8, 8, 16, 16, 32, 128]


def test_profile_interpolates_seeds_and_scales_them_by_this_machine():
    p = LatencyProfile("fp32", k_dev=0.0)
    assert p.predict(1) == math.inf  # nothing known: the scheduler admits one cold batch, never guesses a time
    p.set(1, None, 2.0, 0.0)
    p.set(8, None, 9.0, 0.0)
    assert p.predict(1) == pytest.approx(2.0)
    assert p.predict(4) == pytest.approx(2.0 + 3 / 7 * 7.0)  # linear between known batch sizes
    # beyond the largest known batch no row is cheaper than there: 9 / 8 ms per row (the last slope, 1 ms per row,
    # would promise 17 ms for 16 rows) …
    assert p.predict(16) == pytest.approx(18.0) and p.predict(12) == pytest.approx(13.5)
    steep = LatencyProfile("fp32", k_dev=0.0)
    steep.set(1, None, 2.0, 0.0)
    steep.set(4, None, 20.0, 0.0)  # … while a last slope steeper than that (6 > 5 ms per row) is extended
    assert steep.predict(8) == pytest.approx(44.0)
    for _ in range(3):
        p.observe(1, None, 4.0)  # this machine is twice as slow as the build machine …
    assert p.predict(1) == pytest.approx(4.0)
    assert p.predict(8) == pytest.approx(18.0)  # … so the unmeasured seed is scaled by measured / seed
    flat = LatencyProfile(k_dev=0.0, scale_seeds=False)
    flat.set(8, None, 9.0, 0.0)
    flat.observe(1, None, 4.0)
    assert flat.predict(8) == pytest.approx(9.0)  # "bundle" mode: build-time figures as they are
    # a bucket never seen falls back to the token-linear fit over all points
    p2 = LatencyProfile(k_dev=0.0)
    p2.set(1, 16, 1.0, 0.0)
    p2.set(4, 16, 4.0, 0.0)
    assert p2.predict(2, 64) == pytest.approx(8.0, rel=1e-6)  # 128 tokens at 1/16 ms per token
    assert p2.max_batch_within(3.0, 16, limit=32) == 3


def test_profile_times_is_predicts_expected_and_tail_in_one_lookup():
    p = LatencyProfile("fp32", quantile=0.9, window=20, refresh_s=0.0)
    assert p.times(1, 32) == (math.inf, math.inf)  # nothing known
    p.set(8, 32, 30.0, 2.0)  # a seed, then measured batch-1 samples that rescale it
    for i in range(20):
        p.observe(1, 32, 5.0 + (i % 10) * 0.1)
    for b, seq in ((1, 32), (3, 32), (8, 32), (16, 32), (2, 128)):  # measured, interpolated, seeded, beyond, fitted
        assert p.times(b, seq) == (p.predict(b, seq, k_dev=0.0), p.predict(b, seq))
    assert p.times(1, 32) == (pytest.approx(5.45), pytest.approx(5.8))
    for _ in range(3):  # the window's top 3 of 20: its p90 now, capped by the 8-row seed's tail (30 + 3 · 2 ms)
        p.observe(1, 32, 50.0)
    assert p.times(1, 32) == (pytest.approx(5.6), pytest.approx(36.0))  # not a stale cached pair


def test_profile_window_quantile_converges_from_either_side_and_forgets_stalls():
    p = LatencyProfile("fp32", quantile=0.9, window=20, horizon_s=1.0, min_samples=3, refresh_s=0.0)
    t = time.perf_counter()
    for i in range(20):
        p.observe(1, 8, 10.0 + (i % 10) * 0.1, now=t)  # 10.0 … 10.9 ms
    assert p.predict(1, 8, k_dev=0.0) == pytest.approx(10.45)  # the median
    assert p.predict(1, 8) == pytest.approx(10.8)  # nearest-rank p90 of the window
    for _ in range(20):
        p.observe(1, 8, 2.0, now=t)  # faster now: the estimate comes down within one window (from above) …
    assert p.predict(1, 8) == pytest.approx(2.0)
    for _ in range(20):
        p.observe(1, 8, 30.0, now=t)  # … and up again within one window (from below)
    assert p.predict(1, 8) == pytest.approx(30.0)
    old = time.perf_counter() - 5.0  # a stall seconds ago, then three ordinary samples: the stall no longer counts
    q = LatencyProfile(quantile=0.99, min_samples=3, refresh_s=0.0)
    q.observe(1, 8, 5000.0, now=old)
    assert q.predict(1, 8) == pytest.approx(5000.0)  # fewer than min_samples recent: older ones still count
    for _ in range(3):
        q.observe(1, 8, 3.0)
    assert q.predict(1, 8) == pytest.approx(3.0)
    assert q.to_dict()["points"][0] == {"batch": 1, "seq_bucket": 8, "mean_ms": 3.0, "tail_ms": 3.0, "count": 4,
                                        "seeded": False}


def test_profile_tail_margin_and_bundle_figures():
    v = Variant("int8", "int8", "models/int8.onnx", latency_ms={"1": {"p50": 2.0, "p99": 5.0}, "8x64": 10.0,
                                                                "junk": "x"})
    p = LatencyProfile.from_variant(v, k_dev=3.0)
    assert p.predict(1) == pytest.approx(5.0)  # p50 + 3 · (p99 − p50) / 3
    assert p.predict(1, k_dev=0.0) == pytest.approx(2.0)
    assert p.predict(8, 64) == pytest.approx(10.0 + 3 * 1.0)  # default deviation 10 %
    assert {(1, 0), (8, 64)} == set(p.points())
    assert p.predict(1, 32) == pytest.approx(5.0)  # a figure without a length stands for any length
    built = Variant("fp32", "fp32", "m.onnx", latency_ms={"1": {"p50": 3.0, "p99": 3.3, "n": 50, "provider": "CPU",
                                                                "shape": {"input_ids": [1, 32], "mask": [1, 32]}}})
    assert set(LatencyProfile.from_variant(built).points()) == {(1, 32)}  # as `dsedge build` records it
    assert p.to_dict()["points"][0]["batch"] == 1


def test_measure_real_backend_grows_with_batch(backend):
    layout = BatchLayout.of(*TEXT_IO)
    from dsedge.runtime.batching import example_feed

    p = measure(LatencyProfile("fp32"), backend.run, lambda b, s: example_feed(layout, b, s), [1, 64], [32], repeats=3)
    pts = p.points()
    assert set(pts) == {(1, 32), (64, 32)}
    assert pts[(64, 32)] > pts[(1, 32)] > 0


def test_layout_pads_and_splits_back_exactly(backend):
    layout = BatchLayout.of(*TEXT_IO)
    assert (layout.batch_symbol, layout.seq_symbol, layout.can_pad) == ("batch", "sequence", True)
    rng = np.random.default_rng(1)
    feeds = [text_request(rng, s) for s in (3, 11, 7)]
    assert len({layout.group_key(f) for f in feeds}) == 1  # padding lets different lengths share a batch
    batch, seq = layout.stack(feeds)
    assert seq == 11 and batch["input_ids"].shape == (3, 11) and batch["attention_mask"][0, 3:].sum() == 0
    parts = layout.split(backend.run(batch), feeds)
    for f, part in zip(feeds, parts):
        alone = backend.run(f)
        assert part["last_hidden_state"].shape == alone["last_hidden_state"].shape
        np.testing.assert_allclose(part["sentence_embedding"], alone["sentence_embedding"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(part["last_hidden_state"], alone["last_hidden_state"], rtol=1e-5, atol=1e-6)


def test_a_request_with_an_all_zero_mask_row_batches_only_with_its_own_length():
    layout = BatchLayout.of(*TEXT_IO)
    rng = np.random.default_rng(2)
    empty = text_request(rng, 5)
    empty["attention_mask"][:] = 0
    normal = [text_request(rng, s) for s in (5, 9)]
    assert layout.group_key(empty) != layout.group_key(normal[0]) == layout.group_key(normal[1])
    other = text_request(rng, 5)
    other["attention_mask"][:] = 0
    assert layout.group_key(empty) == layout.group_key(other)  # its own length still batches (nothing to pad)
    # (the real model's answer moving under padding: tests/test_streaming_invariance.py)


def test_layout_without_mask_or_batch_axis():
    no_mask = BatchLayout.of([IOSpec("ids", "int64", ("batch", "sequence"))],
                             [IOSpec("out", "float32", ("batch", "sequence", 4))])
    assert no_mask.dynamic and not no_mask.can_pad
    a, b = {"ids": np.ones((1, 3), np.int64)}, {"ids": np.ones((1, 4), np.int64)}
    assert no_mask.group_key(a) != no_mask.group_key(b)  # different shapes never share a batch
    static = BatchLayout.of([IOSpec("x", "float32", (1, 8))], [IOSpec("y", "float32", (1, 8))])
    assert not static.dynamic and static.rows({"x": np.zeros((1, 8), np.float32)}) == 1


def _lane(backend, gate: threading.Event | None = None, **kw) -> Lane:
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)  # seeds stay as set, whatever a gated run took
    prof.set(1, 8, 1.0, 0.0)
    prof.set(32, 8, 4.0, 0.0)

    def run(feed):
        if gate is not None:
            gate.wait(10)
        return backend.run(feed)

    kw.setdefault("inline_ms", 0.0)  # gated runs must stay on the worker thread
    return Lane("fp32", run, prof, layout, StreamMetrics(), **kw)


def _blocked(lane: Lane, rng) -> tuple[BudgetScheduler, Future]:
    """A scheduler over ``lane`` whose worker is inside a first batch, held by the lane's gate."""
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)
    blocker = sched.submit(text_request(rng, 8), 10_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    return sched, blocker


def test_a_drain_timeout_refuses_what_is_queued_while_a_batch_still_runs(backend):
    gate = threading.Event()
    lane = _lane(backend, gate)
    sched, blocker = _blocked(lane, np.random.default_rng(0))
    queued = sched.submit(text_request(np.random.default_rng(1), 8), 600_000, id="queued")
    assert lane.depth == 1
    closing = threading.Thread(target=sched.close, kwargs={"timeout_s": 0.2})
    t0 = time.perf_counter()
    closing.start()
    got = queued.result(5)  # while the blocker still holds the backend
    assert isinstance(got, Rejected) and got.reason == "shutdown" and not blocker.done()
    assert time.perf_counter() - t0 < 2.0
    gate.set()
    closing.join(10)
    assert not closing.is_alive() and blocker.result(0).ok


def test_a_queued_request_is_answered_at_its_deadline_while_a_batch_runs_long(backend):
    """A user's pass: an admitted request whose deadline passed while the worker ran a long batch was answered only
    at that batch's end (32 ms past a 40 ms budget in a cold burst). The deadline watch answers it at its deadline,
    counted as a miss (dropped at deadline), while the batch still runs."""
    gate = threading.Event()
    lane = _lane(backend, gate)
    sched, blocker = _blocked(lane, np.random.default_rng(0))
    t0 = time.perf_counter()
    queued = sched.submit(text_request(np.random.default_rng(1), 8), 80, id="queued")
    assert lane.depth == 1  # admitted: the plan expected the running batch (1 ms) to be over
    got = queued.result(5)
    waited = time.perf_counter() - t0
    assert isinstance(got, Rejected) and got.reason == "deadline" and "deadline passed" in got.detail, got
    assert not blocker.done() and lane.depth == 0
    assert 0.08 <= waited < 0.5, waited
    m = lane.metrics.snapshot()
    assert m["dropped_at_deadline"] == 1 and m["admitted"] == 2
    gate.set()
    assert blocker.result(10).ok
    sched.close()
    assert sched.deadlines.expired == 1


def test_a_request_the_worker_leaves_queued_when_it_starts_a_batch_is_answered_at_its_deadline(backend):
    """The watch holds only requests that wait behind work (one wake-up of its thread per request, each at a
    deadline long met, took a core from running batches): one queued on an idle worker is not watched, and if the
    worker then starts a batch without it, it is watched from then on and still answered at its deadline."""
    gate = threading.Event()
    lane = _lane(backend, gate, max_batch=1)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)
    rng = np.random.default_rng(0)
    assert lane.warm.wait(5)
    with lane._cond:  # both arrive before the idle worker wakes: it takes the first and leaves the second queued
        first = sched.submit(text_request(rng, 8), 60, id="first")
        t0 = time.perf_counter()
        left = sched.submit(text_request(rng, 8), 150, id="left")
        assert lane.depth == 2 and not any(r.watched for _, r in lane._queue)
    got = left.result(5)
    waited = time.perf_counter() - t0
    assert isinstance(got, Rejected) and got.reason == "deadline" and "deadline passed" in got.detail, got
    assert 0.15 <= waited < 0.6 and not first.done(), waited  # at its deadline, while the first batch still runs
    gate.set()
    assert first.result(10).ok
    sched.close()
    assert sched.deadlines.expired == 1


def test_requests_closed_before_they_ran_are_not_counted_as_admitted(backend):
    """``metrics()``: "shutdown" is a refusal (in ``rejected_at_admission``), so not admitted as well; it had counted
    in both, and admitted plus refused came to more than submitted."""
    gate = threading.Event()
    lane = _lane(backend, gate)
    sched, blocker = _blocked(lane, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    queued = [sched.submit(text_request(rng, 8), 600_000) for _ in range(3)]
    closing = threading.Thread(target=sched.close, kwargs={"drain": False})
    closing.start()
    assert all(f.result(5).reason == "shutdown" for f in queued)
    gate.set()
    closing.join(10)
    assert blocker.result(0).ok
    m = lane.metrics.snapshot()
    assert (m["submitted"], m["admitted"], m["rejected_at_admission"]) == (4, 1, {"shutdown": 3})
    assert m["admitted"] + sum(m["rejected_at_admission"].values()) == m["submitted"]
    assert m["budget_miss_rate"] == 0.0 and m["in_flight"] == 0


def test_a_drain_timeout_stops_every_instance_at_once(backend):
    """Two instances of a variant, each inside a long batch with a request queued behind it: at the drain timeout
    both queued requests are refused "shutdown" while both batches still run (closed lane by lane, the second
    instance's queue waited for the first instance's batch to end, and kept starting batches meanwhile)."""
    gates = [threading.Event(), threading.Event()]
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 1.0, 0.0)
    prof.set(32, 8, 4.0, 0.0)
    layout = BatchLayout.of(*TEXT_IO)
    metrics = StreamMetrics()

    def runner(gate):
        def run(feed):
            gate.wait(10)
            return backend.run(feed)
        return run

    lanes = [Lane("fp32", runner(g), prof, layout, metrics, inline_ms=0.0, instance=i) for i, g in enumerate(gates)]
    sched = BudgetScheduler(lanes, layout, metrics)
    rng = np.random.default_rng(5)
    blockers = []
    for lane in lanes:
        blockers.append(sched.submit(text_request(rng, 8), 600_000, id=f"blocker{lane.instance}"))
        while lane._busy_until == 0.0:
            time.sleep(0.001)
    queued = [sched.submit(text_request(rng, 8), 600_000, id=f"queued{k}") for k in range(2)]
    assert [lane.depth for lane in lanes] == [1, 1]
    closing = threading.Thread(target=sched.close, kwargs={"timeout_s": 0.2})
    t0 = time.perf_counter()
    closing.start()
    got = [f.result(5) for f in queued]  # both, while both blockers still hold their backends
    assert all(isinstance(g, Rejected) and g.reason == "shutdown" for g in got)
    assert time.perf_counter() - t0 < 2.0 and not any(b.done() for b in blockers)
    for g in gates:
        g.set()
    closing.join(10)
    assert not closing.is_alive() and all(b.result(0).ok for b in blockers)


def test_a_batch_size_measured_slow_long_ago_is_tried_again(backend):
    """The worker picks the batch size of the best predicted rows per ms, and only picked sizes get measured: a size
    whose estimate rests on old samples is run once more (one request bigger than the pick) when it meets every
    member's deadline and takes the whole queue, at most once per ``explore_interval_ms``; without that a lane
    stayed at batch 1."""

    def batches(n: int, explore_ms: float) -> list[int]:
        gate = threading.Event()
        prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
        now = time.perf_counter()
        for _ in range(3):
            prof.observe(1, 8, 1.0, now)  # batch 1: fresh
            prof.observe(2, 8, 10.0, now - 5.0)  # batch 2: measured slow, 5 s ago (beyond the 1 s horizon)
        assert prof.recent_samples(1, 8) == 3 and prof.recent_samples(2, 8) == 0

        def run(feed):
            gate.wait(10)
            return backend.run(feed)

        lane = Lane("fp32", run, prof, BatchLayout.of(*TEXT_IO), StreamMetrics(), inline_ms=0.0,
                    explore_interval_ms=explore_ms)
        sched, blocker = _blocked(lane, np.random.default_rng(3))
        rng = np.random.default_rng(4)
        futs = [sched.submit(text_request(rng, 8), 10_000, id=i) for i in range(n)]
        gate.set()
        answers = [f.result(10) for f in futs]
        sched.close()
        assert blocker.result(10).ok and all(a.ok for a in answers)
        return [a.batch_size for a in answers]

    assert batches(2, 60_000.0) == [2, 2]
    # with three queued, a batch of 2 would leave one behind a batch its plan did not count on: first 1, then 2
    assert batches(3, 60_000.0) == [1, 2, 2]
    assert batches(2, math.inf) == [1, 1]


def test_edf_order_then_priority_on_ties(backend):
    gate = threading.Event()
    lane = _lane(backend, gate, max_batch=1, tie_ms=1e9)  # every deadline ties: priority then arrival decide
    rng = np.random.default_rng(0)
    sched, blocker = _blocked(lane, rng)
    order = []
    futs = [sched.submit(text_request(rng, 8), 10_000, priority=p, id=f"p{p}") for p in (0, 5, 1, 5)]
    for f in futs:
        f.add_done_callback(lambda f: order.append(f.result().id))
    gate.set()
    wait([blocker, *futs], timeout=10)
    assert order == ["p5", "p5", "p1", "p0"]
    sched.close()

    gate2 = threading.Event()
    lane2 = _lane(backend, gate2, max_batch=1)  # distinct deadlines: earliest first regardless of priority
    sched2, b2 = _blocked(lane2, rng)
    order2 = []
    futs2 = [sched2.submit(text_request(rng, 8), budget, priority=p, id=budget)
             for budget, p in ((9000, 9), (3000, 0), (6000, 0))]
    for f in futs2:
        f.add_done_callback(lambda f: order2.append(f.result().id))
    gate2.set()
    wait([b2, *futs2], timeout=10)
    assert order2 == [3000, 6000, 9000]
    sched2.close()


def test_batch_is_largest_that_meets_earliest_deadline(backend):
    gate = threading.Event()
    lane = _lane(backend, gate, max_batch=32)
    prof = lane.profile
    prof.set(4, 8, 1.0, 0.0)
    prof.set(5, 8, 300.0, 0.0)  # batches above 4 are predicted far too slow for a 200 ms budget
    prof.set(32, 8, 400.0, 0.0)
    sched, first = _blocked(lane, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    futs = [sched.submit(text_request(rng, 8), 200) for _ in range(10)]
    assert all(not f.done() for f in futs), [f.result() for f in futs if f.done()]  # admitted, behind the blocker
    gate.set()
    results = [f.result(10) for f in [first, *futs]]
    sizes = [r.batch_size for r in results[1:] if isinstance(r, Result)]
    assert max(sizes) == 4 and sum(1 for s in sizes if s == 4) >= 8  # 10 requests: 4 + 4 + 2
    sched.close()


def test_smaller_batch_chosen_when_clearly_more_rows_per_ms(backend):
    gate = threading.Event()
    lane = _lane(backend, gate, max_batch=32)
    for b, ms in ((1, 2.0), (4, 4.0), (8, 16.0), (32, 64.0)):  # 4 rows: 1 ms/row; 8 or more: 2 ms/row
        lane.profile.set(b, 8, ms, 0.0)
    sched, first = _blocked(lane, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    futs = [sched.submit(text_request(rng, 8), 10_000) for _ in range(8)]
    gate.set()
    sizes = [f.result(10).batch_size for f in futs]
    assert sizes == [4] * 8 and first.result(10).ok
    sched.close()


def test_lane_recovers_from_an_over_estimate(backend):
    """A slow backend, then a fast one: admissions resume (idle probes re-measure what is being refused)."""
    layout = BatchLayout.of(*TEXT_IO)
    slow = {"on": True}

    def run(feed):
        if slow["on"]:
            time.sleep(0.12)
        return backend.run(feed)

    lane = Lane("fp32", run, LatencyProfile("fp32"), layout, StreamMetrics(), max_batch=8,
                warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=8)
    assert lane.warm.wait(10)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    first = sched.submit(text_request(rng, 8), 50).result(10)
    assert isinstance(first, Rejected) and first.reason == "budget"  # 120 ms measured > 50 ms budget
    slow["on"] = False
    t0 = time.perf_counter()
    answered = None
    while time.perf_counter() - t0 < 8.0:  # generous: the estimate is corrected within about a second
        ans = sched.submit(text_request(rng, 8), 50).result(10)
        if isinstance(ans, Result):
            answered = time.perf_counter() - t0
            break
        time.sleep(0.02)
    assert answered is not None, lane.profile.to_dict()
    assert lane.probes >= 1
    print(f"admissions resumed {answered:.2f} s after the backend got fast ({lane.probes} probes)")
    sched.close()


def test_a_key_that_real_batches_measure_is_not_probed(backend):
    """Probes re-measure only what nothing else measures: a refused request whose (batch, bucket) keeps running in
    real batches is not run again (under overload such a probe is a run nobody asked for)."""
    layout = BatchLayout.of(*TEXT_IO)
    lane = Lane("fp32", backend.run, LatencyProfile("fp32"), layout, StreamMetrics(), max_batch=8,
                warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=8, probe_interval_ms=250.0,
                probe_after_ms=4000.0)
    assert lane.warm.wait(10)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    kinds = []
    while time.perf_counter() - t0 < 1.0:
        kinds.append(type(sched.submit(text_request(rng, 8), 50).result(10)).__name__)
        refused = sched.submit(text_request(rng, 8), 0.01).result(10)  # under its own run time: refused
        assert isinstance(refused, Rejected) and refused.reason == "budget"
        time.sleep(0.02)
    assert kinds and set(kinds) == {"Result"}
    # gaps of 20 ms between admissions (a tenth of probe_interval_ms, so a slow CI host keeps the lane taking):
    # the lane takes requests and real batches just measured the key
    assert lane.probes == 0
    t_last = time.perf_counter()
    while lane.probes == 0 and time.perf_counter() - t_last < 8.0:  # the lane takes nothing any more: real
        time.sleep(0.01)  # batches no longer measure, so it is re-measured once, without waiting probe_after_ms
    assert lane.probes == 1 and time.perf_counter() - t_last < 2.0  # two probe intervals, far under 4 s
    sched.close()


def test_a_lane_that_takes_nothing_is_probed_at_the_probe_interval(backend):
    """A kind measured by a real batch moments ago is still probed once the lane takes no request: after a cold
    start whose first samples were slow (timed against other backends' first runs) the tail sat over every budget,
    nothing was admitted, and waiting probe_after_ms since that batch refused everything for half a second."""
    layout = BatchLayout.of(*TEXT_IO)
    lane = Lane("fp32", backend.run, LatencyProfile("fp32", refresh_s=0.0), layout, StreamMetrics(), max_batch=8,
                warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=8, probe_interval_ms=50.0,
                probe_after_ms=3000.0, inline_ms=0.0)
    assert lane.warm.wait(10)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(0)
    assert isinstance(sched.submit(text_request(rng, 8), 5000).result(10), Result)  # a real batch of the kind
    for _ in range(5):
        lane.profile.observe(1, 8, 200.0)  # then its figures look slow
    t0 = time.perf_counter()
    answered = None
    while time.perf_counter() - t0 < 6.0:
        r = sched.submit(text_request(rng, 8), 50).result(10)
        if isinstance(r, Result):
            answered = time.perf_counter() - t0
            break
        assert r.reason == "budget"
        time.sleep(0.01)
    assert answered is not None and answered < 1.5, (answered, lane.probes)  # not after probe_after_ms (3 s)
    assert lane.probes >= 1, (answered, lane.profile.to_dict())
    sched.close()


def test_a_request_far_over_its_budget_is_not_kept_as_a_probe(backend):
    """Probing corrects a plausible over-estimate; a request predicted at 8x its budget is refused without one
    (an idle backend would pay its whole run: a 64 x 512-token MiniLM request took seconds and gigabytes)."""
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 400.0, 0.0)
    lane = Lane("fp32", backend.run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0,
                observe_warmup=False, probe_interval_ms=20.0)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    assert lane.warm.wait(10)
    rng = np.random.default_rng(0)
    far = sched.submit(text_request(rng, 8), 50).result(10)  # 400 ms expected alone: 8x its budget
    assert isinstance(far, Rejected) and far.reason == "budget"
    time.sleep(0.3)  # 15 probe intervals
    assert lane.probes == 0 and lane._refused is None
    near = sched.submit(text_request(rng, 8), 200).result(10)  # 2x: an over-estimate could explain it
    assert isinstance(near, Rejected) and near.reason == "budget"
    t0 = time.perf_counter()
    while lane.probes == 0 and time.perf_counter() - t0 < 8.0:
        time.sleep(0.01)
    assert lane.probes == 1
    sched.close()


def _heavy(tmp_path) -> tuple[OrtBackend, dict, float]:
    """A 1-thread backend of an 8-layer, 512-wide embedder, a 16 x 1024-token request for it, and how long that
    request took alone (ms): a run long enough to be stopped midway."""
    backend = OrtBackend(text_embedder(tmp_path / "heavy.onnx", dim=512, layers=8), threads=1)
    rng = np.random.default_rng(0)
    heavy = {"input_ids": rng.integers(1, 100, size=(16, 1024)), "attention_mask": np.ones((16, 1024), np.int64)}
    t0 = time.perf_counter()
    backend.run(heavy)
    return backend, heavy, (time.perf_counter() - t0) * 1e3


def test_a_probe_yields_to_a_request_that_comes_while_it_runs(tmp_path):
    """A probe re-measures a refused request nobody waits for: on ONNX Runtime it is stopped (RunOptions.terminate)
    by the first request queued on its lane, which is answered then, not after the probe (through dsedge serve, a
    refused 64 x 256-token request's probe refused every small request for 3 s)."""
    heavy_backend, heavy, full_ms = _heavy(tmp_path)  # full_ms: what the probe takes when nothing stops it
    layout = BatchLayout.of(*TEXT_IO)
    rng = np.random.default_rng(0)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(16, 1024, full_ms, 0.0)
    prof.set(1, 8, 2.0, 0.0)
    lane = Lane("fp32", heavy_backend.run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0,
                observe_warmup=False, probe_interval_ms=20.0)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    assert lane.warm.wait(10)
    refused = sched.submit(heavy, full_ms / 2).result(10)  # 2x its budget: an over-estimate could explain it
    assert isinstance(refused, Rejected) and refused.reason == "budget"
    t0 = time.perf_counter()
    def probing() -> bool:
        return getattr(lane, "_probing", None) is not None or lane._running

    while not probing() and time.perf_counter() - t0 < 5.0:
        time.sleep(0.002)
    assert probing(), "the refused request was not probed"
    time.sleep(min(0.05, full_ms / 1e3 / 10))  # the probe is on the backend
    t1 = time.perf_counter()
    small = sched.submit(text_request(rng, 8), 10_000).result(30)
    waited_ms = (time.perf_counter() - t1) * 1e3
    assert isinstance(small, Result) and small.ok, small
    assert waited_ms < full_ms / 3, (waited_ms, full_ms)  # not behind the probe's run
    assert lane.probes_cut == 1 and lane.probes == 0  # nothing observed from the cut run
    assert prof.predict(16, 1024, k_dev=0.0) == pytest.approx(full_ms)
    sched.close()
    print(f"small request answered in {waited_ms:.1f} ms during a {full_ms:.0f} ms probe (queued {small.queue_ms:.1f} ms)")


def test_a_request_joins_an_idle_instance_before_a_probing_one(tmp_path):
    """Stopping a probe waits for the kernel it is in (75-85 ms of one MatMul here): with another instance idle,
    the request goes there and the probe runs to its end."""
    layout = BatchLayout.of(*TEXT_IO)
    model = text_embedder(tmp_path / "heavy.onnx", dim=512, layers=8)
    first_backend, second_backend = OrtBackend(model, threads=1), OrtBackend(model, threads=1)
    rng = np.random.default_rng(0)
    heavy = {"input_ids": rng.integers(1, 100, size=(16, 1024)), "attention_mask": np.ones((16, 1024), np.int64)}
    t0 = time.perf_counter()
    first_backend.run(heavy)
    full_ms = (time.perf_counter() - t0) * 1e3
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(16, 1024, full_ms, 0.0)
    prof.set(1, 8, 2.0, 0.0)
    metrics = StreamMetrics()
    first = Lane("fp32", first_backend.run, prof, layout, metrics, max_batch=1, inline_ms=0.0, observe_warmup=False,
                 probe_interval_ms=20.0)
    second = Lane("fp32", second_backend.run, prof, layout, metrics, max_batch=1, inline_ms=0.0,
                  observe_warmup=False, probe_interval_ms=20.0, calibration=first.calibration, instance=1)
    sched = BudgetScheduler([first, second], layout, metrics)
    assert first.warm.wait(10) and second.warm.wait(10)
    assert isinstance(sched.submit(heavy, full_ms / 2).result(10), Rejected)
    t0 = time.perf_counter()
    while first._probing is None and time.perf_counter() - t0 < 5.0:
        time.sleep(0.002)
    assert first._probing is not None  # the refused request is probed on the first instance
    small = sched.submit(text_request(rng, 8), 10_000).result(30)
    assert isinstance(small, Result) and small.ok and small.queue_ms < full_ms / 3, small
    assert second.batches == 1 and first.batches == 0
    t0 = time.perf_counter()
    while first.probes == 0 and first.probes_cut == 0 and time.perf_counter() - t0 < 10.0:
        time.sleep(0.01)
    assert first.probes == 1 and first.probes_cut == 0  # measured, not cut
    sched.close()


def test_a_probe_never_waits_for_the_cores_ahead_of_a_real_batch(tmp_path):
    """A user's pass through dsedge serve: the fallback lane's probe waited for the cores an instance's probe held;
    as a waiting writer it kept the other instance's real batches off the cores (runtime/core_share.py), and small
    requests queued there missed 50 ms budgets for 3-5 s. A probe takes the cores only if they are free now."""
    from dsedge.runtime.scheduler import Request

    layout = BatchLayout.of(*TEXT_IO)
    model = text_embedder(tmp_path / "heavy.onnx", dim=512, layers=8)
    rng = np.random.default_rng(0)
    heavy = {"input_ids": rng.integers(1, 100, size=(16, 1024)), "attention_mask": np.ones((16, 1024), np.int64)}
    backends = [OrtBackend(model, threads=1) for _ in range(3)]
    t0 = time.perf_counter()
    backends[0].run(heavy)
    full_ms = (time.perf_counter() - t0) * 1e3

    def profile() -> LatencyProfile:
        prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
        prof.set(16, 1024, full_ms, 0.0)
        prof.set(1, 8, 2.0, 0.0)
        return prof

    metrics, shared = StreamMetrics(), profile()
    opts = dict(max_batch=1, inline_ms=0.0, observe_warmup=False, probe_interval_ms=20.0)
    first = Lane("fp32", backends[0].run, shared, layout, metrics, **opts)
    second = Lane("fp32", backends[1].run, shared, layout, metrics, calibration=first.calibration, instance=1,
                  **opts)
    spare = Lane("fp32", backends[2].run, profile(), layout, metrics, fallback=True, **opts)
    sched = BudgetScheduler([first, second, spare], layout, metrics)
    assert first.share is spare.share is not None
    for lane in (first, second, spare):
        assert lane.warm.wait(10)

    def refused_heavy() -> Request:
        now = time.perf_counter()
        return Request("heavy", heavy, 16, 1024, layout.group_key(heavy), full_ms / 2, 0, now, now + full_ms / 2e3)

    first.refused(refused_heavy())  # the first instance probes it, on the cores shared with the second
    t0 = time.perf_counter()
    while first._probing is None and time.perf_counter() - t0 < 5.0:
        time.sleep(0.002)
    assert first._probing is not None
    spare.refused(refused_heavy())  # the fallback's probe would need the cores alone
    time.sleep(0.1)
    small = sched.submit(text_request(rng, 8), 10_000).result(30)  # joins the idle second instance
    assert isinstance(small, Result) and small.ok and small.queue_ms < full_ms / 3, (small.queue_ms, full_ms)
    assert second.batches == 1
    sched.close()


def test_a_request_cancelled_while_queued_never_runs_and_is_counted_cancelled(backend):
    """A user's pass: Future.cancel() returned True on queued requests, yet every one of them ran and was counted
    an answer within budget. Cancelled while queued, a request is dropped unrun; once its batch starts, cancel()
    returns False and the answer comes (concurrent.futures' rule)."""
    from concurrent.futures import CancelledError

    layout = BatchLayout.of(*TEXT_IO)
    gate, rows_run = threading.Event(), []

    def run(feed):
        gate.wait(20)
        rows_run.append(len(feed["input_ids"]))
        return backend.run(feed)

    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 5.0, 0.0)
    lane = Lane("fp32", run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0, observe_warmup=False)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    assert lane.warm.wait(10)
    rng = np.random.default_rng(0)
    running = sched.submit(text_request(rng, 8), 600_000, id="running")
    while not lane._running:
        time.sleep(0.001)
    queued = [sched.submit(text_request(rng, 8), 600_000, id=i) for i in range(6)]
    assert not running.cancel()  # on the backend: too late
    assert all(f.cancel() for f in queued[::2])  # three cancelled while queued
    gate.set()
    assert running.result(10).ok
    for i, f in enumerate(queued):
        if i % 2 == 0:
            with pytest.raises(CancelledError):
                f.result(10)
        else:
            assert f.result(10).ok
    sched.close()
    assert len(rows_run) == 1 + 3  # the cancelled three never ran
    m = lane.metrics.snapshot()
    assert m["cancelled"] == 3 and m["answered"] == 4 and m["within_budget"] == 4 and m["in_flight"] == 0, m


def test_first_submit_does_not_wait_for_warm_up(backend):
    """The lane warms up on its own thread; a request arriving meanwhile is queued with its own deadline."""
    layout = BatchLayout.of(*TEXT_IO)
    started = threading.Event()

    def run(feed):
        started.set()
        time.sleep(0.3)  # a slow first run (ORT allocating, a big model)
        return backend.run(feed)

    t0 = time.perf_counter()
    lane = Lane("fp32", run, LatencyProfile("fp32"), layout, StreamMetrics(),
                warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=8)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    started.wait(5)
    fut = sched.submit(text_request(np.random.default_rng(0), 8), 10_000)
    assert time.perf_counter() - t0 < 0.25 and not fut.done()  # returned at once, queued behind the warm-up
    ans = fut.result(10)
    assert isinstance(ans, Result) and ans.ok and ans.queue_ms > 50  # it waited on the worker, not the caller
    sched.close()


def test_misses_are_counted_and_lateness_from_queueing_moves_no_estimate(backend):
    gate = threading.Event()
    lane = _lane(backend, gate, max_batch=1)
    lane.profile.set(1, 64, 1.0, 0.0)
    rng = np.random.default_rng(0)
    sched = BudgetScheduler([lane], lane.layout, lane.metrics)
    blocker = sched.submit(text_request(rng, 64), 60_000, id="blocker")  # another length bucket
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    before = lane.predict(1, 8)
    victims = [sched.submit(text_request(rng, 8), 150) for _ in range(5)]  # admitted: predicted 1 ms each
    assert not any(f.done() for f in victims)
    time.sleep(0.4)  # the blocker overruns; their deadlines pass in the queue
    gate.set()
    answers = [f.result(10) for f in victims]
    assert blocker.result(10).ok
    assert all(isinstance(a, Rejected) and a.reason == "deadline" and a.admitted for a in answers)
    assert lane.predict(1, 8) == before  # their lateness came from queueing: their estimate did not move
    m = lane.metrics.snapshot()
    assert m["admitted"] == 6 and m["dropped_at_deadline"] == 5 and m["budget_missed"] == 5
    assert m["rejected_at_admission"] == {} and m["budget_miss_rate"] == pytest.approx(5 / 6, abs=1e-4)
    # an answer over its budget is a miss too
    gate2 = threading.Event()
    slow_lane = _lane(backend, gate2, max_batch=1)
    sched2 = BudgetScheduler([slow_lane], slow_lane.layout, slow_lane.metrics)
    late = sched2.submit(text_request(rng, 8), 100)
    time.sleep(0.2)
    gate2.set()
    ans = late.result(10)
    assert isinstance(ans, Result) and ans.ok and not ans.within_budget
    m2 = slow_lane.metrics.snapshot()
    assert m2["answered_late"] == 1 and m2["budget_missed"] == 1 and m2["budget_miss_rate"] == 1.0
    sched.close()
    sched2.close()


def test_a_timed_warm_up_run_is_not_timed_against_another_lanes_first_run(backend):
    """Lanes of one session warm up together: each timed warm-up run waits until no lane is in its first
    (allocating) run and no other is timing, so the first samples are each backend's own."""
    from dsedge.runtime.scheduler import WarmUpGate

    layout = BatchLayout.of(*TEXT_IO)
    calls: dict[str, list[tuple[float, float]]] = {"slow": [], "fast": []}
    lock = threading.Lock()

    def recorded(name: str, first_extra_s: float):
        def run(feed):
            t0 = time.perf_counter()
            if first_extra_s and not calls[name]:
                time.sleep(first_extra_s)  # a first run that allocates for a while
            out = backend.run(feed)
            with lock:
                calls[name].append((t0, time.perf_counter()))
            return out
        return run

    gate = WarmUpGate()
    lanes = [Lane("fp32", recorded(name, extra), LatencyProfile("fp32"), layout, StreamMetrics(), max_batch=8,
                  warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=8, warm_gate=gate)
             for name, extra in (("slow", 0.3), ("fast", 0.0))]
    assert all(lane.warm.wait(10) for lane in lanes)
    (slow_first, slow_timed), (fast_first, fast_timed) = calls["slow"], calls["fast"]
    assert fast_first[1] < slow_first[1]  # the fast lane's first run ended well before the slow one's …
    assert fast_timed[0] >= slow_first[1]  # … and its timed run waited for it
    assert fast_timed[0] >= slow_timed[1] or slow_timed[0] >= fast_timed[1]  # one timed run at a time
    assert all(lane.profile.to_dict()["points"] for lane in lanes)  # both were timed
    for lane in lanes:
        lane.close()


def test_the_miss_rate_is_over_requests_that_ran_or_were_dropped_not_those_their_callers_cancelled():
    """A user's pass: 20 cancelled while queued beside 12 answered (2 late) gave budget_miss_rate 2/32; a cancelled
    request neither kept nor broke its budget, so the rate is 2/12."""
    m = StreamMetrics()
    for i in range(32):
        m.on_submit()
    for i in range(20):
        m.on_cancelled()
    for i in range(12):
        m.on_answer(Result(i, {}, 150.0 if i < 2 else 5.0, 0.0, 1, "fp32", budget_ms=100.0))
    snap = m.snapshot()
    assert snap["admitted"] == 32 and snap["cancelled"] == 20 and snap["budget_missed"] == 2
    assert snap["budget_miss_rate"] == pytest.approx(2 / 12, abs=1e-4)
    m2 = StreamMetrics()  # all cancelled: no rate to speak of
    m2.on_submit()
    m2.on_cancelled()
    assert m2.snapshot()["budget_miss_rate"] == 0.0


@pytest.mark.parametrize("how", ["no drain", "drain timeout"])
def test_close_without_draining_stops_a_long_running_batch(tmp_path, how):
    """A user's pass: two 64 x 512-token MiniLM batches held ``close(drain=False)`` for 15 s ("a running batch
    finishes first"). On ONNX Runtime a batch expected to take longer than ``cut_after_ms`` runs stoppable: closing
    without draining (or a drain whose time is up) stops it between two kernels and refuses its request
    "shutdown"; a short batch still runs to its end."""
    heavy_backend, heavy, full_ms = _heavy(tmp_path)
    layout = BatchLayout.of(*TEXT_IO)
    assert full_ms > 200, full_ms  # long enough to see a cut
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(16, 1024, full_ms, 0.0)
    lane = Lane("fp32", heavy_backend.run, prof, layout, StreamMetrics(), max_batch=1, inline_ms=0.0,
                observe_warmup=False)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    assert lane.warm.wait(10)
    running = sched.submit(heavy, 600_000)
    while not lane._running:
        time.sleep(0.001)
    time.sleep(min(0.05, full_ms / 1e3 / 10))  # on the backend
    t1 = time.perf_counter()
    if how == "no drain":
        sched.close(drain=False)
    else:
        sched.close(drain=True, timeout_s=0.01)
    closed_ms = (time.perf_counter() - t1) * 1e3
    got = running.result(0)
    assert isinstance(got, Rejected) and got.reason == "shutdown" and "stopped while running" in got.detail, got
    assert closed_ms < full_ms / 2, (closed_ms, full_ms)
    assert lane.metrics.snapshot()["rejected"] == {"shutdown": 1}
