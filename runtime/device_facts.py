"""Where benchmark numbers come from: host, CPU, GPU, ONNX Runtime and TensorRT versions, the providers really in use,
and on Jetson the power mode, clock lock and tegrastats (runtime/jetson.py)."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from .backends.tensorrt import tensorrt_version  # noqa: F401  (re-exported: bench, doctor)


def uses_gpu(session: Any) -> bool:
    """True when the session runs on a GPU: the TensorRT backend, or ORT's TensorRT/CUDA execution provider."""
    providers = list(getattr(session, "providers", []))
    return getattr(session, "backend_name", "") == "tensorrt" or any(
        p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") or p.startswith("TensorRT") for p in providers)


def device_info(session: Any) -> dict[str, Any]:
    """Where the numbers come from: host, CPU, GPU (name and compute capability, from ``gpu_info.detect_gpu``),
    ONNX Runtime and TensorRT versions, backend and the providers really in use (ORT falls back to CPU silently, so
    these are read from the session)."""
    from .backends.ort import import_ort
    from .gpu_info import detect_gpu

    ort = import_ort()

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
        "python": platform.python_version(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "backend": getattr(session, "backend_name", "?"), "providers": list(getattr(session, "providers", [])),
        "onnxruntime": ort.__version__, "tensorrt": tensorrt_version(), "gpu": None,
    }
    if uses_gpu(session):
        gpu = detect_gpu()
        info["gpu"] = f"{gpu.name} (sm{gpu.compute_capability.replace('.', '')})" if gpu else "unknown GPU"
        if gpu is not None and (gpu.memory_mb or gpu.clocks_mhz):
            info["gpu_memory_mb"], info["gpu_clocks_mhz"] = gpu.memory_mb, gpu.clocks_mhz
    from . import jetson

    if jetson.is_jetson():
        info["jetson"] = jetson.collect()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
