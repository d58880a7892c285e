"""Progress lines for the samples' training steps: ``dsedge train`` / ``dsedge distill`` run as a child process and
write one JSON record per step to ``OUT_DIR/metrics.jsonl``, but show a progress bar only when stderr is a terminal
(nothing at all in a log or a pipe). ``run_training`` runs the command and, every ``interval_s``, prints one line
from that log on stderr:

    teacher: step 40/240 (17 %), loss 0.512, val loss 0.466, elapsed 3:52, about 19:20 left

(before the first step: ``teacher: preparing data, elapsed 0:30``). Uses only the documented log (docs/train.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_INTERVAL_S = 20.0


def _clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration in seconds."""
    s = int(round(max(0.0, seconds)))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class MetricsFollower:
    """New records of a growing ``metrics.jsonl``, written at or after ``since`` (unix seconds): an earlier run's
    records in the same file are skipped, and a file replaced under it (a new run removes the old log) is read from
    its start."""

    def __init__(self, path: str | os.PathLike, since: float) -> None:
        self.path, self.since = Path(path), since
        self._pos, self._ino, self._rest = 0, None, ""

    def read(self) -> list[dict[str, Any]]:
        """Records appended since the last call (complete lines only), in file order."""
        try:
            st = self.path.stat()
            if st.st_ino != self._ino or st.st_size < self._pos:
                self._pos, self._ino, self._rest = 0, st.st_ino, ""
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except OSError:  # not written yet, or removed between stat and open
            return []
        lines = (self._rest + chunk).split("\n")
        self._rest = lines.pop()
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and (rec.get("time") or 0) >= self.since:
                out.append(rec)
        return out


def progress_line(label: str, total_steps: int, last: dict | None, first: dict | None, val_loss: float | None,
                  elapsed_s: float) -> str:
    """One progress line (see the module docstring) from the latest and the first step records of this run."""
    if last is None:
        return f"{label}: preparing data, elapsed {_clock(elapsed_s)}"
    step = int(last["step"])
    line = f"{label}: step {step}/{total_steps}"
    if total_steps:
        line += f" ({100 * step // total_steps} %)"
    if isinstance(last.get("loss"), (int, float)):
        line += f", loss {last['loss']:.4g}"
    if val_loss is not None:
        line += f", val loss {val_loss:.4g}"
    line += f", elapsed {_clock(elapsed_s)}"
    if first is not None and step > int(first["step"]) and total_steps > step:
        per_step = (last.get("time", 0) - first.get("time", 0)) / (step - int(first["step"]))
        if per_step > 0:
            line += f", about {_clock(per_step * (total_steps - step))} left"
    return line


def run_training(cmd: Sequence[str], metrics: str | os.PathLike, total_steps: int, label: str,
                 interval_s: float = DEFAULT_INTERVAL_S, quiet: bool = False,
                 echo: Callable[[str], None] | None = None) -> int:
    """Run ``cmd`` (a ``dsedge train``/``distill`` command line) to completion, printing a progress line from its
    ``metrics`` log (``OUT_DIR/metrics.jsonl``) every ``interval_s`` seconds and one at each validation, unless
    ``quiet``. The child's own stdout/stderr pass through. Interrupted (Ctrl-C), the child is stopped too.

    Args:
        total_steps: the config's ``steps`` (for "step N/TOTAL" and the time left).
        label: what the lines start with (e.g. "teacher").
        echo: where the lines go (default: stderr, flushed).
    Returns:
        the child's exit status.
    """
    echo = echo or (lambda s: print(s, file=sys.stderr, flush=True))
    follower = MetricsFollower(metrics, since=time.time() - 1.0)   # the log's times are rounded to ms
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd))
    try:
        if quiet:
            return proc.wait()
        first = last = None
        val_loss = None
        printed = t0
        while True:
            try:
                rc: int | None = proc.wait(timeout=min(0.5, interval_s) if interval_s > 0 else 0.05)
            except subprocess.TimeoutExpired:
                rc = None
            for rec in follower.read():
                if rec.get("event") == "checkpoint" and isinstance(rec.get("val_loss"), (int, float)):
                    val_loss = float(rec["val_loss"])
                    echo(progress_line(label, total_steps, last, first, val_loss, time.perf_counter() - t0))
                    printed = time.perf_counter()
                elif "event" not in rec and "step" in rec:
                    first = first or rec
                    last = rec
            if rc is not None:
                return rc
            if time.perf_counter() - printed >= interval_s:
                echo(progress_line(label, total_steps, last, first, val_loss, time.perf_counter() - t0))
                printed = time.perf_counter()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
