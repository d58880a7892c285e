"""Instances of one variant (Triton's instance group): several backends, one lane each, sharing a profile."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import dsedge
from dsedge.runtime.batching import BatchLayout
from dsedge.runtime.errors import InputError
from dsedge.runtime.latency_profile import LatencyProfile
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.results import Result
from dsedge.runtime.scheduler import BudgetScheduler, Lane
from dsedge.session import auto_instances

from streaming_models import text_bundle, text_request
from test_streaming_parts import TEXT_IO, backend  # noqa: F401  (the module's tiny real ORT text model)


def _gated(backend, gate: threading.Event):
    """``backend.run`` that waits for ``gate`` first (at most 20 s)."""
    def run(feed):
        gate.wait(20)
        return backend.run(feed)
    return run


def _running_blocker(sched: BudgetScheduler, lane: Lane, rng):
    """Submit one long-budget request and wait until ``lane`` has it on its backend; its future."""
    fut = sched.submit(text_request(rng, 8), 600_000, id="blocker")
    while lane._busy_until == 0.0:
        time.sleep(0.001)
    return fut


def test_a_request_the_busy_instance_cannot_meet_goes_to_the_idle_one(backend):
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 100.0, 0.0)  # 100 ms per request, on either instance
    gate = threading.Event()
    metrics = StreamMetrics()
    first = Lane("fp32", _gated(backend, gate), prof, layout, metrics, max_batch=1, inline_ms=0.0)
    second = Lane("fp32", backend.run, prof, layout, metrics, max_batch=1, inline_ms=0.0, calibration=first.calibration,
                  instance=1)
    sched = BudgetScheduler([first, second], layout, metrics)
    rng = np.random.default_rng(0)
    blocker = _running_blocker(sched, first, rng)  # on the first instance, held at the gate
    # behind the blocker (≈ 100 ms left) a 150 ms budget cannot hold on the first instance; the second is idle
    got = sched.submit(text_request(rng, 8), 150, id="next").result(10)
    assert isinstance(got, Result) and got.ok and got.variant == "fp32"
    assert not blocker.done()  # answered while the first instance was still busy
    assert second.batches == 1 and first.batches == 0
    assert metrics.snapshot()["cascaded"] == {}  # an instance of the same variant is no cascade
    assert second.profile is first.profile and second.calibration is first.calibration
    gate.set()
    assert blocker.result(10).ok
    sched.close()


def test_load_with_instances_serves_on_each_backend_and_answers_like_run(tmp_path):
    bundle = text_bundle(tmp_path / "b")
    rng = np.random.default_rng(1)
    reqs = [text_request(rng, int(s)) for s in rng.integers(4, 30, size=40)]
    with dsedge.load(bundle, instances=2) as s:
        lanes = [l for l in s._core().lanes if not l.fallback]
        assert [l.instance for l in lanes] == [0, 1] and len({id(l.run) for l in lanes}) == 2
        runs = {id(getattr(l.run, "__self__", None)) for l in lanes}
        assert id(s._backend) not in runs  # run() keeps its own backend, with ORT's default threads
        answers = [f.result(30) for f in [s.submit(r, budget_ms=10_000) for r in reqs]]
        for r, a in zip(reqs, answers):
            assert isinstance(a, Result) and a.ok
            np.testing.assert_allclose(a.outputs["sentence_embedding"], s.run(r)["sentence_embedding"], rtol=0,
                                       atol=1e-5)
        stats = s._core().lane_stats()["fp32"]
        assert stats["instances"] == 2 and stats["batches"] + stats["inline"] >= 1
    with pytest.raises(InputError, match="instances"):
        dsedge.load(bundle, instances=0)
    with pytest.raises(InputError, match="per core"):  # each one a whole backend: refused before any is opened
        dsedge.load(bundle, instances=10_000)


@pytest.mark.parametrize("threads, sessions", [(1, 1), (2, 2)])
def test_one_thread_instances_share_one_ort_session_and_run_on_it_at_once(tmp_path, threads, sessions):
    """Like Triton's share_session_between_instances: 1-thread instances on the CPU provider run on one ONNX
    Runtime session (one copy of the weights), each run on its own worker thread, at the same time; instances
    with an intra-op pool of their own keep a session each (two runs would share one pool)."""
    bundle = text_bundle(tmp_path / "b")
    rng = np.random.default_rng(2)
    with dsedge.load(bundle, instances=2, threads=threads) as s:
        s._core()
        assert len({id(b) for b in s._instance_backends}) == sessions
        assert all(b is not s._backend for b in s._instance_backends)
        if sessions == 1:  # nothing in dsedge serializes the lanes' runs on it: both reach ORT's run together
            lanes = [l for l in s._core().lanes if not l.fallback]
            shared = s._instance_backends[0]
            ort_run, both, met = shared.session.run, threading.Barrier(2, timeout=20), []

            def meet_then_run(*a, **kw):
                met.append(both.wait())  # BrokenBarrierError after 20 s if the other lane's run never comes
                return ort_run(*a, **kw)

            shared.session.run = meet_then_run
            feed = text_request(rng, 24)
            workers = [threading.Thread(target=l.run, args=(feed,)) for l in lanes]
            [w.start() for w in workers]
            [w.join(30) for w in workers]
            shared.session.run = ort_run
            assert sorted(met) == [0, 1]
        reqs = [text_request(rng, int(n)) for n in rng.integers(4, 30, size=12)]
        for r, f in zip(reqs, [s.submit(r, budget_ms=60_000) for r in reqs]):
            a = f.result(60)
            assert a.ok
            np.testing.assert_allclose(a.outputs["sentence_embedding"], s.run(r)["sentence_embedding"], rtol=0,
                                       atol=1e-5)


def test_auto_instances_on_the_cpu_provider_splits_the_cores(monkeypatch):
    class Cpu:
        providers = ["CPUExecutionProvider"]

    class Gpu:
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]

    monkeypatch.setattr("dsedge.session._cores", lambda: 8)
    assert auto_instances(Cpu(), 4, None) == (4, 2)  # given: the cores split between them
    assert auto_instances(Cpu(), 2, 3) == (2, 3)  # given threads are kept
    assert auto_instances(Cpu(), None, 3) == (1, 3)  # threads alone: one backend as asked
    assert auto_instances(Gpu(), None, None) == (1, None)  # one engine per device
    n, t = auto_instances(Cpu(), None, None)
    assert n * t <= 8 and n >= 1


def test_a_request_too_tight_for_the_instances_alone_goes_to_the_fallback_backend(backend):
    layout = BatchLayout.of(*TEXT_IO)
    slow = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    slow.set(1, 8, 40.0, 0.0)  # an instance (fewer threads): 40 ms alone
    fast = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    fast.set(1, 8, 5.0, 0.0)  # the fallback backend (all the threads): 5 ms
    metrics = StreamMetrics()

    def slow_run(feed):  # what the seeds say, measured too
        time.sleep(0.04)
        return backend.run(feed)

    first = Lane("fp32", slow_run, slow, layout, metrics, max_batch=1, inline_ms=0.0)
    second = Lane("fp32", slow_run, slow, layout, metrics, max_batch=1, inline_ms=0.0,
                  calibration=first.calibration, instance=1)
    spare = Lane("fp32", backend.run, fast, layout, metrics, max_batch=1, inline_ms=0.0, fallback=True)
    sched = BudgetScheduler([first, second, spare], layout, metrics)
    rng = np.random.default_rng(2)
    roomy = sched.submit(text_request(rng, 8), 10_000).result(10)  # the instances can: the fallback is not offered it
    tight = sched.submit(text_request(rng, 8), 20).result(10)  # 40 ms alone on an instance > 20: the fallback serves
    assert roomy.ok and tight.ok
    assert (first.batches, second.batches, spare.batches) == (1, 0, 1)
    never = sched.submit(text_request(rng, 8), 0.1).result(10)  # under the margin even on the fallback: the
    assert never.reason == "budget" and " ms alone on fp32 + " in never.detail  # refusal names both backends
    assert "ms alone on fp32's fallback backend + " in never.detail, never.detail
    assert metrics.snapshot()["cascaded"] == {}
    sched.close()


def _instances_and_a_whole_core_lane(backend, name: str, fallback: bool):
    """Two 150 ms instances of "fp32" and one 5 ms lane with all the cores (``name``: the variant's fallback, or a
    cascade variant's lane), each run held by a sleep and recorded; (scheduler, instances, that lane, spans)."""
    layout = BatchLayout.of(*TEXT_IO)
    slow = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    slow.set(1, 8, 150.0, 0.0)  # an instance: 150 ms alone
    fast = LatencyProfile(name, k_dev=0.0, scale_seeds=False)
    fast.set(1, 8, 5.0, 0.0)  # the lane with all the cores: 5 ms
    metrics = StreamMetrics()
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def timed(kind, hold_s):
        def run(feed):
            t0 = time.perf_counter()
            time.sleep(hold_s)
            out = backend.run(feed)
            with lock:
                spans.append((kind, t0, time.perf_counter()))
            return out
        return run

    first = Lane("fp32", timed("instance", 0.15), slow, layout, metrics, max_batch=1, inline_ms=0.0)
    second = Lane("fp32", timed("instance", 0.15), slow, layout, metrics, max_batch=1, inline_ms=0.0,
                  calibration=first.calibration, instance=1)
    whole = Lane(name, timed("whole", 0.005), fast, layout, metrics, max_batch=1, inline_ms=0.0, fallback=fallback)
    return BudgetScheduler([first, second, whole], layout, metrics), (first, second), whole, spans


def test_the_fallback_backend_never_runs_beside_an_instance_and_plans_behind_their_running_batch(backend):
    """The fallback has all the instances' threads: run beside them it oversubscribed the cores, their measured times
    rose past the budget and the lane stayed on the fallback (runtime/core_share.py). Its batches run alone, and a
    request offered to it while an instance's batch runs is planned behind that batch."""
    sched, (first, second), whole, spans = _instances_and_a_whole_core_lane(backend, "fp32", True)
    assert first.share is whole.share is second.share is not None and whole.across == (first, second)
    assert whole.alone_on_cores and not first.alone_on_cores
    rng = np.random.default_rng(3)
    roomy = sched.submit(text_request(rng, 8), 10_000)  # on an instance, 150 ms
    while not first._running:
        time.sleep(0.001)
    # 150 ms alone on an instance > 60: offered to the fallback, whose plan waits for the running batch (~150 ms)
    tight = sched.submit(text_request(rng, 8), 60).result(10)
    assert tight.reason == "overload" and "fallback" not in tight.detail.split(";")[0], tight.detail
    # the refusal says which backend planned it behind the running batch (it read "... queued on fp32")
    assert "queued on fp32's fallback backend > budget 60 ms" in tight.detail, tight.detail
    time.sleep(0.11)  # the instance's batch has about 40 ms left: a 120 ms budget holds behind it
    later = sched.submit(text_request(rng, 8), 120).result(10)
    assert roomy.result(10).ok and later.ok, later
    assert whole.batches == 1
    fb = [(a, b) for n, a, b in spans if n == "whole"]
    inst = [(a, b) for n, a, b in spans if n == "instance"]
    assert fb and inst  # (probes of the refused requests run too: on the same terms)
    assert all(fb_end <= i_start or i_end <= fb_start for fb_start, fb_end in fb for i_start, i_end in inst), spans
    sched.close()


def test_a_cascade_lane_is_not_in_the_core_sharing_and_keeps_its_standby_list(backend):
    """A cascade variant's lane in the sharing waited for the instances' idle probes and the other whole-core lanes'
    turns, past budgets it could meet alone (a user's pass: up to 390 ms late): it runs beside the instances."""
    sched, (first, second), cascade, _ = _instances_and_a_whole_core_lane(backend, "int4", False)
    assert cascade.share is None and not cascade.alone_on_cores and cascade.standby is not None
    assert first.share is None  # no fallback here: nothing for the instances to take turns with
    sched.close()


def test_a_fallback_not_yet_timed_takes_nothing_and_the_instances_refusal_stands(backend):
    """With ``profile="measure"`` the fallback has no figures until its warm-up has timed it. Offered a request its
    instances are too slow for, it used to queue it blind, to be dropped at its deadline (a miss); the request is
    refused for its budget at once instead."""
    layout = BatchLayout.of(*TEXT_IO)
    slow = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    slow.set(1, 8, 150.0, 0.0)
    metrics = StreamMetrics()
    first = Lane("fp32", backend.run, slow, layout, metrics, max_batch=1, inline_ms=0.0)
    second = Lane("fp32", backend.run, slow, layout, metrics, max_batch=1, inline_ms=0.0,
                  calibration=first.calibration, instance=1)
    gate = threading.Event()
    spare = Lane("fp32", _gated(backend, gate), LatencyProfile("fp32", scale_seeds=False), layout, metrics,
                 max_batch=1, inline_ms=0.0, fallback=True)
    sched = BudgetScheduler([first, second, spare], layout, metrics)
    try:
        t0 = time.perf_counter()
        r = sched.submit(text_request(np.random.default_rng(0), 8), 60).result(10)
        assert (time.perf_counter() - t0) < 1.0
        assert r.reason == "budget" and "predicted 150.0 ms alone on fp32" in r.detail, r
        assert spare.depth == 0 and metrics.snapshot()["dropped_at_deadline"] == 0
    finally:
        gate.set()
        sched.close()


def test_load_counts_the_callers_cpu_where_the_lanes_cover_every_core(tmp_path, monkeypatch):
    """runtime/caller_load.py: on ORT's CPU provider with the lanes over every core, a caller's burst of CPU use
    takes one from a batch, and plans count it; with a core reserved for the caller, or lanes on fewer threads than
    cores, they do not."""
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    monkeypatch.setattr("dsedge.runtime.instances.host_cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b")
    for kwargs, weight in (({}, 1.0), ({"reserve_cores": 1}, 0.0), ({"threads": 1}, 0.0)):
        with dsedge.load(bundle, **kwargs) as s:
            assert s._core().scheduler.caller.weight == weight, kwargs


def test_load_with_default_instances_adds_the_fallback_lane_on_the_sessions_own_backend(tmp_path, monkeypatch):
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b")
    with dsedge.load(bundle) as s:
        lanes = s._core().lanes
        assert [(l.instance, l.fallback) for l in lanes] == [(0, False), (1, False), (0, True)]
        assert lanes[2].run.__self__ is s._backend and lanes[2].profile is not lanes[0].profile
        assert s._core().lane_stats()["fp32"]["instances"] == 2 and s.describe()["instances"] == 2
    with dsedge.load(bundle, threads=1) as s:  # threads alone: one backend, as asked
        assert len(s._core().lanes) == 1


@pytest.mark.parametrize("recorded, instance_ms, fallback_ms", [
    (1, 10.0, 10.0 * 0.5 ** 0.64),  # timed on one instance's thread (dsedge build now): the fallback has 2
    (None, 10.0 * 2 ** 0.64, 10.0),  # a bundle that does not say: timed with ORT's default, a thread per core
])
def test_the_bundles_figures_seed_each_lane_at_its_own_thread_count(tmp_path, monkeypatch, recorded, instance_ms,
                                                                   fallback_ms):
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    rec = {"p50": 10.0, "p99": 10.0, **({"threads": recorded} if recorded else {})}
    bundle = text_bundle(tmp_path / "b", latency_ms={"fp32": {"1": rec}})
    with dsedge.load(bundle, profile="bundle") as s:  # "bundle": the seeds as they are, never rescaled here
        first, second, fallback = s._core().lanes
        assert first.profile.predict(1, k_dev=0.0) == pytest.approx(instance_ms)
        assert second.profile is first.profile and fallback.fallback
        assert fallback.profile.predict(1, k_dev=0.0) == pytest.approx(fallback_ms)


def test_reserve_cores_leaves_cores_to_the_caller(tmp_path, monkeypatch):
    class Cpu:
        providers = ["CPUExecutionProvider"]

    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    assert auto_instances(Cpu(), None, None, 1) == (1, 1)  # one core left: one instance on one thread
    assert auto_instances(Cpu(), None, 2, 1) == (1, 2)  # given threads are kept
    monkeypatch.setattr("dsedge.session._cores", lambda: 8)
    assert auto_instances(Cpu(), None, None, 1) == (2, 3) and auto_instances(Cpu(), 3, None, 2) == (3, 2)
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b", latency_ms={"fp32": {"1": {"p50": 10.0, "p99": 10.0, "threads": 1}}})
    with dsedge.load(bundle, reserve_cores=1, profile="bundle") as s:
        (lane,) = s._core().lanes  # no second instance, no fallback lane on every core
        assert lane.run.__self__ is not s._backend and not lane.fallback
        assert lane.profile.predict(1, k_dev=0.0) == pytest.approx(10.0)  # timed on 1 thread, served on 1
        assert s.describe()["instances"] == 1
        assert s.submit(text_request(np.random.default_rng(0), 8), budget_ms=10_000).result(30).ok
    with pytest.raises(InputError, match="reserve_cores must be an integer >= 0"):
        dsedge.load(bundle, reserve_cores=-1)
    with pytest.raises(InputError, match="reserve_cores=2 leaves none of this machine's 2 cores"):
        dsedge.load(bundle, reserve_cores=2)  # (it served on 1 instance without a word)


def test_reserve_cores_pins_no_instance_on_the_reserved_cores(tmp_path, monkeypatch):
    """instances=2 with 1 of 2 cores reserved: both were pinned, one onto the core kept for the caller."""
    from dsedge.runtime.instances import instance_cpus
    assert instance_cpus(2, 1, [0, 1], reserve=1) is None  # two instances, one core left: not pinned
    assert instance_cpus(3, 1, [0, 1, 2, 3], reserve=1) == [frozenset({0}), frozenset({1}), frozenset({2})]
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    monkeypatch.setattr("dsedge.runtime.instances.os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    bundle = text_bundle(tmp_path / "b")
    with dsedge.load(bundle, instances=2, reserve_cores=1) as s:
        assert s.describe()["instances"] == 2 and s.describe()["instance_cpus"] == []
        assert s.submit(text_request(np.random.default_rng(0), 8), budget_ms=10_000).result(30).ok
        assert all(not l.cpus and not l.fallback for l in s._core().lanes)


def test_cpu_layout_and_thread_scale():
    from dsedge.runtime.instances import cpu_layout, recorded_threads, reserved_layout, serving_threads, thread_scale

    assert reserved_layout(None, None, 2, 1) == (1, 1) and reserved_layout(None, None, 2, 0) == (2, 1)
    assert reserved_layout(None, None, 1, 1) == (1, 1) and reserved_layout(2, None, 4, 1) == (2, 1)
    assert reserved_layout(None, None, 4, 1) == (3, 1) and reserved_layout(None, None, 8, 1) == (2, 3)
    assert reserved_layout(None, 2, 2, 1) == (1, 2)  # given threads are kept

    assert cpu_layout(None, None, 2) == (2, 1) and cpu_layout(None, None, 8) == (2, 4)
    assert cpu_layout(None, None, 1) == (1, None) and cpu_layout(None, 3, 8) == (1, 3)
    assert serving_threads(2) == 1 and serving_threads(8) == 4 and serving_threads(1) == 1
    assert thread_scale(2, 1) == pytest.approx(2 ** 0.64) and thread_scale(1, 2) == pytest.approx(0.5 ** 0.64)
    assert thread_scale(None, 2) == thread_scale(2, None) == thread_scale(4, 4) == 1.0
    assert recorded_threads({"1": {"p50": 3.0, "threads": 2}}) == 2
    assert recorded_threads({"1": 3.0}) is None and recorded_threads({"1": {"threads": True}}) is None
    assert recorded_threads(None) is None


def test_a_long_queue_estimate_times_each_batch_at_its_longest_row(backend):
    """Beyond ``plan_limit`` the plan is estimated in closed form: a short request behind long ones must be timed
    at the long ones' length (the worker pads a batch to its longest row), close to the played-forward plan."""
    layout = BatchLayout.of(*TEXT_IO)
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    for b in (1, 2, 4, 8, 16, 32):
        prof.set(b, 8, 1.0 * b, 0.0)  # 1 ms per row at 8 tokens
        prof.set(b, 64, 10.0 * b, 0.0)  # 10 ms per row at 64 tokens
    gate = threading.Event()
    lane = Lane("fp32", _gated(backend, gate), prof, layout, StreamMetrics(), max_batch=8, inline_ms=0.0)
    sched = BudgetScheduler([lane], layout, lane.metrics)
    rng = np.random.default_rng(3)
    futs = [_running_blocker(sched, lane, rng)]
    futs += [sched.submit(text_request(rng, 64 if i % 2 else 8), 600_000, id=i) for i in range(40)]
    assert lane.depth == 40
    short = dsedge.runtime.scheduler.Request("short", text_request(rng, 8), 1, 8, layout.group_key(
        text_request(rng, 8)), 600_000, 0, time.perf_counter(), time.perf_counter() + 600.0)
    now = time.perf_counter()
    lane.plan_limit = 16
    estimated = lane.plan(short, now).expected - now
    lane.plan_limit = 1000
    played = lane.plan(short, now).expected - now
    # 41 rows in batches of 8, each padded to 64 tokens: ≈ 6 × 80 ms (+ the running one), not ≈ 41 × 1 ms
    assert played > 0.3 and 0.8 * played <= estimated <= 1.25 * played
    gate.set()
    assert all(isinstance(f.result(30), Result) for f in futs)
    sched.close()


def test_a_paused_spare_instance_takes_no_new_requests(tmp_path, monkeypatch):
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b")
    rng = np.random.default_rng(0)
    with dsedge.load(bundle) as s:
        first, second, fallback = s._core().lanes
        s.pause_spare_instances(True)
        assert second.paused and fallback.paused and not first.paused
        before = (second.batches, fallback.batches)
        futs = [s.submit(text_request(rng, 8), budget_ms=10_000) for _ in range(40)]  # a burst: JSQ would split it
        assert all(f.result(30).ok for f in futs)
        assert (second.batches, fallback.batches) == before and first.batches > 0
        s.pause_spare_instances(False)
        assert not second.paused and not fallback.paused
        for bad in ("no", 0, None):  # "no" paused them: refused like every other flag
            with pytest.raises(InputError, match="paused must be True or False"):
                s.pause_spare_instances(bad)
        assert not second.paused and not fallback.paused


def test_the_spare_governor_pauses_while_the_front_end_is_busy_and_resumes_after():
    from dsedge.serve.spares import SpareGovernor

    class Fake:
        paused = None

        def pause_spare_instances(self, p):
            self.paused = p

    s = Fake()
    g = SpareGovernor(lambda: [s], pause_above=0.3, resume_below=0.15, decay=0.5)
    assert g.step(0.1) is False and s.paused is None  # light front end: the spares stay on
    assert g.step(0.8) is True and s.paused is True  # rises at once
    assert g.step(0.2) is True  # 0.5 after decay: still busy
    assert g.step(0.0) is True and g.step(0.0) is False and s.paused is False  # 0.25, then 0.125 < 0.15
    assert g.pauses == 1

    async def busy_then_idle() -> tuple[bool, bool]:  # the loop's own CPU is what it measures
        live = SpareGovernor(lambda: [s], pause_above=0.3, resume_below=0.15, interval_s=0.02)
        task = asyncio.ensure_future(live.run())
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:  # the loop thread busy, yielding now and then as a front end does
            sum(range(20_000))
            await asyncio.sleep(0)
        busy = live.paused
        await asyncio.sleep(0.5)  # idle: the share decays under 0.15
        task.cancel()
        return busy, live.paused

    assert asyncio.run(busy_then_idle()) == (True, False) and s.paused is False


def _two_gated_instances(backend, prof: LatencyProfile):
    """Two batch-1 instances sharing ``prof``, each backend waiting for its own gate; (sched, lanes, gates)."""
    layout, metrics = BatchLayout.of(*TEXT_IO), StreamMetrics()
    gates = [threading.Event(), threading.Event()]
    first = Lane("fp32", _gated(backend, gates[0]), prof, layout, metrics, max_batch=1, inline_ms=0.0,
                 observe_warmup=False)
    second = Lane("fp32", _gated(backend, gates[1]), prof, layout, metrics, max_batch=1, inline_ms=0.0,
                  observe_warmup=False, calibration=first.calibration, instance=1)
    sched = BudgetScheduler([first, second], layout, metrics)
    for lane in (first, second):
        lane.warm.wait(10)
    return sched, (first, second), gates


def test_an_instance_that_frees_first_takes_the_queue_of_a_busy_one(backend):
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 100.0, 0.0)
    sched, lanes, gates = _two_gated_instances(backend, prof)
    rng = np.random.default_rng(0)
    blockers = [_running_blocker(sched, lane, rng) for lane in lanes]  # one on each backend, held at its gate
    queued = sched.submit(text_request(rng, 8), 600_000, id="queued")
    holder = next(l for l in lanes if l.depth == 1)  # queued behind one of the blockers
    other = next(l for l in lanes if l is not holder)
    gates[other.instance].set()  # the other instance frees first: it takes the request instead of idling
    got = queued.result(10)
    assert isinstance(got, Result) and got.ok
    assert not blockers[holder.instance].done()  # answered while its own instance was still busy
    assert other.stolen == 1 and holder.stolen == 0 and holder.depth == 0
    assert sched.lanes[0] is lanes[0] and lanes[0].siblings == (lanes[1],) and lanes[1].siblings == (lanes[0],)
    gates[holder.instance].set()
    assert blockers[holder.instance].result(10).ok
    sched.close()


def test_among_equally_loaded_instances_a_request_joins_the_one_expected_to_free_first(backend):
    prof = LatencyProfile("fp32", k_dev=0.0, scale_seeds=False)
    prof.set(1, 8, 100.0, 0.0)
    prof.set(1, 64, 400.0, 0.0)  # a long request: predicted 4x as long
    sched, lanes, gates = _two_gated_instances(backend, prof)
    rng = np.random.default_rng(0)
    long_fut = sched.submit(text_request(rng, 64), 600_000, id="long")  # the first instance: both were idle
    while lanes[0]._busy_until == 0.0:
        time.sleep(0.001)
    short_fut = _running_blocker(sched, lanes[1], rng)  # the second, started later but expected to end first
    sched.submit(text_request(rng, 8), 600_000, id="next")
    assert (lanes[0].depth, lanes[1].depth) == (0, 1)  # not the first instance, whose run ends ~300 ms later
    for g in gates:
        g.set()
    assert long_fut.result(10).ok and short_fut.result(10).ok
    sched.close()


def test_warmup_reports_the_instances_profile_and_the_fallbacks_apart(tmp_path, monkeypatch):
    """The fallback lane has its variant's name: its profile overwrote the instances' in warmup()'s answer."""
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b", max_batch=2)
    with dsedge.load(bundle) as s:
        first, _second, fallback = s._core().lanes
        first.profile.observe(1, 8, 1234.0)  # marks the instances' profile apart from the fallback's
        got = s.warmup()
        assert list(got) == ["fp32"]
        assert got["fp32"] == {**first.profile.to_dict(), "fallback": fallback.profile.to_dict()}


def test_max_queue_is_per_instance_and_the_refusal_says_so(tmp_path, monkeypatch):
    """load(max_queue=2) with 2 instances queued 4 and refused the 5th as "queue of fp32 full (2 requests)"."""
    monkeypatch.setattr("dsedge.session._cores", lambda: 2)
    bundle = text_bundle(tmp_path / "b")
    x = text_request(np.random.default_rng(0), 8)
    with dsedge.load(bundle, instances=2, max_queue=2, max_delay_ms=2000, standby=False) as s:
        s.warmup()  # measured: queued on plans, not as a cold start
        futs = [s.submit(x, budget_ms=60_000) for _ in range(8)]  # each batch is held open 2 s for more
        refused = [f.result(0) for f in futs if f.done()]
        assert len(refused) == 4 and {r.reason for r in refused} == {"overload"}
        assert "queues of fp32's 2 instances full (2 requests each)" in refused[0].detail, refused[0].detail
        s.close(drain=False)


def test_a_second_close_from_another_thread_returns_once_every_future_is_resolved(tmp_path):
    """close() promises every submitted future resolved when it returns; a second close() racing the first
    returned at once while the first was still draining the queue."""
    bundle = text_bundle(tmp_path / "b", dim=256, variants={"fp32": 8})
    rng = np.random.default_rng(0)
    s = dsedge.load(bundle, instances=1, threads=1, max_batch=1)
    futs = [s.submit(text_request(rng, 128), budget_ms=60_000) for _ in range(300)]
    first = threading.Thread(target=s.close)
    first.start()
    while not s._closed:
        time.sleep(0.0005)
    s.close()  # the second: waits for the first to finish
    unresolved = sum(not f.done() for f in futs)
    first.join(30)
    assert unresolved == 0 and all(f.result(0).ok for f in futs)
