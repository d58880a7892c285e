"""TensorRT backend: build an engine from a bundle's ONNX on the device (same settings as ``build/trtexec.sh``), cache
it, load it, run it with device buffers. Written against the real ``tensorrt`` Python API (≥ 8.5: name-based I/O,
``set_input_shape``/``set_tensor_address``/``execute_async_v3``) and cuda-python for device memory; both imported only
when used, so this module imports anywhere.

Verified here (tests, with a FAKE ``tensorrt`` module and a FAKE cudart over host memory): the import guard, the
builder calls (network flags, precision flags, optimization profile, workspace, DLA, sparsity, compatibility, timing
cache), engine caching and staleness, the golden check before caching, and the run path's calls (buffers allocated
once per shape, pinned staging, one stream, one synchronize per call, CUDA graph capture and replay for static shapes).
Verified only on a device: that TensorRT and CUDA accept those calls, and the engine's numbers.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..build_settings import EngineBuildSettings, engine_build_settings
from ..engine_cache import EngineCache, EngineKey, SUFFIX, load_matching, settings_digest, write_engine
from ..errors import BackendUnavailable, EngineError, TargetError
from ..files import write_bytes_atomic
from ..gpu_info import GpuInfo, detect_gpu

log = logging.getLogger("dsedge.engine")
MIN_TRT = (8, 5)
INSTALL_HINT = ("TensorRT ships with JetPack on Jetson; on x86 `pip install tensorrt cuda-python`. "
                "dsedge runs the bundle with ONNX Runtime meanwhile")


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, checked to be ≥ 8.5.

    Raises:
        BackendUnavailable: not installed (or only the PyPI stub that cannot load libnvinfer), or too old.
    """
    try:
        import tensorrt as trt
    except (ImportError, OSError) as e:  # the PyPI stub raises at import when libnvinfer is absent
        raise BackendUnavailable(f"TensorRT is not installed here (Python package 'tensorrt' >= "
                                 f"{MIN_TRT[0]}.{MIN_TRT[1]}): {str(e).splitlines()[0][:120] if str(e) else 'missing'}",
                                 INSTALL_HINT) from None
    version = str(getattr(trt, "__version__", "0"))
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()] + [0, 0]
    if tuple(parts[:2]) < MIN_TRT:
        raise BackendUnavailable(f"TensorRT {version} is too old: dsedge needs >= {MIN_TRT[0]}.{MIN_TRT[1]}",
                                 "upgrade TensorRT (JetPack 5.1+ on Jetson)")
    return trt


def tensorrt_unusable_reason() -> str | None:
    """Why dsedge's TensorRT backend cannot run here (one line: TensorRT missing, broken or too old, no cuda-python,
    no GPU), or None when it can. ``dsedge doctor`` prints it: an installed ``tensorrt`` is not a usable one."""
    try:
        import_tensorrt()
        _cudart()
    except BackendUnavailable as e:
        return str(e)
    return None if detect_gpu() is not None else "no NVIDIA GPU found on this machine"


def tensorrt_version() -> str | None:
    """The installed TensorRT's version, or None. JetPack's system package may lack pip metadata: then it is imported."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    for name in ("tensorrt", "tensorrt-cu12", "tensorrt-cu11"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    if importlib.util.find_spec("tensorrt") is None:
        return None
    try:
        import tensorrt

        return str(getattr(tensorrt, "__version__", "installed"))
    except Exception:  # a broken install: report it as present, the backend says why it cannot run
        return "installed"


def _trt_major(trt: Any) -> int:
    return int(str(trt.__version__).split(".")[0])


def build_serialized_engine(trt: Any, onnx_path: str | os.PathLike, s: EngineBuildSettings,
                            timing_cache: str | os.PathLike | None = None) -> bytes:
    """Parse the ONNX and build a serialized plan with settings ``s`` (the recipe's settings).

    Raises:
        EngineError: the ONNX parser rejects the model (first parser errors quoted), or the build fails.
    """
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = _trt_major(trt)
    flags = 0
    if major < 10:  # explicit batch is the only mode from 10.0 (the flag was removed)
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if s.strongly_typed and major == 10:  # 11.x: always strongly typed
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(os.fspath(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineError(f"TensorRT's ONNX parser rejected {Path(onnx_path).name}: "
                          f"{'; '.join(errors[:2])[:300] or 'no detail'}",
                          "check the opset/ops against the target's TensorRT (dsedge targets NAME)")
    config = builder.create_builder_config()
    if s.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s.workspace_mb << 20)
    if major < 11:
        for f in s.precision_flags:
            config.set_flag(getattr(trt.BuilderFlag, f.upper()))
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in s.shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    if s.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = s.dla_core
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    if s.sparsity:
        config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
    if s.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if s.hardware_compatibility == "ampere+":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    cache = None
    if timing_cache is not None:
        tc = Path(timing_cache)
        try:
            data = tc.read_bytes() if tc.is_file() else b""
        except OSError:  # unreadable: time the tactics afresh
            data = b""
        cache = config.create_timing_cache(data)
        if cache is None and data:  # a blob TensorRT cannot read (truncated, foreign): start an empty one
            log.warning("timing cache %s is unreadable; starting an empty one", tc.name)
            cache = config.create_timing_cache(b"")
        if cache is not None:
            config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT failed to build the {s.variant} engine (see the TensorRT log above)",
                          "try a larger workspace or another precision; run build/trtexec.sh --verbose by hand")
    if cache is not None:
        try:  # atomic: a concurrent build reads the old cache or the new one, never half of one
            write_bytes_atomic(timing_cache, bytes(cache.serialize()))
        except OSError as e:  # the timing cache only speeds up the next build
            log.warning("cannot write the timing cache %s (%s); the next build times its tactics again",
                        timing_cache, e.strerror or type(e).__name__)
    return bytes(plan)


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]
        except ImportError:
            raise BackendUnavailable("the TensorRT backend needs cuda-python for device buffers",
                                     "pip install cuda-python") from None
    return cudart


def _check(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise EngineError(f"CUDA call failed: {err}", "check the GPU and driver (nvidia-smi / tegrastats)")
    return rest[0] if len(rest) == 1 else (rest or None)


MAX_SLOTS = 8  # input-shape combinations whose buffers are kept (least recently used ones are freed)


class _Slot:
    """Buffers for one combination of input shapes: a device buffer and a pinned (page-locked) host buffer per I/O
    tensor, both allocated once; optionally the CUDA graph that replays copy-in, execute and copy-out."""

    def __init__(self, cudart: Any, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype]) -> None:
        self.cudart = cudart
        self.shapes, self.dtypes = shapes, dtypes
        self.device: dict[str, int] = {}
        self.pinned: dict[str, int] = {}
        self.host: dict[str, np.ndarray] = {}
        self.graph = self.graph_exec = None
        self.runs = 0
        try:
            for name, shape in shapes.items():
                nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtypes[name].itemsize, 1)
                self.device[name] = int(_check(cudart.cudaMalloc(nbytes)))
                self.pinned[name] = int(_check(cudart.cudaMallocHost(nbytes)))
                buf = (ctypes.c_byte * nbytes).from_address(self.pinned[name])
                self.host[name] = np.frombuffer(buf, dtype=dtypes[name], count=int(np.prod(shape, dtype=np.int64))
                                                ).reshape(shape)
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        c = self.cudart
        if self.graph_exec is not None:
            c.cudaGraphExecDestroy(self.graph_exec)
        if self.graph is not None:
            c.cudaGraphDestroy(self.graph)
        self.graph = self.graph_exec = None
        for ptr in self.device.values():
            c.cudaFree(ptr)
        for ptr in self.pinned.values():
            c.cudaFreeHost(ptr)
        self.device, self.pinned, self.host = {}, {}, {}


class TensorRTBackend:
    """A deserialized engine and its execution context, run on one CUDA stream.

    Per combination of input shapes (an optimization-profile shape) the device buffers and pinned host staging
    buffers are allocated once and reused (``MAX_SLOTS`` kept, LRU); a call copies inputs into pinned memory,
    enqueues host→device copies, ``execute_async_v3`` and device→host copies on the one stream and synchronizes once.
    For an engine with static shapes (DLA, or a profile with min = max) the second call captures those three steps
    in a CUDA graph and later calls replay it (``cudaGraphLaunch``); if capture fails the stream path is kept.

    Args:
        plan: serialized engine bytes (``EngineCache`` / ``read_engine``).
        dla_core: the DLA core the engine was built for, or None.
        cuda_graphs: capture CUDA graphs for static shapes (default True).
        version_compatible: the plan was built version-compatible (``BuilderFlag.VERSION_COMPATIBLE``, the a100/h100
            profiles). Such a plan embeds TensorRT's lean runtime, i.e. host code, and TensorRT (>= 8.6) refuses to
            deserialize it unless the runtime is told to trust it (``engine_host_code_allowed``); dsedge only loads
            plans it built here or that the verified manifest hash-lists.
    Raises:
        BackendUnavailable: TensorRT missing. EngineError: the plan cannot be deserialized (corrupt, or built by
            another TensorRT version or for another GPU).
    """

    name = "tensorrt"

    def __init__(self, plan: bytes, dla_core: int | None = None, cuda_graphs: bool = True,
                 version_compatible: bool = False) -> None:
        self.trt = trt = import_tensorrt()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self._logger)
        if version_compatible and hasattr(self.runtime, "engine_host_code_allowed"):
            self.runtime.engine_host_code_allowed = True  # the plan carries the lean runtime (host code)
        if dla_core is not None:
            self.runtime.DLA_core = int(dla_core)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineError("TensorRT could not deserialize the engine (corrupt, or built by another TensorRT "
                              "version or for another GPU)", "delete it; dsedge rebuilds it on the next load")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.providers = [f"TensorRT {trt.__version__}" + (f" (DLA {dla_core})" if dla_core is not None else "")]
        self.static = all(-1 not in tuple(self.engine.get_tensor_shape(n)) for n in self.input_names)
        self.cuda_graphs = cuda_graphs and self.static
        self.graph_launches = 0
        self._stream = None
        self._cudart: Any = None
        self._slots: OrderedDict[tuple, _Slot] = OrderedDict()
        self._bound: tuple | None = None
        self._lock = threading.Lock()

    @property
    def batch_limits(self) -> tuple[int, int]:
        """(min, max) rows of the first input in optimization profile 0 (what one call may take)."""
        name = self.input_names[0]
        try:
            lo, _, hi = self.engine.get_tensor_profile_shape(name, 0)
            return int(lo[0]), int(hi[0])
        except Exception:  # static engines, or a TensorRT without profile queries for this tensor
            shape = tuple(self.engine.get_tensor_shape(name))
            return (int(shape[0]), int(shape[0])) if shape and shape[0] > 0 else (1, 1 << 30)

    def _slot(self, key: tuple, shapes: dict[str, tuple[int, ...]]) -> _Slot:
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        for name, shape in shapes.items():
            if self.context.set_input_shape(name, shape) is False:
                raise EngineError(f"input {name!r} shape {list(shape)} is outside the engine's optimization profile",
                                  "send shapes within the bundle's shape ranges (dsedge inspect BUNDLE)")
        self._bound = key
        all_shapes = dict(shapes)
        for name in self.output_names:
            all_shapes[name] = tuple(int(d) for d in self.context.get_tensor_shape(name))
        slot = _Slot(self._cudart, all_shapes, self.dtypes)
        self._slots[key] = slot
        while len(self._slots) > MAX_SLOTS:
            _, old = self._slots.popitem(last=False)
            old.free()
        return slot

    def _bind(self, key: tuple, slot: _Slot) -> None:
        if self._bound != key:
            for name in self.input_names:
                self.context.set_input_shape(name, slot.shapes[name])
            self._bound = key
        for name, ptr in slot.device.items():
            self.context.set_tensor_address(name, ptr)

    def _enqueue(self, slot: _Slot) -> None:
        c, stream = self._cudart, self._stream
        h2d, d2h = c.cudaMemcpyKind.cudaMemcpyHostToDevice, c.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name in self.input_names:
            _check(c.cudaMemcpyAsync(slot.device[name], slot.pinned[name], slot.host[name].nbytes, h2d, stream))
        if not self.context.execute_async_v3(int(stream)):
            raise EngineError("TensorRT execution failed", "see the TensorRT log; check input shapes are in range")
        for name in self.output_names:
            _check(c.cudaMemcpyAsync(slot.pinned[name], slot.device[name], slot.host[name].nbytes, d2h, stream))

    def _capture(self, slot: _Slot) -> None:
        c, stream = self._cudart, self._stream
        try:
            _check(c.cudaStreamBeginCapture(stream, c.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
            try:
                self._enqueue(slot)
            finally:
                graph = _check(c.cudaStreamEndCapture(stream))
            slot.graph = graph
            slot.graph_exec = _check(c.cudaGraphInstantiate(graph, 0))
        except EngineError as e:  # some engines cannot be captured: keep the stream path
            log.info("CUDA graph capture failed (%s); running without graphs", e)
            self.cuda_graphs = False
            if slot.graph is not None:
                c.cudaGraphDestroy(slot.graph)
            slot.graph = slot.graph_exec = None

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch: host arrays in, host arrays out (copies), keyed by IO name. Inputs are cast to the engine's
        dtypes (TensorRT 8.x engines take int32 where the ONNX says int64). Thread-safe (one call at a time).

        Raises:
            EngineError: a CUDA call or the execution failed.
        """
        with self._lock:
            if self._cudart is None:
                self._cudart = _cudart()
            if self._stream is None:
                self._stream = _check(self._cudart.cudaStreamCreate())
            shapes = {n: tuple(int(d) for d in np.shape(inputs[n])) for n in self.input_names}
            key = tuple(shapes[n] for n in self.input_names)
            slot = self._slot(key, shapes)
            for name in self.input_names:
                np.copyto(slot.host[name], np.asarray(inputs[name]), casting="same_kind")
            self._bind(key, slot)
            if slot.graph_exec is None and self.cuda_graphs and slot.runs >= 1:
                self._capture(slot)
            if slot.graph_exec is not None:
                _check(self._cudart.cudaGraphLaunch(slot.graph_exec, self._stream))
                self.graph_launches += 1
            else:
                self._enqueue(slot)
            _check(self._cudart.cudaStreamSynchronize(self._stream))
            slot.runs += 1
            return {name: slot.host[name].copy() for name in self.output_names}

    def close(self) -> None:
        """Free every device and pinned buffer, CUDA graph and the stream."""
        with self._lock:
            for slot in self._slots.values():
                slot.free()
            self._slots.clear()
            if self._stream is not None and self._cudart is not None:
                self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def engine_key(trt: Any, gpu: GpuInfo, s: EngineBuildSettings, model_sha256: str) -> EngineKey:
    """The cache key for settings ``s`` on this GPU and TensorRT."""
    return EngineKey(variant=s.variant, gpu=gpu.name, compute_capability=gpu.compute_capability,
                     sm_count=gpu.sm_count, tensorrt=str(trt.__version__), model_sha256=model_sha256,
                     settings_sha256=settings_digest(s.digest_fields()), dla_core=s.dla_core)


def _variant_dict(variant: Any) -> dict[str, Any]:
    if isinstance(variant, Mapping):
        return dict(variant)
    return {"name": variant.name, "precision": variant.precision, "file": variant.file}


def _settings(manifest: Any, variant: Any, dla_core: int | None, trt: Any = None) -> EngineBuildSettings:
    """Build settings for ``variant``; with ``trt`` (the installed module) they are spelled for the TensorRT that
    really builds the engine, not the one the target profile names (JetPack 6.0's 8.6 under a 10.3 profile: weak
    typing with ``FP16``, not a strongly typed network 8.6 cannot make; 8.x refuses BF16/INT4 up front)."""
    target = manifest.target
    if trt is not None:
        installed = ".".join(str(trt.__version__).split(".")[:2])
        target = {**dict(target), "tensorrt": {**dict(target.get("tensorrt") or {}), "version": installed}}
    return engine_build_settings(target, _variant_dict(variant), [i.to_dict() for i in manifest.inputs],
                                 manifest.shape_ranges, dla_core=dla_core)


def check_gpu_matches_target(gpu: GpuInfo, target: Mapping[str, Any]) -> None:
    """Raises TargetError when this GPU's compute capability differs from the target's (an engine built here would
    not run there)."""
    cc = str(target.get("compute_capability") or "")
    if cc and cc != gpu.compute_capability:
        raise TargetError(f"this machine's GPU {gpu.name!r} is {gpu.sm}, target {target.get('name')} is "
                          f"sm{cc.replace('.', '')}: an engine built here would not run there",
                          "build the engine on the target device (dsedge.load builds it on first use)")


def build_engine_file(bundle_dir: str | os.PathLike, manifest: Any, variant: Any, out_dir: str | os.PathLike,
                      dla_core: int | None = None) -> Path:
    """``dsedge build --engine``: build the variant's engine on this machine into ``out_dir`` (the bundle's
    ``engines/``, inside the temporary bundle directory) under its cache-slot name, so ``dsedge.load`` on the same
    GPU and TensorRT finds it.

    Raises:
        BackendUnavailable: no TensorRT or no GPU. TargetError: this GPU is not the target's. EngineError: build failed.
    """
    trt = import_tensorrt()
    gpu = detect_gpu()
    if gpu is None:
        raise BackendUnavailable("no NVIDIA GPU found on this machine", "build engines on the target device")
    check_gpu_matches_target(gpu, manifest.target)
    s = _settings(manifest, variant, dla_core, trt)
    root = Path(bundle_dir)
    plan = build_serialized_engine(trt, root / s.onnx_file, s, timing_cache=root / "build" / "timing.cache")
    key = engine_key(trt, gpu, s, manifest.files.get(s.onnx_file) or _sha(root / s.onnx_file))
    return write_engine(Path(out_dir) / key.slot(), plan, key, {"notes": list(s.notes)})


def _sha(path: Path) -> str:
    from ..bundle import sha256_file

    return sha256_file(path)


def _golden_check(root: Path, manifest: Any, variant: Any) -> Callable[[TensorRTBackend, str], Any] | None:
    """A check of a fresh engine against the bundle's golden I/O, or None for bundles without it."""
    from ..golden import check_run, has_golden, load_golden, require_pass

    if not hasattr(manifest, "files") or not has_golden(manifest):
        return None
    golden = load_golden(root, manifest)
    var = manifest.variant(variant.name if hasattr(variant, "name") else variant["name"])

    def check(backend: TensorRTBackend, origin: str) -> Any:
        report = check_run(root, manifest, var, backend.run, backend="tensorrt", providers=backend.providers,
                           golden=golden, limits=backend.batch_limits)
        require_pass(report, what=f"the {var.name} TensorRT engine {origin}")
        log.info("engine for %s passed the golden check (%s)", var.name, "; ".join(
            f"{k}: cosine min {o['cosine_min']:.5f}, max abs diff {o['max_abs_diff']:.3g}"
            for k, o in report.outputs.items()))
        return report

    return check


def open_engine_backend(bundle_dir: str | os.PathLike, manifest: Any, variant: Any, *,
                        cache: EngineCache | None = None, gpu: GpuInfo | None = None,
                        dla_core: int | None = None, strict: bool = False) -> TensorRTBackend | None:
    """A TensorRT backend for ``variant`` when this machine can run one, else None (the caller uses ORT).

    Order: a matching prebuilt engine in ``bundle/engines/`` (hash-listed in the manifest), then the engine cache,
    else build on this device and cache it (keyed by GPU name, compute capability, SM count, TensorRT version, model
    sha256 and build settings). A stale, foreign or corrupt engine is never loaded: it is rebuilt, with a log line on
    ``dsedge.engine`` saying why. An engine built here or shipped prebuilt is run on the bundle's golden inputs first
    (runtime/golden.py) and is cached only when it passes; one that fails is never cached and raises (fails closed).

    Args:
        bundle_dir: the verified ``.dse`` directory. manifest / variant: its ``Manifest`` and ``Variant``.
        cache: engine cache (default ``$DSEDGE_ENGINE_CACHE`` or ``~/.cache/dsedge/engines``).
        gpu: this GPU (default: detected). dla_core: run on this DLA core (Jetson).
        strict: raise instead of returning None when TensorRT is present but the engine cannot be built or loaded.
    Returns:
        a backend with ``.name == "tensorrt"``, ``.providers``, ``.run(inputs)``; or None when the target is not a
        TensorRT target, TensorRT is not installed, or there is no GPU (each logged once at INFO).
    Raises:
        OutputMismatchError: the engine's golden answers are outside the build-time tolerance (figures in the
            message); load with ``providers=[...]`` to run on ONNX Runtime instead.
    """
    target = manifest.target
    if target.get("backend") != "tensorrt":
        return None
    try:
        trt = import_tensorrt()
    except BackendUnavailable as e:
        log.info("%s; using ONNX Runtime", e)
        return None
    try:  # the engine runs on device buffers: without cuda-python, building one would be minutes for nothing
        _cudart()
    except BackendUnavailable as e:
        log.info("TensorRT is installed but %s (%s); using ONNX Runtime", e, e.hint)
        return None
    gpu = gpu or detect_gpu()
    if gpu is None:
        log.info("TensorRT is installed but no NVIDIA GPU was found; using ONNX Runtime")
        return None
    root = Path(bundle_dir)
    try:
        s = _settings(manifest, variant, dla_core, trt)
        check = _golden_check(root, manifest, variant)
        key = engine_key(trt, gpu, s, manifest.files.get(s.onnx_file) or _sha(root / s.onnx_file))
        cache = cache or EngineCache()
        verified: dict[str, TensorRTBackend] = {}

        def build() -> bytes:
            return build_serialized_engine(trt, root / s.onnx_file, s, timing_cache=cache.root / key.timing_cache_name())

        def verify(plan: bytes) -> None:  # before the engine enters the cache
            backend = TensorRTBackend(plan, dla_core=s.dla_core, version_compatible=s.version_compatible)
            if check is not None:
                check(backend, "built on this device (not cached)")
            verified["backend"] = backend

        plan = _prebuilt(root, key, manifest)
        if plan is not None:
            backend = TensorRTBackend(plan, dla_core=s.dla_core, version_compatible=s.version_compatible)
            if check is not None:
                check(backend, "shipped in the bundle (engines/)")
            return backend
        plan, built = cache.get_or_build(key, build, verify)
        if built:
            return verified["backend"]
        try:
            return TensorRTBackend(plan, dla_core=s.dla_core, version_compatible=s.version_compatible)
        except EngineError as e:  # readable file, but TensorRT refuses it: rebuild once
            log.warning("engine for %s: %s; rebuilding", s.variant, e)
            plan = build()
            verify(plan)
            cache.store(key, plan)
            return verified["backend"]
    except (EngineError, TargetError) as e:
        if strict:
            raise
        log.warning("TensorRT engine unavailable (%s); using ONNX Runtime", e)
        return None


def _prebuilt(root: Path, key: EngineKey, manifest: Any = None) -> bytes | None:
    """A matching engine shipped in the bundle's ``engines/``; logs why others of this variant do not match.
    Only files the manifest hash-lists count (a file dropped into ``engines/`` later is ignored)."""
    engines = root / "engines"
    files = getattr(manifest, "files", None)
    plan, reason = None, None
    if files is not None and f"engines/{key.slot()}" not in files:
        if (engines / key.slot()).is_file():
            log.warning("engines/%s is not in the manifest's hashes; ignoring it", key.slot())
    else:
        plan, reason = load_matching(engines / key.slot(), key)
    if plan is not None:
        log.info("using prebuilt engine engines/%s", key.slot())
        return plan
    if reason:
        log.warning("prebuilt engine engines/%s %s; building for this device", key.slot(), reason)
    same_model = key.slot()[: key.slot().index(key.model_sha256[:16]) + 16]  # "<variant>-<model hash>"
    for other in sorted(engines.glob(f"*{SUFFIX}")) if engines.is_dir() else []:
        if other.name == key.slot() or not other.name.startswith(same_model):
            continue
        _, why = load_matching(other, key)
        if why:
            log.info("prebuilt engine engines/%s is not for this device: %s", other.name, why)
    return None
