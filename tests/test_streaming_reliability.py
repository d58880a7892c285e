"""Reliability: overload (every request answered or rejected, memory bounded), backend errors, shutdown."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import dsedge
from dsedge import Rejected, Result

from streaming_models import text_bundle, text_request

# The full check is 3x overload for 30 s; CI runs a shorter window (every request is still counted).
OVERLOAD_S = float(os.environ.get("DSEDGE_OVERLOAD_S", "3"))


@pytest.fixture(scope="module")
def heavy_bundle(tmp_path_factory):
    # dim 384 × 3 layers: milliseconds per batch on one thread, so 3× capacity is a rate Python can submit
    return text_bundle(tmp_path_factory.mktemp("heavy") / "b", dim=384, variants={"fp32": 3}, name="toy-heavy")


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    return text_bundle(tmp_path_factory.mktemp("small") / "b", budget_ms=1000)


def _capacity_per_s(session, pool) -> float:
    """Requests/s the session really serves, closed loop: a burst of 2 full batches with a generous budget."""
    n = 2 * session._core().lanes[0].max_batch
    t0 = time.perf_counter()
    answers = [f.result(60) for f in [session.submit(pool[i % len(pool)], budget_ms=60_000) for i in range(n)]]
    assert all(a.ok for a in answers)
    return n / (time.perf_counter() - t0)


@pytest.mark.slow
def test_overload_every_request_answered_or_rejected_and_memory_bounded(heavy_bundle):
    seq, budget, max_queue = 16, 150.0, 64
    s = dsedge.load(heavy_bundle, threads=1, budget_ms=budget, max_queue=max_queue)
    s.warmup()
    rng = np.random.default_rng(0)
    pool = [text_request(rng, seq) for _ in range(64)]
    rate = 3.0 * _capacity_per_s(s, pool)
    before = s.metrics()
    futures = []
    t0 = time.perf_counter()
    next_t = t0
    while time.perf_counter() - t0 < OVERLOAD_S:  # open loop: Poisson arrivals at 3× capacity, late ones sent at once
        now = time.perf_counter()
        if next_t > now:
            time.sleep(next_t - now)
        futures.append(s.submit(pool[len(futures) % len(pool)]))
        next_t += rng.exponential(1.0 / rate)
    for f in futures[-200:]:
        f.result(timeout=30)
    # the overload is over: the session serves again (within a few tries on a noisy shared CI machine)
    after_answers = []
    for _ in range(20):
        after_answers.append(s.submit(pool[0]).result(timeout=30))
        if isinstance(after_answers[-1], Result) and after_answers[-1].ok:
            break
        time.sleep(0.25)
    after = after_answers[-1]
    assert isinstance(after, Result) and after.ok, after_answers
    late_rejections = sum(isinstance(a, Rejected) for a in after_answers)
    futures.append(s.submit(pool[1]))
    s.close(drain=True)
    answers = [f.result(timeout=0) for f in futures]  # close() resolved every future: none may be pending
    n = len(futures)
    results = [a for a in answers if isinstance(a, Result)]
    rejected = [a for a in answers if isinstance(a, Rejected)]
    assert n > 50 and len(results) + len(rejected) == n  # every request answered or rejected, none lost
    assert len(rejected) > 0 and {r.reason for r in rejected} <= {"overload", "deadline", "budget"}
    assert all(r.ok for r in results) and len(results) > 0
    m = s.metrics()
    assert m["submitted"] - before["submitted"] == n + len(after_answers) and m["in_flight"] == 0
    assert m["answered"] - before["answered"] == len(results) + len(after_answers) - late_rejections
    assert sum(m["rejected"].values()) - sum(before["rejected"].values()) == len(rejected) + late_rejections
    lane = m["lanes"]["fp32"]
    assert lane["queue_depth"] == 0 and lane["max_queue_depth"] <= max_queue  # bounded queue
    assert len(s._metrics._lat) <= s._metrics._lat.maxlen  # bounded latency window
    # admitted work mostly meets its budget even at 3× overload (loose: CI machines are shared and noisy; the
    # 99.5 % goal is measured by benchmarks/streaming.py)
    admitted = len(results) + sum(r.reason == "deadline" for r in rejected)
    print(f"overload {OVERLOAD_S:g} s at {rate:.0f}/s: {n} sent, {len(results)} answered "
          f"({sum(r.within_budget for r in results)} within budget), rejected {m['rejected']}, "
          f"max queue {lane['max_queue_depth']}/{max_queue}")
    assert sum(r.within_budget for r in results) >= 0.5 * admitted, m


def test_backend_error_fails_only_its_batch_and_session_keeps_serving(small_bundle):
    import dataclasses

    rng = np.random.default_rng(1)
    with dsedge.load(small_bundle, threads=1) as s:
        # the session checks ids against the embedding table it reads from the graph; taken off, so that the bad
        # id reaches ONNX Runtime and fails its batch there
        with pytest.raises(dsedge.InputError, match="outside the model's range"):
            s.submit(text_request(rng, 8, bad=True))
        s.inputs = [dataclasses.replace(i, value_range=None) for i in s.inputs]
        s.warmup()
        reqs = [text_request(rng, 8, bad=(i == 10)) for i in range(40)]
        answers = [f.result(10) for f in [s.submit(r, id=i) for i, r in enumerate(reqs)]]
        bad = answers[10]
        assert isinstance(bad, Result) and not bad.ok and bad.outputs == {}
        assert "indices" in bad.error.lower() or "gather" in bad.error.lower(), bad.error
        assert all(isinstance(a, Result) for a in answers)
        failed = [a for a in answers if not a.ok]
        assert len(failed) == bad.batch_size  # only the requests sharing its batch fail
        assert all(a.batch_size == bad.batch_size for a in failed)
        assert sum(a.ok for a in answers) == 40 - bad.batch_size
        after = s.submit(text_request(rng, 8)).result(10)  # the session keeps serving
        assert after.ok and after.outputs["sentence_embedding"].shape == (1, 64)
        m = s.metrics()
        assert m["errors"] == bad.batch_size and m["answered"] == 41


def test_close_drains_pending_work(small_bundle):
    rng = np.random.default_rng(2)
    s = dsedge.load(small_bundle, threads=1)
    futs = [s.submit(text_request(rng, 32), budget_ms=5000) for _ in range(60)]
    s.close()  # drain=True by default
    assert all(f.done() for f in futs)
    assert all(isinstance(f.result(), Result) and f.result().ok for f in futs)
    with pytest.raises(dsedge.SessionClosedError):
        s.submit(text_request(rng, 4))
    with pytest.raises(dsedge.SessionClosedError):
        list(s.stream([text_request(rng, 4)]))
    s.close()  # idempotent


def test_close_without_drain_rejects_pending_explicitly(small_bundle):
    rng = np.random.default_rng(3)
    s = dsedge.load(small_bundle, threads=1, max_batch=1)
    s.warmup()
    lane = s._core().lanes[0]
    gate = threading.Event()
    real_run = lane.run
    lane.run = lambda feed: (gate.wait(10), real_run(feed))[1]  # hold the worker inside the first batch
    futs = [s.submit(text_request(rng, 8), budget_ms=60_000) for _ in range(30)]
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    closer = threading.Thread(target=s.close, kwargs={"drain": False})
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(10)
    answers = [f.result(timeout=0) for f in futs]
    shut = [a for a in answers if isinstance(a, Rejected)]
    assert answers[0].ok  # the batch already running finishes
    assert len(shut) >= 25 and all(a.reason == "shutdown" for a in shut)
    assert len(shut) + sum(isinstance(a, Result) for a in answers) == 30


def test_context_manager_drains_on_exit(small_bundle):
    rng = np.random.default_rng(4)
    with dsedge.load(small_bundle, threads=1) as s:
        futs = [s.submit(text_request(rng, 16), budget_ms=5000) for _ in range(20)]
    assert all(f.done() and f.result().ok for f in futs)
