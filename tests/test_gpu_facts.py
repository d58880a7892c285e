"""GPU facts: NVML (a FAKE pynvml module here: no NVIDIA driver on these machines) after cuda-python, for name,
memory and clocks; the engine-cache identity (SM count) stays cuda-python's; Jetson keeps the device-tree name."""
from __future__ import annotations

import types

from dsedge.runtime import gpu_info
from dsedge.runtime.gpu_info import GpuInfo, combine, from_nvml


def fake_nvml(fail_init: bool = False):
    m = types.ModuleType("pynvml")
    m.__doc__ = "FAKE pynvml (tests only)"
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 1, 2
    m.calls = []

    def init():
        m.calls.append("init")
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=143771 << 20, used=0, free=143771 << 20)
    m.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1980, 2: 3201}[kind]
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: {1: 1980, 2: 3201}[kind]
    return m


def test_nvml_gives_name_memory_and_clocks_and_shuts_down():
    nvml = fake_nvml()
    g = from_nvml(nvml)
    assert g == GpuInfo("NVIDIA H200", "9.0", 0, 143771)
    assert g.clocks_mhz == {"sm": 1980, "sm_max": 1980, "memory": 3201, "memory_max": 3201}
    assert nvml.calls == ["init", "shutdown"]
    assert from_nvml(fake_nvml(fail_init=True)) is None  # no driver (or a Jetson): nothing, no error


def test_cuda_python_identity_wins_and_nvml_adds_memory_and_clocks():
    cuda = GpuInfo("NVIDIA H200", "9.0", 132, 0)
    g = combine(cuda, lambda: from_nvml(fake_nvml()))
    assert (g.name, g.compute_capability, g.sm_count, g.memory_mb) == ("NVIDIA H200", "9.0", 132, 143771)
    assert g.clocks_mhz["sm_max"] == 1980
    assert combine(None, lambda: from_nvml(fake_nvml())).sm_count == 0
    assert combine(cuda, lambda: None) == cuda


def test_jetson_keeps_the_device_tree_name_without_nvml(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.write_text("NVIDIA Jetson AGX Orin Developer Kit\x00")
    monkeypatch.setattr(gpu_info, "DEVICE_TREE_MODEL", model)
    monkeypatch.setattr(gpu_info, "_from_cuda_python", lambda: GpuInfo("Orin", "8.7", 16))
    monkeypatch.setattr(gpu_info, "from_nvml", lambda nvml=None: (_ for _ in ()).throw(AssertionError("no NVML")))
    gpu_info.detect_gpu.cache_clear()
    try:
        assert gpu_info.detect_gpu() == GpuInfo("NVIDIA Jetson AGX Orin Developer Kit", "8.7", 16)
    finally:
        gpu_info.detect_gpu.cache_clear()


def test_cuda_python_without_a_driver_means_no_gpu_not_a_crash(monkeypatch, tmp_path):
    # a [gpu] install in a container started without --gpus: cuda-python imports, its calls cannot load the driver
    import sys

    rt = types.ModuleType("runtime")
    rt.__doc__ = "FAKE cuda.bindings.runtime (tests only)"

    def props(i):
        raise RuntimeError("Failed to dlopen libcuda.so.1")

    rt.cudaGetDeviceProperties = props
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    monkeypatch.setattr(gpu_info, "DEVICE_TREE_MODEL", tmp_path / "no-model")
    monkeypatch.setattr(gpu_info, "from_nvml", lambda nvml=None: None)
    monkeypatch.setattr(gpu_info, "_from_nvidia_smi", lambda: None)
    assert gpu_info._from_cuda_python() is None
    gpu_info.detect_gpu.cache_clear()
    try:
        assert gpu_info.detect_gpu() is None
    finally:
        gpu_info.detect_gpu.cache_clear()
