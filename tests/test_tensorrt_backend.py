"""TensorRT backend up to the hardware: the import guard, the builder calls, lazy on-device build and the engine cache.

TensorRT cannot be installed here, so ``fake_tensorrt.make_fake_tensorrt`` (a FAKE ``tensorrt`` module, named as such)
stands in for it; it records the builder calls and returns a plan holding them. Running an engine needs a GPU and is
covered only on a device.
"""
from __future__ import annotations

import logging
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.backends import tensorrt as trt_backend
from dsedge.runtime.backends.tensorrt import (TensorRTBackend, build_engine_file, build_serialized_engine,
                                               import_tensorrt, open_engine_backend)
from dsedge.runtime.build_settings import engine_build_settings
from dsedge.runtime.bundle import IOSpec, Variant, read_manifest, sha256_file, verify_bundle, write_manifest
from dsedge.runtime import engine_cache as engine_cache_mod
from dsedge.runtime.engine_cache import EngineCache, read_engine
from dsedge.runtime.errors import BackendUnavailable, EngineError, TargetError
from dsedge.runtime.gpu_info import GpuInfo
from dsedge.targets import get_target
from dsedge.toolchain.bundle_writer import write_bundle
from fake_cudart import make_fake_cudart
from fake_tensorrt import make_fake_tensorrt, plan_record

AGX = GpuInfo("NVIDIA Jetson AGX Orin Developer Kit", "8.7", 16)
NX = GpuInfo("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", "8.7", 8)
H200 = GpuInfo("NVIDIA H200", "9.0", 132)
RANGES = {"batch": {"min": 1, "opt": 4, "max": 8}}
INPUTS = [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], [w])
    p = tmp_path_factory.mktemp("onnx") / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), p)
    return p


def make_bundle(tmp_path, onnx_file, target="jetson-orin"):
    t = get_target(target)
    return write_bundle(
        tmp_path / f"m-{t.name}.dse", name="m", target=t.to_dict(), inputs=[IOSpec("x", "float32", ("batch", 4))],
        outputs=[IOSpec("y", "float32", ("batch", 2))],
        models={"models/int8.onnx": onnx_file, "models/fp16.onnx": onnx_file},
        variants=[Variant("int8", "int8", "models/int8.onnx"), Variant("fp16", "fp16", "models/fp16.onnx")],
        default_variant="int8", shape_ranges=RANGES)


@pytest.fixture
def fake_trt(monkeypatch):
    def install(version="10.3.0.30", **kw):
        fake = make_fake_tensorrt(version, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        monkeypatch.setattr(trt_backend, "_cudart", make_fake_cudart)  # a TensorRT host has cuda-python too
        return fake
    return install


# ---- import guard ----------------------------------------------------------------------------------------------
def test_without_tensorrt_the_sdk_says_so_and_returns_none(tmp_path, onnx_file, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt → ImportError, as on this machine
    with pytest.raises(BackendUnavailable) as e:
        import_tensorrt()
    assert "tensorrt" in str(e.value) and "ONNX Runtime" in e.value.hint
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    assert open_engine_backend(bundle, m, m.variant(), gpu=AGX, cache=EngineCache(tmp_path / "c")) is None
    assert "TensorRT is not installed" in caplog.text and "using ONNX Runtime" in caplog.text


def test_old_tensorrt_is_refused(fake_trt):
    fake_trt("8.4.3.1")
    with pytest.raises(BackendUnavailable, match="8.4.3.1 is too old"):
        import_tensorrt()


def test_cpu_bundle_never_uses_tensorrt(tmp_path, onnx_file, fake_trt):
    fake = fake_trt()
    bundle = make_bundle(tmp_path, onnx_file, "cpu")
    m = read_manifest(bundle)
    assert open_engine_backend(bundle, m, m.variant(), gpu=AGX, cache=EngineCache(tmp_path / "c")) is None
    assert fake.calls["builds"] == 0


# ---- builder calls = recipe settings -----------------------------------------------------------------------------
def build_record(fake, target, variant, onnx_file, tmp_path, **kw):
    s = engine_build_settings(get_target(target), variant, INPUTS, RANGES, **kw)
    return s, plan_record(build_serialized_engine(fake, onnx_file, s, timing_cache=tmp_path / "tc.cache"))


def test_int8_on_orin_sets_the_recipes_flags_profile_workspace_and_timing_cache(tmp_path, onnx_file, fake_trt):
    fake = fake_trt()
    s, rec = build_record(fake, "jetson-orin", {"name": "int8", "precision": "int8", "file": "m"}, onnx_file, tmp_path)
    assert rec["flags"] == ["FP16", "INT8"] and rec["network_flags"] == 0
    assert rec["pools"] == {"WORKSPACE": 4096 << 20}
    assert rec["shapes"] == [{"x": [[1, 4], [4, 4], [8, 4]]}]
    assert rec["device"] == "GPU" and rec["hw"] == "NONE" and rec["timing_cache"]
    assert (tmp_path / "tc.cache").read_bytes() == b"FAKE-TIMING-CACHE"


def test_fp16_builds_strongly_typed_on_10_and_weakly_with_explicit_batch_on_85(tmp_path, onnx_file, fake_trt):
    fake = fake_trt("10.3.0.30")
    _, rec = build_record(fake, "jetson-orin", {"name": "fp16", "precision": "fp16", "file": "m"}, onnx_file, tmp_path)
    assert rec["network_flags"] == 1 << 5 and rec["flags"] == []
    fake = fake_trt("8.5.2.2")
    _, rec = build_record(fake, "jetson-xavier", {"name": "fp16", "precision": "fp16", "file": "m"}, onnx_file, tmp_path)
    assert rec["network_flags"] == 1 << 0 and rec["flags"] == ["FP16"]


def test_dla_and_compatibility_settings_reach_the_builder(tmp_path, onnx_file, fake_trt):
    fake = fake_trt()
    cnn = {"name": "int8", "precision": "int8", "file": "m", "ops": ["Conv", "Relu"]}
    _, rec = build_record(fake, "jetson-orin", cnn, onnx_file, tmp_path, dla_core=1)
    assert rec["device"] == "DLA" and rec["dla_core"] == 1 and "GPU_FALLBACK" in rec["flags"]
    assert rec["shapes"] == [{"x": [[4, 4], [4, 4], [4, 4]]}]  # DLA: static
    fake = fake_trt("10.15.1.29")
    _, rec = build_record(fake, "a100", {"name": "i", "precision": "int8", "file": "m", "sparsity": "2:4"},
                          onnx_file, tmp_path)
    assert rec["hw"] == "AMPERE_PLUS" and {"VERSION_COMPATIBLE", "SPARSE_WEIGHTS"} <= set(rec["flags"])


def test_parser_and_build_failures_are_one_line_engine_errors(tmp_path, onnx_file, fake_trt):
    s = engine_build_settings(get_target("t4"), {"name": "int8", "precision": "int8", "file": "m"}, INPUTS, RANGES)
    with pytest.raises(EngineError, match="UNSUPPORTED_NODE"):
        build_serialized_engine(fake_trt(parse_ok=False), onnx_file, s)
    with pytest.raises(EngineError, match="failed to build the int8 engine"):
        build_serialized_engine(fake_trt(build_ok=False), onnx_file, s)


# ---- lazy build + cache through open_engine_backend ---------------------------------------------------------------
def test_lazy_build_caches_and_rebuilds_only_when_stale(tmp_path, onnx_file, fake_trt, caplog):
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "cache")
    fake = fake_trt("10.3.0.30")
    b = open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    assert isinstance(b, TensorRTBackend) and b.name == "tensorrt" and b.providers == ["TensorRT 10.3.0.30"]
    assert b.input_names == ["x"] and b.output_names == ["y"] and fake.calls["builds"] == 1
    (slot,) = cache.root.glob("*.engine")
    header, plan = read_engine(slot)
    assert header["key"]["model_sha256"] == m.files["models/int8.onnx"] and plan_record(plan)["flags"] == ["FP16", "INT8"]
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    assert fake.calls["builds"] == 1  # second load: from the cache
    fake = fake_trt("10.4.0.26")  # TensorRT upgraded on the device
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    assert fake.calls["builds"] == 1 and "built with TensorRT 10.3.0.30, this is TensorRT 10.4.0.26" in caplog.text
    open_engine_backend(bundle, m, m.variant("int8"), gpu=NX, cache=cache)  # same sm87, other module
    assert fake.calls["builds"] == 2 and len(list(cache.root.glob("*.engine"))) == 2
    slot.write_bytes(slot.read_bytes()[:-3])  # truncated engine
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    assert fake.calls["builds"] == 3 and "corrupt or truncated" in caplog.text


def test_dla_and_gpu_engines_of_one_variant_are_cached_side_by_side(tmp_path, onnx_file, fake_trt, caplog):
    """Found by review: a DLA engine and a GPU engine of one variant shared one cache slot, so alternating loads
    rebuilt (and evicted) each other's engine every time."""
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "cache")
    fake = fake_trt()
    gpu = open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    dla = open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache, dla_core=0)
    assert gpu.providers == ["TensorRT 10.3.0.30"] and dla.providers == ["TensorRT 10.3.0.30 (DLA 0)"]
    assert fake.calls["builds"] == 2
    for core in (None, 0, None, 0):  # each from its own slot now
        open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache, dla_core=core)
    assert fake.calls["builds"] == 2 and "rebuilding" not in caplog.text
    records = {read_engine(f)[0]["key"]["dla_core"]: plan_record(read_engine(f)[1])
               for f in cache.root.glob("*.engine")}
    assert records[None]["device"] == "GPU" and records[0]["device"] == "DLA" and len(records) == 2


def test_undeserializable_cached_plan_is_rebuilt_once(tmp_path, onnx_file, fake_trt, caplog):
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "cache")
    fake = fake_trt()
    s = engine_build_settings(m.target, {"name": "int8", "precision": "int8", "file": "models/int8.onnx"},
                              INPUTS, RANGES)
    key = trt_backend.engine_key(fake, AGX, s, m.files["models/int8.onnx"])
    cache.put(key, b"not a plan TensorRT accepts")
    b = open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    assert b is not None and fake.calls["builds"] == 1 and "could not deserialize" in caplog.text
    assert read_engine(cache.path_for(key))[1].startswith(b"FAKEPLAN")


def test_build_failure_falls_back_to_ort_or_raises_when_strict(tmp_path, onnx_file, fake_trt):
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    fake_trt(build_ok=False)
    assert open_engine_backend(bundle, m, m.variant(), gpu=AGX, cache=EngineCache(tmp_path / "c")) is None
    with pytest.raises(EngineError):
        open_engine_backend(bundle, m, m.variant(), gpu=AGX, cache=EngineCache(tmp_path / "c"), strict=True)
    assert not list((tmp_path / "c").glob("*.engine"))  # nothing half-written


def test_prebuilt_engine_in_bundle_is_used_on_its_gpu_only(tmp_path, onnx_file, fake_trt, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    fake = fake_trt()
    monkeypatch.setattr(trt_backend, "detect_gpu", lambda: AGX)
    path = build_engine_file(bundle, m, m.variant("int8"), bundle / "engines")  # `dsedge build --engine`
    assert path.parent.name == "engines" and fake.calls["builds"] == 1
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=EngineCache(tmp_path / "c"))
    assert fake.calls["builds"] == 2 and "is not in the manifest's hashes" in caplog.text   # dropped in: not used
    m.files[f"engines/{path.name}"] = sha256_file(path)            # what `dsedge build --engine` hash-lists
    fake.calls["builds"] = 1
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=EngineCache(tmp_path / "c2"))
    assert fake.calls["builds"] == 1 and "using prebuilt engine" in caplog.text
    open_engine_backend(bundle, m, m.variant("int8"), gpu=NX, cache=EngineCache(tmp_path / "c"))
    assert fake.calls["builds"] == 2 and "is not for this device: built for GPU" in caplog.text


def test_version_compatible_engines_of_data_center_targets_load(tmp_path, onnx_file, fake_trt, monkeypatch, caplog):
    """Found by review: the a100/h100 profiles build version-compatible plans (lean runtime embedded: host code),
    which TensorRT deserializes only with ``runtime.engine_host_code_allowed = True``; the backend never set it, so
    every such engine was built, refused at load, and the bundle silently ran on ONNX Runtime (or, strict, raised)."""
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    a100 = GpuInfo("NVIDIA A100-SXM4-80GB", "8.0", 108)
    bundle = make_bundle(tmp_path, onnx_file, target="a100")
    m = verify_bundle(bundle)
    fake = fake_trt("10.15.1.29")
    cache = EngineCache(tmp_path / "cache")
    b = open_engine_backend(bundle, m, m.variant("int8"), gpu=a100, cache=cache, strict=True)
    assert isinstance(b, TensorRTBackend) and b.runtime.engine_host_code_allowed is True
    (slot,) = cache.root.glob("*.engine")
    assert "VERSION_COMPATIBLE" in plan_record(read_engine(slot)[1])["flags"]
    b = open_engine_backend(bundle, m, m.variant("int8"), gpu=a100, cache=cache, strict=True)  # from the cache
    assert isinstance(b, TensorRTBackend) and fake.calls["builds"] == 1
    monkeypatch.setattr(trt_backend, "detect_gpu", lambda: a100)
    path = build_engine_file(bundle, m, m.variant("fp16"), bundle / "engines")  # `dsedge build --engine`, shipped
    m.files[f"engines/{path.name}"] = sha256_file(path)
    assert isinstance(open_engine_backend(bundle, m, m.variant("fp16"), gpu=a100, cache=cache, strict=True),
                      TensorRTBackend) and "using prebuilt engine" in caplog.text
    # a GPU engine that is not version-compatible (jetson) does not get host code allowed
    jb = make_bundle(tmp_path / "j", onnx_file)
    jm = verify_bundle(jb)
    b = open_engine_backend(jb, jm, jm.variant("int8"), gpu=AGX, cache=cache, strict=True)
    assert b.runtime.engine_host_code_allowed is False


def test_engine_build_on_the_wrong_gpu_is_refused(tmp_path, onnx_file, fake_trt, monkeypatch):
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    fake_trt("10.15.1.29")
    monkeypatch.setattr(trt_backend, "detect_gpu", lambda: H200)
    with pytest.raises(TargetError, match="sm90.*sm87"):
        build_engine_file(bundle, m, m.variant("int8"), tmp_path / "engines")


# ---- a device that is not quite what the target profile says ----------------------------------------------------
def test_tensorrt_without_cuda_python_falls_back_to_ort_before_building(tmp_path, onnx_file, fake_trt, monkeypatch,
                                                                         caplog):
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    fake = fake_trt()
    monkeypatch.setattr(trt_backend, "_cudart", lambda: (_ for _ in ()).throw(
        BackendUnavailable("the TensorRT backend needs cuda-python for device buffers", "pip install cuda-python")))
    assert open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=EngineCache(tmp_path / "c")) is None
    assert fake.calls["builds"] == 0 and "cuda-python" in caplog.text and "using ONNX Runtime" in caplog.text


def test_engine_settings_follow_the_installed_tensorrt_not_the_profiles(tmp_path, onnx_file, fake_trt, caplog):
    bundle = make_bundle(tmp_path, onnx_file)   # jetson-orin: profile says TensorRT 10.3; JetPack 6.0 ships 8.6
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "c")
    fake = fake_trt("8.6.2.3")
    open_engine_backend(bundle, m, m.variant("fp16"), gpu=AGX, cache=cache)
    (slot,) = cache.root.glob("*.engine")
    rec = plan_record(read_engine(slot)[1])
    assert rec["flags"] == ["FP16"] and rec["network_flags"] == 1 << 0  # weakly typed FP16, explicit batch on 8.x
    assert fake.calls["builds"] == 1


@pytest.mark.parametrize("how", ["file", "unwritable"])
def test_an_unwritable_engine_cache_still_runs_the_engine_and_says_it_is_not_cached(tmp_path, onnx_file, fake_trt,
                                                                                    monkeypatch, caplog, how):
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    fake = fake_trt()
    root = tmp_path / "cache"
    if how == "file":
        root.write_text("not a folder")
    else:
        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied", str(root))
        monkeypatch.setattr(trt_backend, "write_bytes_atomic", refuse, raising=False)  # the timing cache
        monkeypatch.setattr(engine_cache_mod, "write_bytes_atomic", refuse)  # the engine
    b = open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=EngineCache(root))
    assert isinstance(b, TensorRTBackend) and fake.calls["builds"] == 1
    assert "not cached" in caplog.text and "timing cache" in caplog.text


def test_timing_cache_is_kept_per_gpu_and_tensorrt_version_and_written_atomically(tmp_path, onnx_file, fake_trt):
    bundle = make_bundle(tmp_path, onnx_file)
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "c")
    fake_trt("10.3.0.30")
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    fake_trt("10.4.0.26")
    open_engine_backend(bundle, m, m.variant("int8"), gpu=AGX, cache=cache)
    open_engine_backend(bundle, m, m.variant("int8"), gpu=NX, cache=cache)
    names = sorted(p.name for p in cache.root.glob("timing*"))
    assert len(names) == 3 and all("trt10-" in n for n in names), names  # no shared file, no temporary left


def test_doctor_says_when_an_installed_tensorrt_cannot_be_used(fake_trt, monkeypatch, capsys):
    import importlib.machinery
    import json

    from cli_helpers import run_main

    def installed(version):  # as if importable from site-packages (doctor asks importlib for it)
        fake_trt(version).__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)

    installed("8.4.3.1")  # below dsedge's 8.5 floor: load falls back to ORT
    code, out, _ = run_main(["doctor"], capsys)
    assert code == 0 and "8.4.3.1, not usable: TensorRT 8.4.3.1 is too old" in out
    installed("10.3.0.30")
    monkeypatch.setattr(trt_backend, "_cudart", lambda: (_ for _ in ()).throw(
        BackendUnavailable("the TensorRT backend needs cuda-python for device buffers", "pip install cuda-python")))
    code, out, _ = run_main(["doctor", "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["tensorrt"] == "10.3.0.30" and "cuda-python" in r["tensorrt_backend"]


def test_a_bundle_for_a_gpu_target_probes_tensorrt_once_per_load_not_per_instance(tmp_path, onnx_file, monkeypatch,
                                                                                   caplog):
    """Found by a user: loading a jetson bundle on a CPU host logged the fall back to ONNX Runtime once for the
    session's backend and once more for each streaming instance."""
    import dsedge

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on this machine
    bundle = make_bundle(tmp_path, onnx_file)
    caplog.set_level(logging.INFO, logger="dsedge.engine")
    with dsedge.load(bundle, instances=2) as s:
        lanes = [l for l in s._core().lanes if not l.fallback]
        assert len(lanes) == 2 and s.providers == ["CPUExecutionProvider"]
        assert s.submit({"x": np.ones((1, 4), np.float32)}, budget_ms=10_000).result(10).ok
    assert caplog.text.count("TensorRT is not installed") == 1, caplog.text
