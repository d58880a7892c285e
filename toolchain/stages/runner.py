"""Run one build stage: time it (report.json ``timings_s``), show it while it runs, log when it ends.

The display is a callable ``progress(stage_name) -> context manager`` supplied by the caller (the CLI passes a rich
spinner with elapsed time, off when stderr is not a terminal or with ``--quiet``); the library default shows
nothing. Stage timings go to the ``dsedge.toolchain.build`` logger at DEBUG (``dsedge build -v``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager

log = logging.getLogger("dsedge.toolchain.build")


def no_progress(stage: str) -> ContextManager[Any]:
    return contextlib.nullcontext()


class StageRunner:
    """``run(name, stage, *args, timing=KEY)`` calls ``stage(*args)`` under the progress display; with ``timing``
    its seconds are added to ``timings[KEY]``."""

    def __init__(self, progress: Callable[[str], ContextManager[Any]] | None = None) -> None:
        self.progress = progress or no_progress
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}

    def __call__(self, name: str, stage: Callable[..., Any], *args: Any, timing: str | None = None) -> Any:
        t = time.perf_counter()
        with self.progress(name):
            out = stage(*args)
        dt = time.perf_counter() - t
        if timing is not None:
            self.timings[timing] = self.timings.get(timing, 0.0) + dt
        log.debug("stage %s: %.2f s", name, dt)
        return out
