"""Cancelling a backend run from another thread: how a lane's re-measuring probe yields to real requests.

A probe (runtime/scheduler.py) runs a refused request again on an idle backend only to correct a stale estimate;
its answer already went out, so nobody waits for it. Without a way to stop it, the requests that arrive meanwhile
wait behind it or are refused: through ``dsedge serve``, one refused 64 × 256-token MiniLM request (3.6 s predicted
against a 1 s budget) was probed for 2.8–4 s, and every 1 × 4-token request in that time was refused ("overload").

ONNX Runtime stops a run between two kernels when its ``RunOptions.terminate`` is set from another thread
(``OrtBackend.run(..., cancel=)``); a backend that cannot stop a run (TensorRT's enqueue) takes no ``cancel``, and
its lanes keep a probe in their plans as a running batch.
"""
from __future__ import annotations

import threading
from typing import Callable


class RunCancelled(Exception):
    """The run was stopped through its ``RunCancel`` (internal: a probe cut short; never reaches a caller)."""


class RunCancel:
    """A one-shot cancel flag a backend run binds its own stop to. Thread-safe; ``cancel()`` may come before the
    run starts (the run then stops at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the bound run (idempotent). Cheap: it sets flags; safe to call under other locks."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def bind(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` on ``cancel()``, or now if it was cancelled already."""
        with self._lock:
            if not self._cancelled:
                self._hooks.append(hook)
                return
        hook()


def cancellable(run: Callable) -> bool:
    """Whether ``run`` (a backend's bound ``run``) takes ``cancel=``: marked by the backend."""
    return bool(getattr(run, "takes_cancel", False))
