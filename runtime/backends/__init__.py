"""Backends that run a bundle's ONNX: ONNX Runtime (always) and TensorRT (import-guarded)."""
