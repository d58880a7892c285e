"""A FAKE ``tensorrt`` module for tests: TensorRT cannot be installed on these machines (only stubs on PyPI).

It mimics the parts of the real Python API dsedge calls (Builder, OnnxParser, IBuilderConfig, optimization profiles,
Runtime, ICudaEngine name-based I/O, IExecutionContext) and records every call. Its "plan" is ``b"FAKEPLAN"`` + JSON
of what the builder was asked to do (and which ONNX file it parsed), so a test can read the settings back out of a
cached engine. It builds nothing: its "engine" runs the parsed ONNX file with ONNX Runtime CPU, reading inputs from
and writing outputs to the addresses set with ``set_tensor_address`` (host memory from ``fake_cudart``), on the
fake stream (so CUDA graph capture records it). ``output_error`` adds that much to every output: a broken engine.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np


def make_fake_tensorrt(version: str = "10.3.0.30", *, parse_ok: bool = True, build_ok: bool = True,
                       output_error: float = 0.0, cudart=None) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__doc__ = "FAKE tensorrt (tests only)"
    trt.__version__ = version
    trt.calls = {"builds": 0, "deserialized": 0, "parsed": [], "executed": 0, "set_input_shape": 0}

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
            self.onnx = None

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
            self.network = network

        def parse_from_file(self, path):
            trt.calls["parsed"].append(str(path))
            self.network.onnx = str(path)
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
                      "timing_cache": config.timing_cache is not None, "trt": trt.__version__,
                      "onnx": network.onnx}
            return b"FAKEPLAN" + json.dumps(record, sort_keys=True).encode()

    class Engine:
        def __init__(self, record):
            import onnx
            from onnx import helper

            self.record = record
            graph = onnx.load(record["onnx"], load_external_data=False).graph
            inits = {t.name for t in graph.initializer}
            self.io = {}
            for vi, mode in [(v, TensorIOMode.INPUT) for v in graph.input if v.name not in inits] + \
                    [(v, TensorIOMode.OUTPUT) for v in graph.output]:
                dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name
                self.io[vi.name] = (mode, dtype)
            self.names = list(self.io)
            self.profile = (record.get("shapes") or [{}])[0]
            self._ort = None

        @property
        def num_io_tensors(self):
            return len(self.names)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.io[name][0]

        def get_tensor_dtype(self, name):
            return self.io[name][1]

        def get_tensor_shape(self, name):
            lo, _, hi = self.profile.get(name, [[-1], [-1], [-1]])
            return tuple(a if a == b else -1 for a, b in zip(lo, hi))

        def get_tensor_profile_shape(self, name, index):
            return tuple(tuple(s) for s in self.profile[name])

        def ort(self):
            if self._ort is None:
                import onnxruntime as ort

                self._ort = ort.InferenceSession(self.record["onnx"], providers=["CPUExecutionProvider"])
            return self._ort

        def create_execution_context(self):
            return Context(self)

    class Context:
        def __init__(self, engine):
            self.engine, self.shapes, self.addresses, self._out_shapes = engine, {}, {}, {}

        def set_input_shape(self, name, shape):
            trt.calls["set_input_shape"] += 1
            lo, _, hi = self.engine.profile.get(name, [shape, shape, shape])
            if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                return False
            self.shapes[name] = tuple(int(s) for s in shape)
            return True

        def _feeds(self, read=None):
            out = {}
            for name, (mode, dtype) in self.engine.io.items():
                if mode == TensorIOMode.INPUT:
                    shape = self.shapes[name]
                    out[name] = read(name, shape, dtype) if read else np.zeros(shape, dtype)
            return out

        def get_tensor_shape(self, name):
            key = tuple(sorted(self.shapes.items()))
            if key not in self._out_shapes:
                got = self.engine.ort().run(None, self._feeds())
                self._out_shapes[key] = {o.name: g.shape for o, g in zip(self.engine.ort().get_outputs(), got)}
            return self._out_shapes[key][name]

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = int(ptr)

        def execute_async_v3(self, stream_handle):
            import ctypes

            shapes, addresses = dict(self.shapes), dict(self.addresses)

            def view(name, shape, dtype):
                n = int(np.prod(shape))
                buf = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(addresses[name])
                return np.frombuffer(buf, dtype=dtype, count=n).reshape(shape)

            def op():
                trt.calls["executed"] += 1
                feeds = {k: view(k, shapes[k], d).copy() for k, (m, d) in self.engine.io.items()
                         if m == TensorIOMode.INPUT}
                for o, got in zip(self.engine.ort().get_outputs(), self.engine.ort().run(None, feeds)):
                    view(o.name, got.shape, self.engine.io[o.name][1])[...] = got + output_error

            if cudart is not None:
                cudart.enqueue(stream_handle, op)
            else:
                op()
            return True

    class Runtime:
        def __init__(self, logger):
            self.DLA_core = -1
            self.engine_host_code_allowed = False  # TensorRT >= 8.6

        def deserialize_cuda_engine(self, plan):
            trt.calls["deserialized"] += 1
            if not bytes(plan).startswith(b"FAKEPLAN"):
                return None
            record = json.loads(bytes(plan)[8:])
            # as TensorRT: a version-compatible plan embeds the lean runtime (host code) and deserializes only when
            # the runtime was told to trust it
            if BuilderFlag.VERSION_COMPATIBLE in record["flags"] and not self.engine_host_code_allowed:
                return None
            return Engine(record)

    def nptype(dtype):
        return np.dtype(dtype).type

    for obj in (Logger, NetworkDefinitionCreationFlag, MemoryPoolType, BuilderFlag, DeviceType,
                HardwareCompatibilityLevel, TensorIOMode, OnnxParser, Builder, Runtime, nptype):
        setattr(trt, obj.__name__, obj)
    return trt


def plan_record(plan: bytes) -> dict:
    """What the fake builder was asked to do, read back from a fake plan."""
    assert plan.startswith(b"FAKEPLAN")
    return json.loads(plan[8:])
