"""Which NVIDIA GPU this machine has: name, compute capability, SM count — the part of an engine cache key that says
where an engine can run — plus memory and clocks for reports. No torch: the CUDA runtime via cuda-python (name,
compute capability, SM count), then NVML via ``nvidia-ml-py`` (discrete GPUs: name, compute capability, memory and SM/
memory clocks; it has no SM count, so a key made from NVML alone has 0 SMs), then ``nvidia-smi``, else the Jetson
device tree (Jetson has no NVML).

Jetson modules all report the CUDA device name ``"Orin"`` (or ``"Xavier"``) and the same compute capability (sm87 for
AGX Orin, Orin NX and Orin Nano), so on Jetson the name comes from ``/proc/device-tree/model``
(``"NVIDIA Jetson AGX Orin Developer Kit"``) and the SM count is kept in the key too.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any
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
    memory_mb: int = 0                      # total device memory, MiB (0 = unknown)
    clocks_mhz: dict | None = field(default=None, compare=False)  # {"sm", "sm_max", "memory", "memory_max"}

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
    try:
        err, props = cudart.cudaGetDeviceProperties(0)
    except Exception:  # cuda-python raises (RuntimeError "Failed to dlopen libcudart/libcuda") with no driver here
        return None
    if int(err) != 0:
        return None
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return GpuInfo(name, f"{props.major}.{props.minor}", int(props.multiProcessorCount),
                   int(getattr(props, "totalGlobalMem", 0)) >> 20)


def from_nvml(nvml: Any = None) -> GpuInfo | None:
    """GPU 0 from NVML (``pynvml``, the ``nvidia-ml-py`` package): name, compute capability, total memory, current and
    max SM / memory clocks. None when NVML is missing or fails (no driver, a Jetson)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no discrete GPU here
        return None
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        name = nvml.nvmlDeviceGetName(h)
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        mem = int(nvml.nvmlDeviceGetMemoryInfo(h).total) >> 20
        clocks = {}
        for key, kind, fn in (("sm", nvml.NVML_CLOCK_SM, nvml.nvmlDeviceGetClockInfo),
                              ("sm_max", nvml.NVML_CLOCK_SM, nvml.nvmlDeviceGetMaxClockInfo),
                              ("memory", nvml.NVML_CLOCK_MEM, nvml.nvmlDeviceGetClockInfo),
                              ("memory_max", nvml.NVML_CLOCK_MEM, nvml.nvmlDeviceGetMaxClockInfo)):
            try:
                clocks[key] = int(fn(h, kind))
            except Exception:  # a clock the GPU does not report
                continue
        return GpuInfo(name, f"{major}.{minor}", 0, mem, clocks or None)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


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
    try:
        jetson = jetson_from_device_tree(DEVICE_TREE_MODEL.read_text(errors="replace"))
    except OSError:
        jetson = None
    cuda = _from_cuda_python()
    if jetson:
        return GpuInfo(jetson.name, cuda.compute_capability if cuda else jetson.compute_capability,
                       cuda.sm_count if cuda else 0)
    return combine(cuda, from_nvml) or _from_nvidia_smi()


def combine(cuda: GpuInfo | None, nvml: Any = from_nvml) -> GpuInfo | None:
    """cuda-python's identity (name, compute capability, SM count: the engine-cache key) with NVML's memory and
    clocks; NVML alone when cuda-python is missing."""
    facts = nvml()
    if cuda is None:
        return facts
    if facts is None:
        return cuda
    return replace(cuda, memory_mb=cuda.memory_mb or facts.memory_mb, clocks_mhz=facts.clocks_mhz)
