"""The build's scratch directory: a fresh ``.dsedge-build-PID-…`` inside the output directory (so the final
rename never crosses filesystems), removed whatever happens; stale ones of dead processes are removed first."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from ...runtime.bundle import remove_stale_temp
from ...runtime.tempdirs import owned_temp_dir, release


@contextlib.contextmanager
def workdir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield ``OUT/.dsedge-build-PID-XXXX/`` with an empty ``models/`` inside; removed on exit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp(out)
    work = owned_temp_dir(out, f".dsedge-build-{os.getpid()}-")  # locked by this process while it lives
    (work / "models").mkdir()
    try:
        yield work
    finally:
        release(work)
