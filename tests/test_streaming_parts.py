"""Latency profile, batching layout and the EDF lane, on real ORT sessions of tiny models built here."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, wait

import numpy as np
import pytest

from dsedge.runtime.backends.ort import OrtBackend
from dsedge.runtime.batching import BatchLayout
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.runtime.latency_profile import LatencyProfile, measure, seq_bucket
from dsedge.runtime.metrics import StreamMetrics
from dsedge.runtime.results import Result
from dsedge.runtime.scheduler import BudgetScheduler, Lane

from streaming_models import text_embedder, text_request

TEXT_IO = ([IOSpec("input_ids", "int64", ("batch", "sequence")), IOSpec("attention_mask", "int64", ("batch", "sequence"))],
           [IOSpec("last_hidden_state", "float32", ("batch", "sequence", 32)),
            IOSpec("sentence_embedding", "float32", ("batch", 32))])


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return OrtBackend(text_embedder(tmp_path_factory.mktemp("parts") / "m.onnx", dim=32), threads=1)


def test_seq_bucket_powers_of_two():
    assert [seq_bucket(s) for s in (None, 0, 1, 8, 9, 16, 17, 100)] == [0, 0, 8, 8, 16, 16, 32, 128]


def test_profile_interpolates_extrapolates_and_refreshes():
    p = LatencyProfile("fp32", k_dev=0.0)
    assert p.predict(1) == math.inf  # nothing known: never admit on a guess
    p.set(1, None, 2.0, 0.0)
    p.set(8, None, 9.0, 0.0)
    assert p.predict(1) == pytest.approx(2.0)
    assert p.predict(4) == pytest.approx(2.0 + 3 / 7 * 7.0)  # linear between measured batch sizes
    assert p.predict(16) == pytest.approx(9.0 + 1.0 * 8)  # last slope extended
    for _ in range(50):
        p.observe(8, None, 19.0)  # the device got slower: the moving mean follows
    assert p.predict(8) == pytest.approx(19.0, abs=0.01)
    p.observe(1, None, 5000.0)  # one stall moves a point at most 3× per sample …
    assert p.predict(1, None, k_dev=0.0) == pytest.approx(2.0 + 0.2 * (6.0 - 2.0))
    for _ in range(20):
        p.observe(1, None, 5000.0)
    assert p.predict(1) == pytest.approx(19.0, abs=0.01)  # … and never above a bigger batch's figure
    # a bucket never measured falls back to the token-linear fit over all points
    p2 = LatencyProfile(k_dev=0.0)
    p2.set(1, 16, 1.0, 0.0)
    p2.set(4, 16, 4.0, 0.0)
    assert p2.predict(2, 64) == pytest.approx(8.0, rel=1e-6)  # 128 tokens at 1/16 ms per token
    assert p2.max_batch_within(3.0, 16, limit=32) == 3


def test_profile_tail_margin_and_bundle_figures():
    v = Variant("int8", "int8", "models/int8.onnx", latency_ms={"1": {"p50": 2.0, "p99": 5.0}, "8x64": 10.0,
                                                                "junk": "x"})
    p = LatencyProfile.from_variant(v, k_dev=3.0)
    assert p.predict(1) == pytest.approx(5.0)  # p50 + 3 · (p99 − p50) / 3
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
    prof = LatencyProfile("fp32", k_dev=0.0)
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


def test_safety_factor_tracks_misses_and_relaxes(backend):
    lane = _lane(backend, max_batch=4)
    assert lane.safety == 1.0 and lane.predict(1, 8) == pytest.approx(1.0)
    lane._calibrate(True)
    lane._calibrate(True)
    assert lane.safety == pytest.approx(1.21) and lane.predict(1, 8) == pytest.approx(1.21)
    on_time = math.log(1.21) / -math.log(lane._down)  # on-time answers that undo two misses at a 0.5 % target
    assert 350 < on_time < 420
    for _ in range(int(on_time) + 1):
        lane._calibrate(False)
    assert lane.safety == 1.0
    for _ in range(30):
        lane._calibrate(True)
    assert lane.safety == 4.0  # capped
    lane._relax(lane._t_cal + 20.0)  # 20 s without answers: a quarter
    assert lane.safety == pytest.approx(1.0)
    lane.close()
