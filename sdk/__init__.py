"""dsedge — load a bundle and run it. Imports without torch.

    >>> import dsedge
    >>> s = dsedge.load("out/all-minilm-l6-v2-jetson-orin.dse")
    >>> s.providers           # what ONNX Runtime really gave us
    >>> s.run({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
    >>> fut = s.submit(inputs, budget_ms=20)      # -> Future of dsedge.Result or dsedge.Rejected
    >>> for r in s.stream(requests, budget_ms=20): ...
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

from .runtime.errors import (
    BackendUnavailable,
    BundleError,
    BundleIntegrityError,
    DsedgeError,
    InferenceError,
    InputError,
    SessionClosedError,
    SourceError,
    TargetError,
)
from .runtime.results import Rejected, Result
from .session import Session, load

try:
    __version__ = _version("dsedge")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"

__all__ = [
    "load", "Session", "DsedgeError", "BundleError", "BundleIntegrityError", "InputError", "InferenceError",
    "SourceError", "TargetError", "BackendUnavailable", "SessionClosedError", "Result", "Rejected", "__version__",
]
