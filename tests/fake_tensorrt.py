"""A FAKE ``tensorrt`` module for tests: TensorRT cannot be installed on these machines (only stubs on PyPI).

It mimics the parts of the real Python API dsedge calls (Builder, OnnxParser, IBuilderConfig, optimization profiles,
Runtime, ICudaEngine name-based I/O) and records every call. Its "plan" is ``b"FAKEPLAN"`` + JSON of what the builder
was asked to do, so a test can read the settings back out of a cached engine. It builds and runs nothing.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np


def make_fake_tensorrt(version: str = "10.3.0.30", *, parse_ok: bool = True, build_ok: bool = True) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__doc__ = "FAKE tensorrt (tests only)"
    trt.__version__ = version
    trt.calls = {"builds": 0, "deserialized": 0, "parsed": []}

    class Logger:
        WARNING = 2

        def __init__(self, level=2):
            self.level = level

    class NetworkDefinitionCreationFlag:
        EXPLICIT_BATCH = 0
        STRONGLY_TYPED = 5

    class MemoryPoolType:
        WORKSPACE = "WORKSPACE"

    class BuilderFlag:
        FP16, INT8, BF16, GPU_FALLBACK, SPARSE_WEIGHTS, VERSION_COMPATIBLE = (
            "FP16", "INT8", "BF16", "GPU_FALLBACK", "SPARSE_WEIGHTS", "VERSION_COMPATIBLE")

    class DeviceType:
        GPU, DLA = "GPU", "DLA"

    class HardwareCompatibilityLevel:
        NONE, AMPERE_PLUS = "NONE", "AMPERE_PLUS"

    class TensorIOMode:
        INPUT, OUTPUT = "INPUT", "OUTPUT"

    class Network:
        def __init__(self, flags):
            self.flags = flags

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = [list(lo), list(opt), list(hi)]

    class TimingCache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return b"FAKE-TIMING-CACHE"

    class Config:
        def __init__(self):
            self.flags, self.pools, self.profiles = [], {}, []
            self.default_device_type, self.DLA_core = DeviceType.GPU, -1
            self.hardware_compatibility_level = HardwareCompatibilityLevel.NONE
            self.timing_cache = None

        def set_memory_pool_limit(self, pool, size):
            self.pools[pool] = size

        def set_flag(self, flag):
            self.flags.append(flag)

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

        def create_timing_cache(self, data):
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing_cache = cache

    class OnnxParser:
        def __init__(self, network, logger):
            self.errors = []

        def parse_from_file(self, path):
            trt.calls["parsed"].append(str(path))
            if not parse_ok:
                self.errors = [f"In node 0 (importDequantizeLinear): UNSUPPORTED_NODE: {Path(path).name}"]
            return parse_ok and Path(path).is_file()

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags=0):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            trt.calls["builds"] += 1
            if not build_ok:
                return None
            record = {"network_flags": network.flags, "flags": sorted(config.flags), "pools": config.pools,
                      "shapes": [p.shapes for p in config.profiles], "device": config.default_device_type,
                      "dla_core": config.DLA_core, "hw": config.hardware_compatibility_level,
                      "timing_cache": config.timing_cache is not None, "trt": trt.__version__}
            return b"FAKEPLAN" + json.dumps(record, sort_keys=True).encode()

    class Engine:
        num_io_tensors = 2

        def __init__(self, record):
            self.record = record

        def get_tensor_name(self, i):
            return ["x", "y"][i]

        def get_tensor_mode(self, name):
            return TensorIOMode.INPUT if name == "x" else TensorIOMode.OUTPUT

        def create_execution_context(self):
            return object()

    class Runtime:
        def __init__(self, logger):
            self.DLA_core = -1

        def deserialize_cuda_engine(self, plan):
            trt.calls["deserialized"] += 1
            if not bytes(plan).startswith(b"FAKEPLAN"):
                return None
            return Engine(json.loads(bytes(plan)[8:]))

    def nptype(dtype):
        return np.float32

    for obj in (Logger, NetworkDefinitionCreationFlag, MemoryPoolType, BuilderFlag, DeviceType,
                HardwareCompatibilityLevel, TensorIOMode, OnnxParser, Builder, Runtime, nptype):
        setattr(trt, obj.__name__, obj)
    return trt


def plan_record(plan: bytes) -> dict:
    """What the fake builder was asked to do, read back from a fake plan."""
    assert plan.startswith(b"FAKEPLAN")
    return json.loads(plan[8:])
