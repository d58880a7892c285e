"""The token stream of one generation request (``DecodeLoop.submit`` / ``Session.generate_stream`` return it)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, AsyncIterator, Iterator, Sequence

import numpy as np

from .results import Rejected

_clock = time.perf_counter
_DONE = object()  # what a take returns once the stream is finished and every token was handed out
_EMPTY = object()  # nothing to hand out yet

CANCELLED = "cancelled"


class GenerationStream:
    """Tokens of one request as they are produced: ``for token in stream`` or ``async for token in stream``.

    Attributes (final once iteration ends):
        id: request id.
        tokens: the generated token ids so far.
        rejected: a ``Rejected`` when the request was refused (iteration then yields nothing), else None.
        finish_reason: "length" (max_new_tokens), "eos", "rejected", "cancelled" (``cancel()``, or a reader that
            stopped early), "shutdown" or "error".
        error: ``"Type: message"`` when the backend failed this sequence's step (or it reached the model's last
            position), else None.
        ttft_ms: submit → first token, ms.
        token_gaps_ms: time between consecutive tokens, ms.
        budget_ms / token_budget_ms: the TTFT and per-token budgets it was admitted with.
        window / sink_tokens: the sliding window it decodes with (None: full cache).
        scores: with ``output_scores``, the float32 logits [vocab] each token was picked from, else None.

    Cancelling: ``cancel()`` (or ``close()``) ends the request at once with finish_reason "cancelled" (its row
    leaves the batch before the next decode step). A ``for`` loop that leaves early (``break``, an exception) or an
    iterator that is closed or garbage collected before the end cancels it too, as does an ``async for`` whose
    async generator is closed (``break``; asyncio closes it). A *task* cancelled while it awaits the next token
    (``asyncio.wait_for`` timing out) does not cancel the stream and loses no token: iterating again goes on
    where it stopped.
    """

    def __init__(self, rid: Any, prompt: np.ndarray, max_new_tokens: int, budget_ms: float,
                 token_budget_ms: float, eos_token_id: int | Sequence[int] | None = None,
                 stop_ids: frozenset[int] = frozenset(), window: int | None = None, sink_tokens: int = 0,
                 output_scores: bool = False) -> None:
        self.id = rid
        self.window = window
        self.sink_tokens = int(sink_tokens)
        self.scores: list[np.ndarray] | None = [] if output_scores else None
        self.eos_token_id = eos_token_id
        self.stop_ids = stop_ids  # the token ids that end it ("eos"): eos_token_id's, checked by the decode loop
        self.prompt = prompt
        self.max_new_tokens = int(max_new_tokens)
        self.budget_ms = float(budget_ms)
        self.token_budget_ms = float(token_budget_ms)
        self.tokens: list[int] = []
        self.rejected: Rejected | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ttft_ms: float | None = None
        self.token_gaps_ms: list[float] = []
        self.t_submit = _clock()
        self._t_last: float | None = None
        # tokens not yet handed out; readers take them under the lock, so a reader that is cancelled while it
        # waits has taken nothing (no token is lost)
        self._lock = threading.RLock()  # re-entrant: a reader dropped by the collector cancels under it
        self._ready = threading.Condition(self._lock)
        self._pending: deque[int] = deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._done = threading.Event()

    @property
    def deadline(self) -> float:
        return self.t_submit + self.budget_ms / 1e3

    @property
    def within_budget(self) -> bool:
        """TTFT within ``budget_ms`` and every token gap within ``token_budget_ms`` (and no rejection/error)."""
        return (self.rejected is None and self.error is None and self.ttft_ms is not None
                and self.ttft_ms <= self.budget_ms and all(g <= self.token_budget_ms for g in self.token_gaps_ms))

    # -- producer side (the decode loop) ------------------------------------------------------------------------
    def _wake(self) -> None:
        """Wake every reader (lock held)."""
        self._ready.notify_all()
        for loop, fut in self._waiters:
            try:
                loop.call_soon_threadsafe(_set_if_pending, fut)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass
        self._waiters.clear()

    def _emit(self, token: int, logits: np.ndarray | None = None, finish: str | None = None) -> bool:
        """Hand out one token (and, with ``finish``, end the stream with that reason right after it, atomically).
        Returns False, recording nothing, when the stream already ended (cancelled while the step ran)."""
        with self._lock:
            if self._done.is_set():
                return False
            now = _clock()
            if self.scores is not None and logits is not None:
                self.scores.append(np.array(logits, dtype=np.float32))
            if self._t_last is None:
                self.ttft_ms = (now - self.t_submit) * 1e3
            else:
                self.token_gaps_ms.append((now - self._t_last) * 1e3)
            self._t_last = now
            self.tokens.append(int(token))
            self._pending.append(int(token))
            if finish is not None:
                self.finish_reason = finish
                self._done.set()
            self._wake()
            return True

    def _finish(self, reason: str, rejected: Rejected | None = None, error: str | None = None) -> bool:
        """End the stream (once: later calls do nothing and return False)."""
        with self._lock:
            if self._done.is_set():
                return False
            self.finish_reason, self.rejected, self.error = reason, rejected, error
            self._done.set()
            self._wake()
            return True

    # -- consumer side ------------------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """End this request now with finish_reason "cancelled": no token is produced for it after this returns,
        and its row leaves the running batch before the next decode step (a waiting prompt is never prefilled).
        Tokens already produced stay in ``tokens`` and can still be read. Returns True when this call ended it,
        False when it had already ended (then nothing changes). Thread-safe."""
        return self._finish(CANCELLED)

    def close(self) -> bool:
        """Same as ``cancel()``."""
        return self.cancel()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finished; True if it did within ``timeout`` s."""
        return self._done.wait(timeout)

    def _take(self) -> Any:
        """The next token, ``_DONE`` at the end, ``_EMPTY`` when none is ready yet (lock held)."""
        if self._pending:
            return self._pending.popleft()
        return _DONE if self._done.is_set() else _EMPTY

    def __iter__(self) -> Iterator[int]:
        """Yields each token once, as it is produced. The stream is consumed once: iterating it again after the
        end (or from a second consumer) ends at once; ``tokens`` holds them all. Leaving the loop early (or
        closing / dropping the iterator before the end) cancels the request."""
        finished = False
        try:
            while True:
                with self._ready:
                    item = self._take()
                    while item is _EMPTY:
                        self._ready.wait()
                        item = self._take()
                if item is _DONE:
                    finished = True
                    return
                yield item
        finally:
            if not finished:
                self.cancel()

    def __aiter__(self) -> AsyncIterator[int]:
        """``async for token in stream``: waits on the event loop (the decode thread wakes it), never on a worker
        thread. A task cancelled while it waits takes no token with it (iterating again goes on where it stopped);
        leaving the loop early (``break``: the iterator is dropped after a token) or ``aclose()`` cancels the
        request."""
        return _AsyncTokens(self)


class _AsyncTokens:
    """The async iterator of a ``GenerationStream`` (a class rather than an async generator: dropping it after
    ``break`` cancels at once, where an async generator's close waits for its event loop to run a task)."""

    def __init__(self, stream: GenerationStream) -> None:
        self._stream = stream
        self._state = "new"  # "reading" (handed out a token), "interrupted" (a wait was cancelled), "ended"

    def __aiter__(self) -> "_AsyncTokens":
        return self

    async def __anext__(self) -> int:
        st = self._stream
        loop = asyncio.get_running_loop()
        while True:
            with st._lock:
                item = st._take()
                if item is _EMPTY:
                    fut = loop.create_future()
                    st._waiters.append((loop, fut))
            if item is _DONE:
                self._state = "ended"
                raise StopAsyncIteration
            if item is not _EMPTY:
                self._state = "reading"
                return item
            try:
                await fut
            except BaseException:  # this task was cancelled while it waited: it took nothing
                self._state = "interrupted"
                raise
            finally:
                with st._lock:
                    if (loop, fut) in st._waiters:
                        st._waiters.remove((loop, fut))

    async def aclose(self) -> None:
        """Stop reading: cancels the request unless it ended."""
        if self._state != "ended":
            self._state = "ended"
            self._stream.cancel()

    def __del__(self) -> None:
        # dropped after taking a token (``break``) and before the end: the reader stopped early
        if self._state == "reading":
            self._stream.cancel()


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
