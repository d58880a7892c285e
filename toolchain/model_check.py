"""The last check of a model before it enters a bundle: ``onnx.checker.check_model(full_check=True)``."""
from __future__ import annotations

import os
from pathlib import Path

from ..runtime.errors import QuantizationError


def check_onnx_file(path: str | os.PathLike, name: str | None = None) -> None:
    """Check the ONNX file at ``path`` with the full checker (graph rules plus strict shape inference); the path form
    reads models over 2 GB and external data too.

    Raises:
        QuantizationError: the graph is invalid (e.g. a name defined twice), naming the model and the checker's
            first line.
    """
    import onnx

    try:
        onnx.checker.check_model(os.fspath(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
        raise QuantizationError(f"model {name or Path(path).name} is not a valid ONNX graph: {first}",
                                "nothing was written; build another precision (or report this as a dsedge bug "
                                "with the build log)") from None
