"""Which NVIDIA GPU this machine has: name, compute capability, SM count — the part of an engine cache key that says
where an engine can run. No torch: CUDA runtime via cuda-python, else ``nvidia-smi``, else the Jetson device tree.

Jetson modules all report the CUDA device name ``"Orin"`` (or ``"Xavier"``) and the same compute capability (sm87 for
AGX Orin, Orin NX and Orin Nano), so on Jetson the name comes from ``/proc/device-tree/model``
(``"NVIDIA Jetson AGX Orin Developer Kit"``) and the SM count is kept in the key too.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
# Jetson module families → compute capability (CUDA GPUs table).
JETSON_CC = {"orin": "8.7", "xavier": "7.2", "thor": "11.0", "nano": "5.3", "tx2": "6.2"}


@dataclass(frozen=True)
class GpuInfo:
    """One GPU: ``name`` (``"NVIDIA A100-SXM4-80GB"``), ``compute_capability`` (``"8.0"``), ``sm_count`` (0 = unknown)."""

    name: str
    compute_capability: str
    sm_count: int = 0

    @property
    def sm(self) -> str:
        return "sm" + self.compute_capability.replace(".", "")


def parse_nvidia_smi(text: str) -> GpuInfo | None:
    """First GPU from ``nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader`` output."""
    for line in text.strip().splitlines():
        name, _, cc = line.rpartition(",")
        cc = cc.strip()
        if name.strip() and cc.replace(".", "", 1).isdigit():
            return GpuInfo(name.strip(), cc)
    return None


def jetson_from_device_tree(model: str) -> GpuInfo | None:
    """GpuInfo from the device-tree model string (``"NVIDIA Jetson AGX Orin Developer Kit\\0"``); None if not Jetson."""
    model = model.replace("\x00", "").strip()
    low = model.lower()
    if "jetson" not in low:
        return None
    for family, cc in JETSON_CC.items():
        if family in low:
            return GpuInfo(model, cc)
    return None


def _from_cuda_python() -> GpuInfo | None:
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # type: ignore[no-redef]
    except ImportError:
        return None
    err, props = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        return None
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return GpuInfo(name, f"{props.major}.{props.minor}", int(props.multiProcessorCount))


def _from_nvidia_smi() -> GpuInfo | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(r.stdout) if r.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def detect_gpu() -> GpuInfo | None:
    """The first GPU, or None when there is none (or no way to ask). On Jetson the device-tree model names it.
    Asked once per process (nvidia-smi takes tens of ms)."""
    gpu = _from_cuda_python() or _from_nvidia_smi()
    try:
        jetson = jetson_from_device_tree(DEVICE_TREE_MODEL.read_text(errors="replace"))
    except OSError:
        jetson = None
    if jetson:
        return GpuInfo(jetson.name, gpu.compute_capability if gpu else jetson.compute_capability,
                       gpu.sm_count if gpu else 0)
    return gpu
