"""The in-process SDK used the way a new user gets it wrong: real bundles, real ORT sessions, real threads.

The decoder is a tiny absolute-position model built here (token + position embedding tables, the past cache
concatenated with the new hidden state, logits over a 16-token vocabulary): cheap to build, and a position past its
table makes ORT's Gather fail the way GPT-2 does past ``n_positions``.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dsedge
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.toolchain.bundle_writer import write_bundle

from streaming_models import text_bundle

pytest_plugins = ["pytester"]

VOCAB, DIM = 16, 4


def decoder_bundle(out: Path, positions: int, source: dict | None = None) -> Path:
    rng = np.random.default_rng(0)
    b, s, past, total = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, DIM)).astype(np.float32), "wte"),
             numpy_helper.from_array(rng.standard_normal((positions, DIM)).astype(np.float32), "wpe"),
             numpy_helper.from_array(rng.standard_normal((DIM, VOCAB)).astype(np.float32), "head"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [helper.make_node("Gather", ["wte", "input_ids"], ["tok"]),
             helper.make_node("Gather", ["wpe", "position_ids"], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["h"]),
             helper.make_node("Unsqueeze", ["h", "axis1"], ["h4"]),
             helper.make_node("Concat", ["past_key_values.0.key", "h4"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "h4"], ["present.0.value"], axis=2),
             helper.make_node("MatMul", ["h", "head"], ["logits"])]
    ins = [("input_ids", TensorProto.INT64, [b, s]), ("attention_mask", TensorProto.INT64, [b, total]),
           ("position_ids", TensorProto.INT64, [b, s]),
           ("past_key_values.0.key", TensorProto.FLOAT, [b, 1, past, DIM]),
           ("past_key_values.0.value", TensorProto.FLOAT, [b, 1, past, DIM])]
    outs = [("logits", TensorProto.FLOAT, [b, s, VOCAB]), ("present.0.key", TensorProto.FLOAT, [b, 1, total, DIM]),
            ("present.0.value", TensorProto.FLOAT, [b, 1, total, DIM])]
    graph = helper.make_graph(nodes, "tiny_decoder", [helper.make_tensor_value_info(*i) for i in ins],
                              [helper.make_tensor_value_info(*o) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out / "decoder.onnx")
    dtype = {TensorProto.INT64: "int64", TensorProto.FLOAT: "float32"}
    return write_bundle(out / "tiny-decoder-cpu.dse", name="tiny-decoder", target={"name": "cpu"},
                        inputs=[IOSpec(n, dtype[t], tuple(sh)) for n, t, sh in ins],
                        outputs=[IOSpec(n, dtype[t], tuple(sh)) for n, t, sh in outs],
                        models={"models/fp32.onnx": out / "decoder.onnx"},
                        variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32",
                        source=source)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return decoder_bundle(tmp_path_factory.mktemp("decoder"), positions=40)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return text_bundle(tmp_path_factory.mktemp("text"), max_batch=8)


def _read_in_thread(stream) -> list[int] | None:
    got: list = []
    t = threading.Thread(target=lambda: got.append(list(stream)), daemon=True)
    t.start()
    t.join(5)
    return None if t.is_alive() else got[0]


def test_a_generation_stream_read_again_or_by_a_second_reader_ends(decoder):
    with dsedge.load(decoder, threads=1, budget_ms=60_000) as s:
        st = s.generate_stream([1, 2], 3)
        first = _read_in_thread(st)
        assert first is not None and len(first) == 3 and st.finish_reason == "length"
        assert _read_in_thread(st) == []  # used to wait forever: the end marker had been consumed
        assert st.tokens == first


def test_generate_stream_refuses_bad_prompts_and_options_at_the_call(decoder):
    with dsedge.load(decoder, threads=1, budget_ms=60_000) as s:
        for prompt in ([1, VOCAB], [-1, 2]):  # past the vocabulary; negative (ORT's Gather would wrap it)
            with pytest.raises(dsedge.InputError, match="outside the model's vocabulary"):
                s.generate_stream(prompt, 2)
        for kwargs, match in ((dict(budget_ms=-1), "budget_ms"), (dict(budget_ms="5"), "budget_ms"),
                              (dict(token_budget_ms=float("nan")), "token_budget_ms"),
                              (dict(max_new_tokens=1.5), "max_new_tokens"), (dict(eos_token_id="x"), "eos_token_id")):
            with pytest.raises(dsedge.InputError, match=match):
                s.generate_stream([1, 2], **{"max_new_tokens": 2, **kwargs})
        assert len(list(s.generate_stream([1, 2], 2))) == 2


def test_a_sequence_past_the_models_positions_fails_alone(decoder):
    with dsedge.load(decoder, threads=1, budget_ms=60_000) as s:
        assert s.generate_stream([1], 1).wait(30)
        alone = list(s.generate_stream([3], 6))
        with s._decoder._cond:  # both wait together, so they are prefilled and decoded in one batch
            long = s.generate_stream([1] * 38, 10)  # positions 0..37, then 38, 39, and 40 is past the table
            short = s.generate_stream([3], 6)
        assert long.wait(30) and short.wait(30)
        assert long.finish_reason == "error" and "Gather" in long.error and len(long.tokens) == 3
        assert short.finish_reason == "length" and short.error is None and short.tokens == alone
        assert s._decoder.stats.max_rows == 2


def test_a_prompt_longer_than_the_context_is_refused_and_warmup_fits_a_short_context(tmp_path):
    bundle = decoder_bundle(tmp_path, positions=20, source={"max_position_embeddings": 20})
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        assert len(list(s.generate_stream([1, 2], 3))) == 3  # warm-up used to feed 32 positions to a 20-position model
        with pytest.raises(dsedge.InputError, match="longer than the model's 20 positions"):
            s.generate_stream([1] * 21, 2)


def test_load_refuses_options_the_bundle_cannot_serve(text):
    with pytest.raises(dsedge.InputError, match="above the bundle's batch range max 8"):
        dsedge.load(text, max_batch=9)
    with pytest.raises(dsedge.InputError, match="variant must be a variant name"):
        dsedge.load(text, variant=0)
    with pytest.raises(dsedge.InputError, match="cascade must be True or False"):
        dsedge.load(text, cascade="yes")
    with dsedge.load(text, max_batch=8, budget_ms=60_000) as s:
        row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
        for kwargs in (dict(budget_ms=-1), dict(priority=0.5)):  # at the call, not at the first next()
            with pytest.raises(dsedge.InputError):
                s.stream([row], **kwargs)
            with pytest.raises(dsedge.InputError):
                s.stream_async([row], **kwargs)
        answers = [f.result(30) for f in [s.submit(row) for _ in range(20)]]
        assert all(a.ok for a in answers) and max(a.batch_size for a in answers) <= 8


def test_a_backend_failure_in_run_is_an_inference_error_and_the_session_goes_on(text):
    import dataclasses

    with dsedge.load(text, threads=1) as s:
        bad = {"input_ids": np.full((1, 4), 10_000, np.int64), "attention_mask": np.ones((1, 4), np.int64)}
        with pytest.raises(dsedge.InputError, match="outside the model's range"):  # the table's size, from the graph
            s.run(bad)
        s.inputs = [dataclasses.replace(i, value_range=None) for i in s.inputs]  # so that ORT meets it
        with pytest.raises(dsedge.InferenceError, match="onnxruntime failed to run this batch") as e:
            s.run(bad)
        assert "\n" not in str(e.value) and e.value.hint and e.value.__cause__ is not None
        good = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
        assert s.run(good)["sentence_embedding"].shape == (1, 64)


def test_the_latency_plugin_collects_a_bundle_whose_figures_are_plain_ms(tmp_path, pytester):
    bundle = text_bundle(tmp_path, latency_ms={"fp32": {"1": 0.5, "4": 1.0}})  # a number per batch: schema-valid
    pytester.makepyfile(test_lat=f"""
        import pytest

        @pytest.mark.dsedge_bundle({str(bundle)!r})
        def test_latency(dsedge_latency):
            assert dsedge_latency.case.seq_len is None
        """)
    res = pytester.runpytest("-p", "no:cacheprovider", "-q")
    res.assert_outcomes(passed=2)  # batch 1 and 4; the collection used to fail on float.get("shape")


def test_close_from_a_done_callback_closes_and_resolves_every_future(text):
    row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    for _ in range(5):  # until the callback runs on the lane's thread (a future already done calls it right here)
        s = dsedge.load(text, threads=1, budget_ms=60_000)
        raised, ran_on, called = [], [], threading.Event()

        def close_on_answer(_, s=s, raised=raised, ran_on=ran_on, called=called):
            ran_on.append(threading.current_thread().name)
            try:
                s.close()
            except BaseException as e:  # concurrent.futures only logs what a callback raises
                raised.append(e)
            called.set()

        futures = [s.submit(row) for _ in range(30)]  # open loop: they queue and run on the lane's thread
        futures[-1].add_done_callback(close_on_answer)
        assert called.wait(30) and raised == []  # was RuntimeError("cannot join current thread")
        answers = [f.result(30) for f in futures]
        assert all(a.ok or a.reason == "shutdown" for a in answers)
        with pytest.raises(dsedge.SessionClosedError):
            s.submit(row)
        if ran_on[0].startswith("dsedge-lane"):
            break
        s.close()
    assert ran_on[0].startswith("dsedge-lane")
    for _ in range(100):
        if not any(t.name.startswith(("dsedge-lane", "dsedge-close")) for t in threading.enumerate()):
            break
        threading.Event().wait(0.05)
    assert not any(t.name.startswith(("dsedge-lane", "dsedge-close")) for t in threading.enumerate())


def test_two_sessions_export_prometheus_metrics_side_by_side(text):
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    with dsedge.load(text) as a, dsedge.load(text) as b:
        first = a.export_prometheus(reg)
        assert a.export_prometheus(reg) is first  # again: the same collector, not a DuplicateTimeseries
        with pytest.raises(dsedge.InputError, match="already registered"):
            b.export_prometheus(reg)
        b.export_prometheus(reg, prefix="dsedge_b")
        row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
        assert b.submit(row).result(30).ok
        text_out = generate_latest(reg).decode()
        assert "dsedge_requests_submitted_total 0.0" in text_out
        assert "dsedge_b_requests_submitted_total 1.0" in text_out


def _dsedge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("dsedge-lane", "dsedge-decode"))]


def test_a_session_dropped_without_close_answers_its_queue_and_stops_its_threads(text, decoder):
    before = len(_dsedge_threads())
    row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    futures = [dsedge.load(text, budget_ms=60_000).submit(row) for _ in range(4)]  # each session dropped at once
    streams = [dsedge.load(decoder, threads=1, budget_ms=60_000).generate_stream([1, 2], 3) for _ in range(2)]
    assert all(f.result(30).ok for f in futures)  # queued work still finishes
    assert all(len(list(st)) == 3 and st.finish_reason == "length" for st in streams)
    del streams
    for _ in range(100):  # a lane / decode thread per forgotten session used to stay forever
        if len(_dsedge_threads()) <= before:
            break
        threading.Event().wait(0.05)
    assert len(_dsedge_threads()) <= before


@pytest.fixture(scope="module")
def heavier_text(tmp_path_factory):
    """Eight 256-wide layers: slow enough (a few ms a batch) that requests queue behind each other."""
    return text_bundle(tmp_path_factory.mktemp("heavier"), variants={"fp32": 8}, dim=256)


def test_submit_copies_the_callers_buffers_before_they_are_refilled(heavier_text):
    with dsedge.load(heavier_text, threads=1, budget_ms=60_000) as s:
        ids, mask = np.ones((1, 16), np.int64), np.ones((1, 16), np.int64)
        expected, futures = [], []
        for v in range(1, 9):
            ids[:] = v
            expected.append(s.run({"input_ids": ids, "attention_mask": mask})["sentence_embedding"])
        for v in range(1, 9):
            ids[:] = v  # one preallocated buffer refilled per request, as a reading loop does
            futures.append(s.submit({"input_ids": ids, "attention_mask": mask}))
        for f, want in zip(futures, expected):  # queued requests used to read the buffer's last contents
            np.testing.assert_allclose(f.result(30).outputs["sentence_embedding"], want, rtol=1e-5, atol=1e-6)

        class Buffer:  # an array-like whose __array__ hands over its own storage (a user's pass: not copied)
            def __init__(self, a):
                self.a = a

            def __array__(self, dtype=None, copy=None):
                return self.a

        buf = Buffer(np.ones((1, 16), np.int64))
        futures = []
        for v in range(1, 9):
            buf.a[:] = v
            futures.append(s.submit({"input_ids": buf, "attention_mask": mask}))
        for f, want in zip(futures, expected):
            np.testing.assert_allclose(f.result(30).outputs["sentence_embedding"], want, rtol=1e-5, atol=1e-6)


def test_close_with_a_bad_argument_refuses_before_closing_anything(text):
    s = dsedge.load(text)
    row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    assert s.submit(row).result(30).ok
    for kwargs in (dict(timeout_s="1"), dict(timeout_s=-1), dict(timeout_s=float("nan")), dict(timeout_s=10**400),
                   dict(drain="no")):
        with pytest.raises(dsedge.InputError):
            s.close(**kwargs)
    assert s.submit(row).result(30).ok  # still open: a TypeError used to leave it marked closed, lanes running
    s.close(timeout_s=5)
    with pytest.raises(dsedge.SessionClosedError):
        s.submit(row)


def test_leaving_stream_async_early_logs_no_callback_errors_after_the_loop_closes(heavier_text, caplog):
    import asyncio
    import logging

    row = {"input_ids": np.ones((1, 64), np.int64), "attention_mask": np.ones((1, 64), np.int64)}
    with dsedge.load(heavier_text, threads=1, budget_ms=60_000) as s:
        async def first_answer():
            async for answer in s.stream_async([row] * 40, window=20):
                return answer

        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            assert asyncio.run(first_answer()).ok  # the loop closes with ~19 answers still in flight
            assert s.submit(row).result(30).ok    # the lane went on
        assert s.metrics()["in_flight"] == 0
    # each late answer used to log "exception calling callback ... RuntimeError: Event loop is closed"
    assert not [r for r in caplog.records if "callback" in r.getMessage()]


def test_a_forked_child_is_told_to_load_again_instead_of_waiting_forever(text):
    import multiprocessing

    row = {"input_ids": np.ones((1, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    with dsedge.load(text, budget_ms=60_000) as s:
        assert s.submit(row).result(30).ok  # the lane thread runs in this process

        def child(q):
            try:
                futures = [s.submit(row) for _ in range(8)]  # queued for a lane thread the fork does not have
                q.put([type(f.result(3)).__name__ for f in futures])
            except dsedge.SessionClosedError as e:
                q.put(f"closed: {e}")
            except Exception as e:
                q.put(repr(e))

        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        got = q.get(timeout=30)
        p.join(30)
        assert got.startswith("closed: this session's worker threads run in process"), got  # was TimeoutError()
        assert s.submit(row).result(30).ok  # the parent's session is untouched


def test_one_bad_request_fails_alone_not_its_batch_mates(text):
    """The backend fails on a batch (a token id past the embedding table: the session's check of the table's size,
    read from the graph, is taken off so that only ORT sees it); the lane runs the batch again request by request,
    so only the bad request fails."""
    import dataclasses

    rng = np.random.default_rng(0)
    with dsedge.load(text, budget_ms=2000) as s:
        s.inputs = [dataclasses.replace(i, value_range=None) for i in s.inputs]
        s.warmup()
        good = [{"input_ids": rng.integers(1, 100, (1, 8)), "attention_mask": np.ones((1, 8), np.int64)}
                for _ in range(12)]
        bad = {"input_ids": np.full((1, 8), 10**6, np.int64), "attention_mask": np.ones((1, 8), np.int64)}
        long = {"input_ids": rng.integers(1, 100, (8, 128)), "attention_mask": np.ones((8, 128), np.int64)}
        first = s.submit(long)  # keeps the worker busy while the next 13 queue, so they share a batch
        futs = [s.submit(x) for x in good[:6]] + [s.submit(bad)] + [s.submit(x) for x in good[6:]]
        answers = [f.result(30) for f in futs]
        assert first.result(30).ok
    assert [a.ok for a in answers] == [True] * 6 + [False] + [True] * 6
    assert answers[6].error and "Gather" in answers[6].error


def test_a_request_above_max_batch_is_refused_at_the_call(tmp_path):
    bundle = text_bundle(tmp_path, max_batch=8)
    with dsedge.load(bundle, max_batch=4) as s:
        feed = {"input_ids": np.ones((8, 6), np.int64), "attention_mask": np.ones((8, 6), np.int64)}
        with pytest.raises(dsedge.InputError, match="8 rows; this session batches at most 4"):
            s.submit(feed)
        assert s.submit({k: v[:4] for k, v in feed.items()}).result(30).batch_size <= 4
