"""Logging for the ``dsedge`` command: one stderr handler at the level ``-v`` / ``-q`` ask for, and Python warnings
(third-party ``TracerWarning``, ``UserWarning``, …) routed to the log, where they show with ``-v`` only.

As a library dsedge installs no handler: the application configures logging; without any, WARNING and above reach
stderr through Python's last-resort handler.
"""
from __future__ import annotations

import logging
import warnings

_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}


class _WarningsOnlyWhenVerbose(logging.Filter):
    def __init__(self, verbosity: int) -> None:
        super().__init__()
        self.verbosity = verbosity

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "py.warnings" or self.verbosity >= 1


def configure_cli_logging(verbosity: int) -> None:
    """``verbosity``: -1 (``-q``: errors only), 0 (warnings), 1 (``-v``: info and Python warnings), 2+ (``-vv``:
    debug, e.g. each build stage's time). Idempotent: a second call replaces the handler."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_dsedge_cli", False)]:
        root.removeHandler(h)
    try:
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False)
    except ImportError:  # rich is a core dependency; keep logging working without it anyway
        handler = logging.StreamHandler()
    handler._dsedge_cli = True  # type: ignore[attr-defined]
    handler.addFilter(_WarningsOnlyWhenVerbose(verbosity))
    root.addHandler(handler)
    level = _LEVELS.get(verbosity, logging.DEBUG if verbosity > 1 else logging.ERROR)
    handler.setLevel(level)
    logging.getLogger("dsedge").setLevel(level)
    logging.getLogger("py.warnings").setLevel(logging.WARNING)
    logging.captureWarnings(False)  # re-capture: an embedding app (or a test runner) may have reset showwarning
    logging.captureWarnings(True)
    warnings.simplefilter("default")
