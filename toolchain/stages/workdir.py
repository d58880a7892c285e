"""The build's scratch directory: a fresh ``.dsedge-build-PID-…`` inside the output directory (so the final
rename never crosses filesystems), removed whatever happens; stale ones of dead processes are removed first."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ...runtime.bundle import remove_stale_temp


@contextlib.contextmanager
def workdir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield ``OUT/.dsedge-build-PID-XXXX/`` with an empty ``models/`` inside; removed on exit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp(out)
    work = Path(tempfile.mkdtemp(prefix=f".dsedge-build-{os.getpid()}-", dir=out))
    (work / "models").mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
