"""Lane workers at a higher nice value (``load(worker_nice=)``, ``dsedge serve --worker-nice``): the threads that
admit requests and send answers preempt running batches; and 1-thread instances' workers pinned to a core each
(``load(pin_instances=)``). Real threads, real ORT sessions, Linux nice values and affinities."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import dsedge
from dsedge.runtime.errors import InputError
from dsedge.runtime.results import Result
from dsedge.runtime.thread_priority import lower_current_thread, thread_nice

from streaming_models import text_bundle, text_request

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _in_thread(fn):
    got = {}
    t = threading.Thread(target=lambda: got.update(value=fn(), nice=thread_nice()))
    t.start()
    t.join(10)
    return got


def _answers_like_run(s, reqs) -> None:
    answers = [f.result(30) for f in [s.submit(r, budget_ms=10_000) for r in reqs]]
    for r, a in zip(reqs, answers):
        assert isinstance(a, Result) and a.ok
        np.testing.assert_allclose(a.outputs["sentence_embedding"], s.run(r)["sentence_embedding"], rtol=0, atol=1e-5)


def test_lower_current_thread_raises_only_the_calling_threads_nice_value():
    base = thread_nice()
    got = _in_thread(lambda: lower_current_thread(3))
    assert got["value"] is True and got["nice"] == min(base + 3, 19)
    assert thread_nice() == base  # the caller's own thread is untouched
    assert _in_thread(lambda: lower_current_thread(0)) == {"value": False, "nice": base}
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="0..19"):
            lower_current_thread(bad)


def test_load_with_worker_nice_lowers_every_lane_worker_and_answers_like_run(tmp_path):
    bundle = text_bundle(tmp_path / "b")
    rng = np.random.default_rng(3)
    reqs = [text_request(rng, int(n)) for n in rng.integers(4, 30, size=12)]
    base = thread_nice()
    with dsedge.load(bundle, instances=2, threads=1, worker_nice=5) as s:
        _answers_like_run(s, reqs)
        lanes = s._core().lanes
        assert len(lanes) == 2 and all(l.niced for l in lanes)
        assert {os.getpriority(os.PRIO_PROCESS, l._thread.native_id) for l in lanes} == {min(base + 5, 19)}
        assert thread_nice() == base  # the caller (and run()) keep the process's priority
        assert s.describe()["worker_nice"] == 5
    with dsedge.load(bundle, instances=1) as s:  # default: the workers keep the caller's priority
        assert s.submit(reqs[0], budget_ms=10_000).result(30).ok
        (lane,) = s._core().lanes
        assert not lane.niced and os.getpriority(os.PRIO_PROCESS, lane._thread.native_id) == base
    for bad in (-1, 20, 2.5, True, "5"):
        with pytest.raises(InputError, match="worker_nice"):
            dsedge.load(bundle, worker_nice=bad)


def test_instance_cpus_gives_one_core_per_1_thread_instance_or_none():
    from dsedge.runtime.instances import instance_cpus

    assert instance_cpus(2, 1, [0, 1]) == [frozenset({0}), frozenset({1})]
    assert instance_cpus(1, 1, [5, 7]) == [frozenset({5})]
    assert instance_cpus(3, 1, [0, 1]) is None  # more instances than cores: nothing pinned
    assert instance_cpus(2, 2, [0, 1, 2, 3]) is None and instance_cpus(2, None, [0, 1]) is None
    assert instance_cpus(0, 1, [0]) is None


def test_pin_current_thread_pins_only_the_calling_thread():
    from dsedge.runtime.thread_priority import pin_current_thread, thread_cpus

    mine = thread_cpus()
    core = min(mine)
    got = {}
    t = threading.Thread(target=lambda: got.update(ok=pin_current_thread({core}), cpus=thread_cpus()))
    t.start()
    t.join(10)
    assert got == {"ok": True, "cpus": frozenset({core})}
    assert thread_cpus() == mine  # the caller's own thread is untouched
    assert pin_current_thread(()) is False and pin_current_thread(None) is False
    outside = max(os.sched_getaffinity(0)) + 4096  # no such core: refused, not raised
    assert _in_thread(lambda: pin_current_thread({outside}))["value"] is False


def test_load_pins_each_1_thread_instance_to_a_core_of_its_own_and_answers_like_run(tmp_path):
    from dsedge.runtime.instances import host_cores

    if host_cores() < 2:
        pytest.skip("pinning two instances needs two cores")
    bundle = text_bundle(tmp_path / "b")
    rng = np.random.default_rng(5)
    reqs = [text_request(rng, int(n)) for n in rng.integers(4, 30, size=12)]
    allowed = sorted(os.sched_getaffinity(0))
    with dsedge.load(bundle, instances=2, threads=1) as s:
        _answers_like_run(s, reqs)
        lanes = s._core().lanes
        assert len(lanes) == 2 and all(l.pinned for l in lanes)
        got = [os.sched_getaffinity(l._thread.native_id) for l in lanes]
        assert got == [{allowed[0]}, {allowed[1]}]  # one core each, distinct
        assert s.describe()["instance_cpus"] == allowed[:2]
        assert sorted(os.sched_getaffinity(0)) == allowed  # the caller keeps every core
    with dsedge.load(bundle, instances=2, threads=1, pin_instances=False) as s:
        assert s.submit(reqs[0], budget_ms=10_000).result(30).ok
        lanes = s._core().lanes
        assert not any(l.pinned for l in lanes) and s.describe()["instance_cpus"] == []
        assert all(sorted(os.sched_getaffinity(l._thread.native_id)) == allowed for l in lanes)
    with dsedge.load(bundle, instances=1, threads=2) as s:  # an instance of more threads: not pinned
        assert s.submit(reqs[0], budget_ms=10_000).result(30).ok
        assert not any(l.pinned for l in s._core().lanes)
    with pytest.raises(InputError, match="pin_instances"):
        dsedge.load(bundle, pin_instances="yes")
