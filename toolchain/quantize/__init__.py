"""Quantization: INT4 weight-only (blockwise Q/DQ), INT8, FP16 — ONNX in, ONNX out."""
