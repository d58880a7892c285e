"""This dsedge's version (the installed distribution's; ``0.0.0+src`` in a source tree without install)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("dsedge")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
