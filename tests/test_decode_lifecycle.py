"""Lifecycle of generations: cancelling, closing a session under a generation nobody reads, exiting mid-generation,
asyncio cancellation, option checks and the position limit, over the tiny GPT-2 of test_streaming_decode and the
tiny Llama (64 positions) of test_decode_window (real optimum exports, real ONNX Runtime sessions)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import numpy as np
import pytest

import dsedge
from dsedge.runtime import decode
from test_decode_window import MAX_POS, llama  # noqa: F401  (fixture)
from test_streaming_decode import PROMPTS, _reference, gpt2  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow  # both fixtures export a model with optimum

UNBOUNDED = 10**7  # with a sliding window, a rotary decoder never runs out of positions: practically endless


def _returns_within(call, seconds: float = 10.0) -> bool:
    """Run ``call`` on a daemon thread; True if it returned within ``seconds``."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _read_all(stream) -> list[int] | None:
    got: list = []
    return got[0] if _returns_within(lambda: got.append(list(stream))) else None


def _run_async(coro, seconds: float = 30.0):
    """Run ``coro`` on a fresh event loop in a daemon thread; its result, or ``"hung"`` after ``seconds``."""
    out: list = ["hung"]

    def run() -> None:
        loop = asyncio.new_event_loop()
        try:
            out[0] = loop.run_until_complete(coro)
        finally:
            loop.close()
    _returns_within(run, seconds)
    return out[0]


def _stop(s) -> None:
    """Whatever happened in the test, stop the session's decode thread (an endless generation would go on)."""
    if s._decoder is not None:
        s._decoder.close(drain=False, timeout_s=5)


def test_cancel_ends_a_running_generation_and_close_returns(llama):
    bundle, _ = llama
    s = dsedge.load(bundle, threads=1, budget_ms=60_000)
    try:
        st = s.generate_stream([5, 9, 2], UNBOUNDED, window=16)
        it = iter(st)
        head = [next(it), next(it)]
        assert st.cancel() is True and st.done() and st.finish_reason == "cancelled" and st.error is None
        produced = len(st.tokens)
        assert st.cancel() is False and st.finish_reason == "cancelled"  # resolved once
        assert head == st.tokens[:2]
        assert len(list(s.generate_stream([1, 2], 3))) == 3  # the loop goes on serving others ...
        assert len(st.tokens) == produced and not s._decoder._rows  # ... and the cancelled row left the batch
        assert _returns_within(s.close)
    finally:
        _stop(s)
    # a waiting prompt cancelled before it runs is never prefilled
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s2:
        assert s2.generate_stream([1], 1).wait(30)
        with s2._decoder._cond:  # the loop cannot admit it yet
            waiting = s2.generate_stream([5, 9, 2], 5)
            assert waiting.close() is True
        assert len(list(s2.generate_stream([1, 2], 2))) == 2
        assert waiting.tokens == [] and waiting.finish_reason == "cancelled" and list(waiting) == []


def test_a_reader_that_stops_early_cancels_and_the_with_block_ends(llama):
    bundle, _ = llama
    box: dict = {}

    def run() -> None:
        with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
            box["session"] = s
            st = box["broken"] = s.generate_stream([5, 9, 2], UNBOUNDED, window=16)
            for i, _tok in enumerate(st):
                if i == 1:
                    break  # the generator is dropped: the request is cancelled
            box["after_break"] = st.finish_reason
            dropped = box["dropped"] = s.generate_stream([4, 4], UNBOUNDED, window=16)
            it = iter(dropped)
            next(it)
            del it  # an iterator garbage collected before the end
            box["after_del"] = dropped.finish_reason
    try:
        assert _returns_within(run), "leaving the with block hung on a generation nobody reads"
    finally:
        _stop(box["session"])
    assert box["after_break"] == "cancelled" and box["after_del"] == "cancelled"
    assert len(box["broken"].tokens) >= 2


def test_close_bounds_the_drain_of_a_generation_nobody_reads(llama, monkeypatch):
    bundle, _ = llama
    monkeypatch.setattr(decode, "DRAIN_TIMEOUT_S", 0.5, raising=False)
    s = dsedge.load(bundle, threads=1, budget_ms=60_000)
    finite = s.generate_stream([1, 2, 3], 20)
    endless = s.generate_stream([5, 9, 2], UNBOUNDED, window=16)
    assert endless.wait(0) is False
    try:
        assert _returns_within(s.close), "close() waited forever on an unbounded generation"
    finally:
        _stop(s)
    assert endless.done() and endless.finish_reason == "shutdown" and 0 < len(endless.tokens) < UNBOUNDED
    assert finite.finish_reason == "length" and len(finite.tokens) == 20  # a finite one still drains
    assert _read_all(endless) == endless.tokens  # what was produced stays readable, then the stream ends


def test_a_script_that_exits_mid_generation_exits_cleanly(llama):
    bundle, _ = llama
    script = (f"import dsedge\n"
              f"s = dsedge.load({str(bundle)!r}, threads=1, budget_ms=60000)\n"
              f"st = s.generate_stream([5, 9, 2], max_new_tokens=10**6, window=16)\n"
              f"print(next(iter(st)) >= 0, flush=True)\n")  # ends without close(), the loop thread decoding
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_async_iteration_cancelled_while_waiting_loses_no_token(gpt2):
    bundle, model = gpt2
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        assert s.generate_stream([1], 1).wait(30)  # the loop is running
        with s._decoder._cond:  # it cannot start this prompt while the test holds its lock
            st = s.generate_stream(PROMPTS[1], 3)

            async def time_out_twice() -> int:
                timeouts = 0
                for _ in range(2):
                    ait = st.__aiter__()
                    try:
                        await asyncio.wait_for(ait.__anext__(), timeout=0.05)
                    except asyncio.TimeoutError:
                        timeouts += 1
                return timeouts
            assert _run_async(time_out_twice()) == 2
        assert st.wait(30) and st.finish_reason == "length"
        got = _read_all(st)  # the orphaned waits used to take two tokens and the end marker
        assert got == st.tokens == _reference(model, PROMPTS[1], 3)
        assert _read_all(st) == []  # read again after the end: ends at once

        async def read_with_timeouts(stream) -> tuple[list[int], int]:
            got, timeouts = [], 0
            while not stream.done() or timeouts < 10_000:
                async def drain() -> None:
                    async for t in stream:
                        got.append(t)
                try:
                    await asyncio.wait_for(drain(), timeout=0.0005)
                    return got, timeouts
                except asyncio.TimeoutError:
                    timeouts += 1
            return got, timeouts  # gave up: an end marker was lost
        long = s.generate_stream(PROMPTS[0], 30)
        result = _run_async(read_with_timeouts(long))
        assert result != "hung" and result[0] == long.tokens == _reference(model, PROMPTS[0], 30)


def test_leaving_an_async_for_early_cancels(llama):
    bundle, _ = llama
    s = dsedge.load(bundle, threads=1, budget_ms=60_000)
    try:
        st = s.generate_stream([5, 9, 2], UNBOUNDED, window=16)

        async def first_two() -> list[int]:
            got = []
            async for t in st:
                got.append(t)
                if len(got) == 2:
                    break
            return got
        assert len(_run_async(first_two())) == 2
        assert st.wait(10) and st.finish_reason == "cancelled"
    finally:
        _stop(s)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window="8"), "window must be an integer"), (dict(window=2.7), "window must be an integer"),
    (dict(window=True), "window must be an integer"), (dict(window=float("nan")), "window must be an integer"),
    (dict(window="x"), "window must be an integer"),
    (dict(window=8, sink_tokens="x"), "sink_tokens must be an integer"),
    (dict(window=8, sink_tokens=None), "sink_tokens must be an integer"),
    (dict(window=8, sink_tokens=2.9), "sink_tokens must be an integer"),
    (dict(window=8, sink_tokens=True), "sink_tokens must be an integer"),
    (dict(window=8, sink_tokens=-1), "sink_tokens"),
    (dict(window=0), "window must be"),
])
def test_window_options_must_be_integers_in_range(llama, kwargs, match):
    bundle, _ = llama
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        with pytest.raises(dsedge.InputError, match=match) as e:
            s.generate_stream([5, 9, 2], 3, **kwargs)
        assert "\n" not in str(e.value) and e.value.hint
        ok = s.generate_stream([5, 9, 2], 3, window=8, sink_tokens=2)
        assert len(list(ok)) == 3 and ok.window == 8 and ok.sink_tokens == 2


def test_eos_token_id_outside_the_vocabulary_is_refused(gpt2):
    bundle, model = gpt2
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        for eos in (64, 1000, -1):
            with pytest.raises(dsedge.InputError, match="outside the model's vocabulary") as e:
                s.generate_stream(PROMPTS[1], 3, eos_token_id=eos)
            assert e.value.hint
        ref = _reference(model, PROMPTS[1], 3)
        st = s.generate_stream(PROMPTS[1], 3, eos_token_id=ref[0])  # an id within it still stops
        assert list(st) == ref[:1] and st.finish_reason == "eos"


def test_a_rotary_decoder_stops_at_its_max_position_embeddings(llama):
    bundle, _ = llama
    prompt = [5, 9, 2, 44, 17]
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        full = s.generate_stream(prompt, 100)
        windowed = s.generate_stream(prompt, 100, window=16, sink_tokens=4)
        assert full.wait(60) and windowed.wait(60)
    # positions 0 … 63: the prefill's token, then one per position 5 … 63
    assert full.finish_reason == "error" and len(full.tokens) == MAX_POS - len(prompt) + 1
    assert "past the model's 64 positions" in full.error
    assert windowed.finish_reason == "length" and len(windowed.tokens) == 100  # the window keeps positions low


def test_a_decoder_bundle_opens_one_backend(gpt2):
    bundle, model = gpt2
    with pytest.raises(dsedge.InputError, match="a decoder bundle generates on the session's one backend"):
        dsedge.load(bundle, instances=2)  # would be ignored: refused
    with dsedge.load(bundle, budget_ms=60_000) as s:
        assert s.describe()["instances"] == 1 and s.describe()["instance_cpus"] == []
        assert s._open_instances is None
        assert list(s.generate_stream(PROMPTS[0], 5)) == _reference(model, PROMPTS[0], 5)


def test_eos_token_id_may_name_several_stop_tokens_and_a_bad_bundle_default_is_a_bundle_error(gpt2):
    bundle, model = gpt2
    # a prompt whose greedy continuation makes a new token after its first: stopping there is then visible
    prompt, ref, cut = next((p, ref, i) for p in PROMPTS for ref in [_reference(model, p, 12)]
                            for i in range(1, len(ref)) if ref[i] not in ref[:i])
    stop = next(t for t in range(64) if t not in ref)  # a stop token the greedy sequence never makes
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        st = s.generate_stream(prompt, 12, eos_token_id=[stop, ref[cut]])  # a Hugging Face style list
        assert list(st) == ref[:cut + 1] and st.finish_reason == "eos"
        st = s.generate_stream(prompt, 12, eos_token_id=np.array([stop, ref[cut]]))  # a user's pass: refused
        assert list(st) == ref[:cut + 1] and st.finish_reason == "eos"
        for bad in ([], [stop, 64], [stop, "2"]):
            with pytest.raises(dsedge.InputError, match="eos_token_id"):
                s.generate_stream(prompt, 3, eos_token_id=bad)
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        s.manifest.source["eos_token_id"] = [stop, ref[cut]]  # the default, as a Llama 3 config gives it
        st = s.generate_stream(prompt, 12)
        assert list(st) == ref[:cut + 1] and st.finish_reason == "eos"
    with dsedge.load(bundle, threads=1, budget_ms=60_000) as s:
        s.manifest.source["eos_token_id"] = 5000  # outside the 64-token vocabulary: it could never stop
        with pytest.raises(dsedge.BundleError, match="bundle's default eos_token_id 5000") as e:
            s.generate_stream(prompt, 3)
        assert e.value.hint and "\n" not in str(e.value)
