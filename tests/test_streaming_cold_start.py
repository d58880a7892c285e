"""Cold start of the budgeted lanes, on real ORT sessions of a tiny model built here: what the first requests meet
before and during the workers' warm-up (a user's pass, 2026-12-06)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsedge.runtime.backends.ort import OrtBackend
from dsedge.runtime.batching import BatchLayout, example_feed
from dsedge.runtime.latency_profile import LatencyProfile
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.scheduler import BudgetScheduler, Lane, WarmUpGate

from streaming_models import text_embedder, text_request
from test_streaming_parts import TEXT_IO

LAYOUT = BatchLayout.of(*TEXT_IO)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return OrtBackend(text_embedder(tmp_path_factory.mktemp("cold") / "m.onnx", dim=32), threads=1)


def _seeded() -> LatencyProfile:
    prof = LatencyProfile("fp32", scale_seeds=False)
    prof.set(1, 8, 1.0, 0.0)
    return prof


def test_the_deadline_watch_starts_with_the_scheduler_not_inside_a_later_submit(backend):
    """Started from the first queued request, the watch's thread waited for the interpreter lock behind the lanes'
    warming workers inside that request's ``submit()`` (0.6-7.4 ms of a first submit of up to 16 ms). It starts
    with the scheduler now, before any request; ``close`` ends it."""
    lane = Lane("fp32", backend.run, _seeded(), LAYOUT, StreamMetrics(), inline_ms=0.0)
    sched = BudgetScheduler([lane], LAYOUT, lane.metrics)
    watch = sched.deadlines._thread
    assert watch is not None and watch.is_alive() and watch.name == "dsedge-deadlines"
    assert lane.metrics.snapshot()["submitted"] == 0  # before any request
    sched.close()
    assert not watch.is_alive()


def test_a_lane_waiting_to_time_its_warm_up_serves_a_request_queued_meanwhile_at_once(backend):
    """Another lane is in its first (allocating) run, so this lane's timed warm-up run waits (``WarmUpGate``). A
    request queued on it wakes the gate: it runs then, not when the other's first run ends or the gate next polls
    (here 60 s, so only the wake lets it through)."""
    first_runs = []

    def run(feed):
        out = backend.run(feed)
        first_runs.append(feed["input_ids"].shape[1])
        return out

    gate = WarmUpGate(poll_s=60.0)
    other = gate.first_run()
    other.__enter__()  # another lane's first run, held for the whole test
    try:
        lane = Lane("fp32", run, _seeded(), LAYOUT, StreamMetrics(), inline_ms=0.0, warm_gate=gate,
                    warm_feed=lambda b, s: example_feed(LAYOUT, b, s), warm_seq=8, warm_quiet_ms=60_000)
        sched = BudgetScheduler([lane], LAYOUT, lane.metrics)
        deadline = time.perf_counter() + 10
        while not first_runs:  # the lane's own first run, then it waits to time the next one
            assert time.perf_counter() < deadline, "the lane never ran its first warm-up run"
            time.sleep(0.005)
        time.sleep(0.2)  # into the gate's wait
        assert not lane.warm.is_set()
        t0 = time.perf_counter()
        got = sched.submit(text_request(np.random.default_rng(0), 16), 30_000).result(10)
        assert got.ok, got
        assert time.perf_counter() - t0 < 5.0 and lane.warm.is_set()
        assert first_runs == [8, 16]  # the timed warm-up run was skipped for the request
        sched.close()
    finally:
        other.__exit__(None, None, None)


def test_a_request_queued_before_the_worker_starts_runs_first_and_untimed(backend):
    """The caller's first submit queues before the lane's worker runs (a session's workers wait for every lane to
    exist). That request is the backend's first run: it goes before any warm-up run, and its time (a first run
    allocates) is not taken as a sample of the profile; the runs after it are."""
    calls: list[str] = []

    def run(feed):
        calls.append("warm" if int(feed["input_ids"][0, 0]) == 1 and feed["input_ids"].shape[1] == 8 else "request")
        return backend.run(feed)

    start = threading.Event()
    prof = _seeded()
    lane = Lane("fp32", run, prof, LAYOUT, StreamMetrics(), inline_ms=0.0, start_gate=start,
                warm_feed=lambda b, s: {k: np.ones((b, s), np.int64) for k in ("input_ids", "attention_mask")},
                warm_seq=8)
    sched = BudgetScheduler([lane], LAYOUT, lane.metrics)
    first = text_request(np.random.default_rng(0), 16)
    first["input_ids"][0, 0] = 7
    fut = sched.submit(first, 30_000)
    assert lane.depth == 1  # queued: the worker has not started
    start.set()
    assert fut.result(10).ok
    assert calls == ["request"] and lane.warm.is_set()
    assert prof.samples(1, 16) == 0  # the first run said nothing of the next ones
    second = text_request(np.random.default_rng(1), 16)
    second["input_ids"][0, 0] = 7
    assert sched.submit(second, 30_000).result(10).ok
    assert calls == ["request", "request"] and prof.samples(1, 16) == 1
    sched.close()


def test_a_sessions_workers_start_once_the_first_request_is_queued_or_after_a_grace():
    """``StartGate``: let go as soon as every lane existed, the workers (pinning, warming up: up to four compute
    threads on 2 cores) took the interpreter lock and the cores from the caller's first submit, which then took
    2-8 ms (MiniLM, over 5 ms in 5 of 16 loads); they wait for it to queue its request now (1.5-2.2 ms)."""
    from dsedge.runtime.streaming import StartGate

    gate = StartGate(grace_s=60.0)
    worker = threading.Thread(target=gate.wait)
    worker.start()
    gate.open()  # every lane exists: still waiting for the first request
    worker.join(0.3)
    assert worker.is_alive()
    gate.submitted()
    worker.join(5)
    assert not worker.is_alive()
    quick = StartGate(grace_s=0.05)  # a core built by warmup(): no request comes, the workers go after the grace
    quick.open()
    t0 = time.perf_counter()
    quick.wait()
    assert 0.04 <= time.perf_counter() - t0 < 2.0


def test_a_refusal_says_how_much_of_its_budget_was_gone_before_admission(backend):
    """A first submit builds the session's lanes (1.5-3 ms) inside the request's budget: a 3 ms request was refused
    "predicted 1.0 ms alone … > budget 3 ms", which read as a contradiction. The refusal now says what was spent."""
    from dsedge.runtime.results import Rejected

    lane = Lane("fp32", backend.run, _seeded(), LAYOUT, StreamMetrics(), inline_ms=0.0)
    sched = BudgetScheduler([lane], LAYOUT, lane.metrics)
    got = sched.submit(text_request(np.random.default_rng(0), 8), 3.0, arrived=time.perf_counter() - 0.0025).result(5)
    assert isinstance(got, Rejected) and got.reason == "budget", got
    assert "> budget 3 ms (2." in got.detail and "ms of it spent before admission)" in got.detail, got.detail
    fresh = sched.submit(text_request(np.random.default_rng(1), 8), 0.9).result(5)  # nothing spent: nothing said
    assert isinstance(fresh, Rejected) and "spent before admission" not in fresh.detail, fresh.detail
    sched.close()
