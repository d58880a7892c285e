"""The token stream of one generation request (``DecodeLoop.submit`` / ``Session.generate_stream`` return it)."""
from __future__ import annotations

import asyncio
import queue as _queue
import threading
import time
from typing import Any, AsyncIterator, Iterator

import numpy as np

from .results import Rejected

_clock = time.perf_counter
_DONE = object()


class GenerationStream:
    """Tokens of one request as they are produced: ``for token in stream`` or ``async for token in stream``.

    Attributes (final once iteration ends):
        id: request id.
        tokens: the generated token ids so far.
        rejected: a ``Rejected`` when the request was refused (iteration then yields nothing), else None.
        finish_reason: "length" (max_new_tokens), "eos", "rejected", "shutdown" or "error".
        error: ``"Type: message"`` when the backend failed this sequence's step, else None.
        ttft_ms: submit → first token, ms.
        token_gaps_ms: time between consecutive tokens, ms.
        budget_ms / token_budget_ms: the TTFT and per-token budgets it was admitted with.
        window / sink_tokens: the sliding window it decodes with (None: full cache).
        scores: with ``output_scores``, the float32 logits [vocab] each token was picked from, else None.
    """

    def __init__(self, rid: Any, prompt: np.ndarray, max_new_tokens: int, budget_ms: float,
                 token_budget_ms: float, eos_token_id: int | None = None, window: int | None = None,
                 sink_tokens: int = 0, output_scores: bool = False) -> None:
        self.id = rid
        self.window = window
        self.sink_tokens = int(sink_tokens)
        self.scores: list[np.ndarray] | None = [] if output_scores else None
        self.eos_token_id = eos_token_id
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
        self._q: _queue.Queue = _queue.Queue()
        self._done = threading.Event()

    @property
    def deadline(self) -> float:
        return self.t_submit + self.budget_ms / 1e3

    @property
    def within_budget(self) -> bool:
        """TTFT within ``budget_ms`` and every token gap within ``token_budget_ms`` (and no rejection/error)."""
        return (self.rejected is None and self.error is None and self.ttft_ms is not None
                and self.ttft_ms <= self.budget_ms and all(g <= self.token_budget_ms for g in self.token_gaps_ms))

    def _emit(self, token: int, logits: np.ndarray | None = None) -> None:
        now = _clock()
        if self.scores is not None and logits is not None:
            self.scores.append(np.array(logits, dtype=np.float32))
        if self._t_last is None:
            self.ttft_ms = (now - self.t_submit) * 1e3
        else:
            self.token_gaps_ms.append((now - self._t_last) * 1e3)
        self._t_last = now
        self.tokens.append(int(token))
        self._q.put(int(token))

    def _finish(self, reason: str, rejected: Rejected | None = None, error: str | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.rejected, self.error = reason, rejected, error
        self._done.set()
        self._q.put(_DONE)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request finished; True if it did within ``timeout`` s."""
        return self._done.wait(timeout)

    def __iter__(self) -> Iterator[int]:
        """Yields each token once, as it is produced. The stream is consumed once: iterating it again after the
        end (or from a second consumer) ends at once; ``tokens`` holds them all."""
        while True:
            item = self._q.get()
            if item is _DONE:
                self._q.put(_DONE)  # whoever reads next ends too, instead of waiting forever
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[int]:
        """``async for token in stream``: waits for each token in a worker thread, not on the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            item = await loop.run_in_executor(None, self._q.get)
            if item is _DONE:
                self._q.put(_DONE)
                return
            yield item
