"""Per-step health and visibility: a JSONL log (rank 0), a progress bar, optional TensorBoard.

Each step record: ``step``, ``loss``, ``lr``, ``grad_norm``, ``loss_scale`` (fp16), ``samples_per_s``,
``tokens_per_s`` (token-budget batches), ``step_time_ms``, ``data_wait_fraction`` (share of the step spent waiting
for the data loader), ``skipped`` (non-finite), ``time`` (unix seconds). Events (``resumed``, ``rollback``, ``skipped_batches``, ``checkpoint``, ``eval``)
are records with an ``event`` key.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append JSON lines to ``path`` on rank 0 (other ranks: no-op). Non-finite floats are written as null."""

    def __init__(self, path: str | os.PathLike, rank: int = 0, total_steps: int = 0, progress: bool | None = None,
                 tensorboard: bool = False) -> None:
        self.path, self.rank = Path(path), rank
        self.bar = None
        self.tb = None
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                self.message("tensorboard requested but not installed (pip install tensorboard); JSONL only")

    @staticmethod
    def _clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    def write(self, record: dict) -> None:
        if self.rank != 0:
            return
        rec = {k: self._clean(v) for k, v in record.items()}
        rec.setdefault("time", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if "event" in rec:
            return
        if self.bar is not None:
            self.bar.n = rec.get("step", self.bar.n)
            self.bar.set_postfix(loss=rec.get("loss"), lr=rec.get("lr"), refresh=False)
            self.bar.update(0)
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, rec.get("step", 0))

    def message(self, text: str) -> None:
        """A one-line notice on stderr (rank 0)."""
        if self.rank == 0:
            (self.bar.write if self.bar is not None else lambda s: print(s, file=sys.stderr, flush=True))(text)

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, **fields})

    def truncate_after(self, step: int) -> None:
        """Drop step records and events after ``step`` (a rollback's counts at its ``to_step``; kept: earlier ones and
        events without a step): the log of a resumed run stays one trajectory, without the abandoned one's
        ``checkpoint`` / ``finished`` events. Atomic (temp file + rename)."""
        if self.rank != 0 or not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if rec.get("step", rec.get("to_step", 0)) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, self.path)

    def reset(self) -> None:
        """Start the log afresh (rank 0): remove what an earlier run left."""
        if self.rank == 0 and self.path.is_file():
            self.path.unlink()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step records of a metrics.jsonl (events left out), in file order."""
    out = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            out.append(rec)
    return out
