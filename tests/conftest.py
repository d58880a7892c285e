"""Shared pytest fixtures. Real data lives in ../shared/data beside the repo (or $DSEDGE_DATA)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$DSEDGE_DATA`` or ``<repo>/../shared/data``; fails the test with a clear message when missing."""
    d = Path(os.environ.get("DSEDGE_DATA", REPO.parent / "shared" / "data"))
    if not d.is_dir():
        pytest.fail(f"real test data not found at {d}: check out ../shared beside the repo or set DSEDGE_DATA",
                    pytrace=False)
    return d


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return shared_data_dir()
