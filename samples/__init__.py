"""Sample applications built on dsedge's public API and CLI (run from the repository root)."""
from __future__ import annotations

import os
from pathlib import Path

SHARED_DATA = Path("../shared/data")  # where the samples' defaults and configs name the project's real data


def data_path(p: str | os.PathLike) -> Path:
    """``p``, or for a relative path under ``../shared/data`` (the samples' defaults and configs) the same file under
    ``$DSEDGE_DATA`` when that is set: the data rule the tests follow (tests/conftest.py)."""
    q = Path(p)
    root = os.environ.get("DSEDGE_DATA")
    if root and not q.is_absolute():
        try:
            return Path(root) / q.relative_to(SHARED_DATA)
        except ValueError:
            pass
    return q
