"""Opset upgrades for sources exported below 21 (INT4 block DequantizeLinear needs opset 21, IR version 10)."""
from __future__ import annotations


def upgrade_opset(model, opset: int = 21):  # type: ignore[no-untyped-def]
    """Convert ``model`` to ``opset`` with onnx.version_converter and raise the IR version to at least 10.

    version_converter leaves IR version 8, which ORT rejects for opset 21 models.
    """
    import onnx
    from onnx import version_converter

    converted = version_converter.convert_version(model, opset)
    converted.ir_version = max(converted.ir_version, 10)
    onnx.checker.check_model(converted)
    return converted
