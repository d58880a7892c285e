"""Runs on the caller's thread (``Lane.try_inline``) for callers that keep the interpreter lock busy, on a real ONNX
Runtime session of a tiny model: an open-loop caller spinning between submits, a closed loop whose worker-side
samples were slow, and an open-loop caller's done-callbacks."""
from __future__ import annotations

import time

import numpy as np
import pytest

import dsedge
from dsedge.runtime.scheduler import Answer

from streaming_models import static_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return static_bundle(tmp_path_factory.mktemp("inline") / "static")


def _x(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 8), float(i), dtype=np.float32)}


def test_result_read_in_a_done_callback_is_no_wait():
    """A callback added to a future already done runs at once on the caller's thread; its ``result()`` does not
    make the caller a closed loop (it had made every next request of an open-loop caller run on its thread)."""
    done = Answer()
    done.set_result("answer")
    seen = []
    done.add_done_callback(lambda f: seen.append(f.result()))
    assert seen == ["answer"] and not done.waited
    pending = Answer()
    pending.add_done_callback(lambda f: seen.append(f.result()))
    assert not pending.waited
    assert done.result() == "answer" and done.waited  # the caller itself asking is a wait


def test_spinning_open_loop_caller_gets_inline_runs(bundle):
    """A caller that holds the interpreter lock between submits (parsing, features: Python work) and never waits
    for an answer: each hand-off to the worker waits for the lock's switch interval (ms) while the run takes µs,
    so the lane runs such requests on the caller's thread. Before, all but one went to the worker."""
    with dsedge.load(bundle, threads=1) as s:
        for i in range(20):  # warm: a closed loop
            assert s.submit(_x(i), budget_ms=1000).result(10).ok
        before = s.metrics()["lanes"]["fp32"]["inline"]
        futs, answers = [], []
        for i in range(400):
            t_end = time.perf_counter() + 0.0003
            while time.perf_counter() < t_end:  # the caller's own Python work, holding the lock
                pass
            f = s.submit(_x(i), budget_ms=1000)
            f.add_done_callback(answers.append)  # open loop: answers taken in callbacks
            futs.append(f)
        assert all(f.result(10).ok for f in futs)
        np.testing.assert_allclose(futs[123].result().outputs["y"], s.run(_x(123))["y"], rtol=1e-6)
        inline = s.metrics()["lanes"]["fp32"]["inline"] - before
        assert inline >= 200, s.metrics()["lanes"]
        assert len(answers) == 400


def test_inline_run_is_not_refused_by_the_workers_slow_samples(bundle):
    """The worker's samples hold its waits for the interpreter lock, which a run on the caller's thread never
    has; a closed-loop request is judged by the caller-thread runs' own times. Before, the worker's tail refused
    every request ("budget"), and with nothing admitted nothing measured it again."""
    with dsedge.load(bundle, threads=1) as s:
        for i in range(20):
            assert s.submit(_x(i), budget_ms=1000).result(10).ok
        lane = s._stream.scheduler.lanes[0]
        assert lane.inline_profile.measured
        for _ in range(64):  # the worker's window: 200 ms a batch (lock waits behind a busy caller)
            lane.profile.observe(1, None, 200.0)
        answers = [s.submit(_x(i), budget_ms=20).result(10) for i in range(30)]
        assert all(a.ok for a in answers), [a for a in answers if not a.ok][:2]
        assert s.metrics()["rejected"].get("budget", 0) == 0


def test_figures_of_a_model_without_a_sequence_axis_are_keyed_without_a_length():
    """``dsedge build`` records each figure's input shapes; for the fraud scorer, ``dense`` [1, 29] is a feature
    width, not a length: keyed under bucket 32, its figures stood where none of its requests looks, and a run on
    the caller's thread had no build-time figure to start from."""
    from dsedge.runtime.bundle import Variant
    from dsedge.runtime.latency_profile import LatencyProfile

    v = Variant("int4", "int4", "m.onnx", latency_ms={"1": {"p50": 0.011, "p99": 0.013, "n": 50,
                                                            "shape": {"dense": [1, 29], "sparse_ids": [1, 4]}}})
    assert set(LatencyProfile.from_variant(v).points()) == {(1, 32)}  # a text model's reading
    p = LatencyProfile.from_variant(v, sequence=False)
    assert set(p.points()) == {(1, 0)}
    assert p.seed_times(1) == pytest.approx((0.011, 0.013))
    assert p.seed_times(1, None) == p.times(1, None)


def test_open_loop_request_the_workers_times_would_refuse_runs_inline(bundle):
    """An open-loop caller whose worker-side samples are slow (lock waits behind a busy caller): its short requests
    run on its thread instead of being refused for their budget. Before, such a request went to the worker path
    to measure a hand-off, was refused there ("budget") and measured nothing, and the lane refused every request
    for 1–1.5 s at a time (fraud scorer, 7200 requests/s)."""
    with dsedge.load(bundle, threads=1) as s:
        for i in range(20):
            assert s.submit(_x(i), budget_ms=1000).result(10).ok
        lane = s._stream.scheduler.lanes[0]
        for _ in range(64):
            lane.profile.observe(1, None, 200.0)
        time.sleep(0.6)  # the latest hand-off measured is older than 0.5 s: due again (and the samples count)
        assert lane.profile.predict(1) == pytest.approx(200.0)
        before = lane.inline
        futs = []
        for i in range(50):
            futs.append(s.submit(_x(i), budget_ms=20))  # never waited for: an open loop
            time.sleep(0.001)
        answers = [f.result(10) for f in futs]
        assert all(a.ok for a in answers), [a for a in answers if not a.ok][:2]
        assert lane.inline - before >= 45, s.metrics()["lanes"]


def test_a_failed_worker_thread_answers_what_it_held_and_refuses_the_rest(bundle):
    """A bug in the worker (not a backend error: those fail their batch only) used to end its thread and leave every
    request it held unanswered: ``Session.stream`` waited forever (a user's pass). Its requests are now answered
    "shutdown", naming the failure, and later ones are refused at once."""
    import threading

    with dsedge.load(bundle, threads=1) as s:
        assert s.submit(_x(0), budget_ms=1000).result(10).ok
        lane = s._stream.scheduler.lanes[0]

        def broken(*args, **kwargs):
            raise TypeError("a bug")

        lane._mark_running = broken  # the worker calls it for each batch it picks
        hook, threading.excepthook = threading.excepthook, lambda args: None  # the thread's own report: not here
        try:
            futs = [s.submit(_x(i), budget_ms=1000) for i in range(5)]  # open loop: queued for the worker
            answers = [f.result(5) for f in futs]
        finally:
            threading.excepthook = hook
        assert not any(a.ok for a in answers)
        assert {a.reason for a in answers} == {"shutdown"}
        assert all("failed (TypeError: a bug)" in a.detail for a in answers), answers[0].detail
        later = s.submit(_x(9), budget_ms=1000).result(5)
        assert later.reason == "shutdown" and "load the bundle again" in later.detail


def test_a_few_slow_inline_runs_do_not_end_inline_running(bundle):
    """Runs on the caller's thread are judged by their lower quartile: some wait for the interpreter lock behind the
    worker (its warm-up, a batch), and a median over such samples had stopped inline runs for good, nothing then
    measuring them again, while the worker's own times refused every request (3 of 2000 answered)."""
    with dsedge.load(bundle, threads=1) as s:
        for i in range(20):
            assert s.submit(_x(i), budget_ms=1000).result(10).ok
        lane = s._stream.scheduler.lanes[0]
        for i in range(64):  # 60 % of the caller-thread runs waited 5 ms for the lock
            lane.inline_profile.observe(1, None, 5.0 if i % 5 < 3 else 0.03)
            lane.profile.observe(1, None, 200.0)
        time.sleep(0.6)
        answers = []
        for i in range(40):
            answers.append(s.submit(_x(i), budget_ms=20))  # an open loop
            time.sleep(0.001)
        answers = [f.result(10) for f in answers]
        assert all(a.ok for a in answers), [a for a in answers if not a.ok][:2]


def test_first_open_loop_request_with_a_budget_under_the_plans_floor_runs_inline(bundle):
    """A user's pass: after ``warmup()``, the first request with a 0.9 ms budget on a model that runs in µs was refused
    ("predicted 1.0 ms alone on idle … at its tail"): the worker's plan adds the spread's 0.5 ms floor and the 0.5 ms
    margin, while ``try_inline`` judged the worker by its tail alone, found it would take the request, and sent it
    there (``dsedge serve`` of the fraud bundle answered its first request 503). The worker's verdict is now the
    plan's own: the request runs on the caller's thread."""
    with dsedge.load(bundle, threads=1) as s:
        s.warmup()
        lane = s._stream.scheduler.lanes[0]
        assert lane.profile.predict(1) < 0.2  # ms: the model runs in µs here
        first = s.submit(_x(0), budget_ms=0.9)  # never waited for before: an open loop
        answer = first.result(10)
        assert answer.ok, answer
        assert lane.inline == 1


def test_one_slow_inline_sample_does_not_end_inline_runs_for_an_open_loop_caller(bundle):
    """The inline runs' estimate is the median of their last samples, and an open-loop caller's request runs inline
    only under 0.25 ms: one slow first sample (0.33 ms, a run that met the worker's cold first run) sent every later
    request to the worker, and nothing ran inline again to sample it (a spinning caller at 4000/s: 68 % in budget,
    against 96). With fewer than ``min_samples`` recent samples the estimate is measured again inline."""
    with dsedge.load(bundle, threads=1) as s:
        s.warmup()
        lane = s._stream.scheduler.lanes[0]
        lane.inline_profile.observe(1, None, 0.4, now=time.perf_counter() - 2.0)  # 2 s old, over the limit
        assert lane.inline_profile.predict(1, None, k_dev=0.0) == pytest.approx(0.4)
        # hand-offs to the worker measured slow just now (its waits for the lock behind this caller): were the
        # estimate under the limit, the requests would run here
        lane._handoffs.extend([(time.perf_counter(), 5.0)] * 5)
        futs = []
        for i in range(200):
            t_end = time.perf_counter() + 0.0003
            while time.perf_counter() < t_end:  # the caller's own Python work: an open loop that holds the lock
                pass
            futs.append(s.submit(_x(i), budget_ms=1000))
        assert all(f.result(10).ok for f in futs)
        # (0 before: every one went to the worker); at least the min_samples runs that measure it again, then as
        # many as those runs say (fast here, unless this host was slow for them: then again in a second)
        assert lane.inline >= lane.inline_profile.min_samples, s.metrics()["lanes"]
        assert lane.inline_profile.recent_samples(1, None) >= lane.inline_profile.min_samples
