"""The TensorRT run path and the golden check before caching, with a FAKE ``tensorrt`` (its engine runs the ONNX on
ORT CPU) and a FAKE cudart (host memory at real addresses, counted calls). What the fakes prove: the calls dsedge
makes — buffers allocated once per shape, pinned staging, one stream and one synchronize per call, CUDA graph capture
and replay for static shapes, no engine cached when its golden answers are wrong. Not proved: real GPU numbers."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from dsedge.runtime.backends import tensorrt as trt_backend
from dsedge.runtime.backends.tensorrt import TensorRTBackend, build_serialized_engine, open_engine_backend
from dsedge.runtime.build_settings import engine_build_settings
from dsedge.runtime.bundle import IOSpec, Variant, verify_bundle
from dsedge.runtime.engine_cache import EngineCache
from dsedge.runtime.errors import EngineError, OutputMismatchError
from dsedge.runtime.gpu_info import GpuInfo
from dsedge.targets import get_target
from dsedge.toolchain.bundle_writer import write_bundle
from dsedge.toolchain.golden import attach_golden
from fake_cudart import make_fake_cudart
from fake_tensorrt import make_fake_tensorrt
from tiny_models import mlp_onnx

AGX = GpuInfo("NVIDIA Jetson AGX Orin Developer Kit", "8.7", 16)
INPUTS = [{"name": "x", "dtype": "float32", "shape": ["batch", 64]}]


@pytest.fixture
def fakes(monkeypatch):
    def install(**kw):
        rt = make_fake_cudart()
        trt = make_fake_tensorrt(cudart=rt, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(trt_backend, "_cudart", lambda: rt)
        return trt, rt
    return install


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mlp_onnx(tmp_path_factory.mktemp("m") / "m.onnx")


def ort_ref(model, x):
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def plan_for(trt, model, ranges, **kw):
    s = engine_build_settings(get_target("jetson-orin"), {"name": "fp16", "precision": "fp16", "file": "m"}, INPUTS,
                              ranges, **kw)
    return build_serialized_engine(trt, model, s)


def test_buffers_are_kept_per_shape_staged_through_pinned_memory_on_one_stream(fakes, model, monkeypatch):
    trt, rt = fakes()
    monkeypatch.setattr(trt_backend, "MAX_SLOTS", 2)
    b = TensorRTBackend(plan_for(trt, model, {"batch": {"min": 1, "opt": 4, "max": 8}}))
    assert not b.static and not b.cuda_graphs and b.batch_limits == (1, 8)
    rng = np.random.default_rng(0)
    for rows in (2, 2, 3, 2):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(b.run({"x": x})["logits"], ort_ref(model, x), rtol=1e-5, atol=1e-6)
    assert rt.calls["cudaMalloc"] == 4 and rt.calls["cudaMallocHost"] == 4  # (x, logits) x two shapes, once each
    assert rt.calls["cudaStreamCreate"] == 1 and rt.calls["cudaStreamSynchronize"] == 4  # one stream, one sync/call
    assert rt.calls["cudaFree"] == 0 and trt.calls["executed"] == 4
    b.run({"x": np.zeros((5, 64), np.float32)})  # a third shape: the least recently used one (3 rows) is freed
    assert rt.calls["cudaFree"] == 2 and rt.calls["cudaFreeHost"] == 2 and len(b._slots) == 2
    out = b.run({"x": np.ones((2, 64), np.float32)})["logits"]
    out[...] = 0  # results are copies: the next call does not overwrite what a caller holds
    assert b.run({"x": np.ones((2, 64), np.float32)})["logits"].any()
    with pytest.raises(EngineError, match="outside the engine's optimization profile"):
        b.run({"x": np.zeros((9, 64), np.float32)})  # batch 9 > the profile's max 8
    b.close()
    assert not rt.live and rt.calls["cudaStreamDestroy"] == 1


def test_static_shapes_capture_a_cuda_graph_and_replay_it(fakes, model):
    trt, rt = fakes()
    b = TensorRTBackend(plan_for(trt, model, {"batch": {"min": 4, "opt": 4, "max": 4}}))
    assert b.static and b.cuda_graphs and b.batch_limits == (4, 4)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(4)]
    outs = [b.run({"x": x})["logits"] for x in xs]
    for x, y in zip(xs, outs):  # every call answers its own input, graph or not
        np.testing.assert_allclose(y, ort_ref(model, x), rtol=1e-5, atol=1e-6)
    assert rt.calls["cudaStreamBeginCapture"] == 1 and rt.calls["cudaGraphInstantiate"] == 1
    assert rt.calls["cudaGraphLaunch"] == 3 == b.graph_launches  # calls 2-4 replay the graph captured at call 2
    assert trt.calls["executed"] == 4 and rt.calls["cudaMalloc"] == 2
    b.close()
    assert rt.calls["cudaGraphExecDestroy"] == 1 and not rt.live


def test_a_refused_capture_keeps_the_stream_path(fakes, model):
    trt, rt = fakes()
    rt.refuse_capture = True
    b = TensorRTBackend(plan_for(trt, model, {"batch": {"min": 2, "opt": 2, "max": 2}}))
    x = np.ones((2, 64), np.float32)
    for _ in range(3):
        np.testing.assert_allclose(b.run({"x": x})["logits"], ort_ref(model, x), rtol=1e-5, atol=1e-6)
    assert not b.cuda_graphs and rt.calls["cudaGraphLaunch"] == 0 and trt.calls["executed"] == 3


@pytest.fixture(scope="module")
def golden_bundle(tmp_path_factory, model):
    tmp_path = tmp_path_factory.mktemp("golden-trt")
    t = get_target("jetson-orin")
    variants = [Variant("fp16", "fp16", "models/fp16.onnx")]
    ranges = {"batch": {"min": 1, "opt": 4, "max": 8}}
    val = {"x": np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)}
    extra = attach_golden(model, {"models/fp16.onnx": model}, variants, val, [IOSpec("x", "float32", ("batch", 64))],
                          ranges)
    return write_bundle(tmp_path / "m-jetson-orin.dse", name="m", target=t.to_dict(),
                        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                        models={"models/fp16.onnx": model}, variants=variants, default_variant="fp16",
                        shape_ranges=ranges, extra_files=extra)


def test_an_engine_built_here_is_checked_on_golden_io_before_it_is_cached(fakes, golden_bundle, tmp_path):
    m = verify_bundle(golden_bundle)
    cache = EngineCache(tmp_path / "cache")
    trt, rt = fakes()
    b = open_engine_backend(golden_bundle, m, m.variant(), gpu=AGX, cache=cache)
    assert isinstance(b, TensorRTBackend) and trt.calls["builds"] == 1 and trt.calls["executed"] >= 1
    assert len(list(cache.root.glob("*.engine"))) == 1
    open_engine_backend(golden_bundle, m, m.variant(), gpu=AGX, cache=cache)
    assert trt.calls["builds"] == 1  # from the cache (it was checked before it went in)


def test_a_wrong_engine_is_never_cached_and_fails_closed_with_the_figures(fakes, golden_bundle, tmp_path):
    m = verify_bundle(golden_bundle)
    cache = EngineCache(tmp_path / "cache")
    fakes(output_error=0.5)  # an engine whose every output is off by 0.5
    with pytest.raises(OutputMismatchError, match=r"fp16 TensorRT engine built on this device \(not cached\).*"
                                                  r"logits: max abs diff 0\.5 > allowed"):
        open_engine_backend(golden_bundle, m, m.variant(), gpu=AGX, cache=cache)  # not strict: still refused
    assert not list(cache.root.glob("*.engine")) if cache.root.exists() else True


def test_ort_trt_and_cuda_provider_options_come_from_the_bundle(golden_bundle, tmp_path):
    from dsedge.runtime.backends.ort import provider_options

    m = verify_bundle(golden_bundle)
    trt_ep, cuda_ep, cpu_ep = provider_options(["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                "CPUExecutionProvider"], m, m.variant(), cache_dir=tmp_path)
    assert trt_ep["trt_fp16_enable"] and not trt_ep["trt_int8_enable"] and trt_ep["trt_engine_cache_enable"]
    assert trt_ep["trt_engine_cache_path"] == str(tmp_path)
    assert (trt_ep["trt_profile_min_shapes"], trt_ep["trt_profile_opt_shapes"], trt_ep["trt_profile_max_shapes"]) == (
        "x:1x64", "x:4x64", "x:8x64")  # the recipe's optimization profile
    assert trt_ep["trt_max_workspace_size"] == 4096 << 20 and cuda_ep["device_id"] == 0 and cpu_ep == {}


def test_the_iobinding_path_answers_like_run(model):
    from dsedge.runtime.backends.ort import OrtBackend

    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    bound = OrtBackend(model, providers=["CPUExecutionProvider"], iobinding=True)
    plain = OrtBackend(model, providers=["CPUExecutionProvider"])
    assert bound.iobinding and not plain.iobinding  # on CPU only when asked: it is for device outputs
    np.testing.assert_array_equal(bound.run({"x": x})["logits"], plain.run({"x": x})["logits"])


def test_an_engine_dropped_into_a_signed_bundle_later_is_ignored(fakes, golden_bundle, tmp_path, caplog, monkeypatch):
    import logging

    from dsedge.runtime.backends.tensorrt import build_engine_file

    caplog.set_level(logging.INFO, logger="dsedge.engine")
    m = verify_bundle(golden_bundle)
    trt, _ = fakes()
    monkeypatch.setattr(trt_backend, "detect_gpu", lambda: AGX)
    build_engine_file(golden_bundle, m, m.variant(), golden_bundle / "engines")  # written after the build: not listed
    open_engine_backend(golden_bundle, m, m.variant(), gpu=AGX, cache=EngineCache(tmp_path / "c"))
    assert trt.calls["builds"] == 2 and "is not in the manifest's hashes; ignoring it" in caplog.text


def test_ort_trt_engine_cache_is_kept_per_ort_and_tensorrt_version(golden_bundle, tmp_path, monkeypatch):
    # ORT's TensorRT EP names cached engines by model and sm only: after a JetPack (TensorRT) upgrade it would find
    # the old version's engines in the same folder
    import onnxruntime as ort

    from dsedge.runtime.backends.ort import provider_options

    m = verify_bundle(golden_bundle)
    monkeypatch.setenv("DSEDGE_ENGINE_CACHE", str(tmp_path))
    paths = []
    for version in ("10.3.0.30", "10.7.0.23"):
        monkeypatch.setattr(trt_backend, "tensorrt_version", lambda v=version: v)
        (trt_ep,) = provider_options(["TensorrtExecutionProvider"], m, m.variant())
        paths.append(trt_ep["trt_engine_cache_path"])
    assert paths[0] != paths[1] and all(p.startswith(str(tmp_path / "ort-trt")) for p in paths)
    assert f"ort{ort.__version__}-trt10.3.0.30" in paths[0]


def test_provider_entries_that_are_not_names_are_refused_as_such():
    from dsedge.runtime.backends.ort import choose_providers
    from dsedge.runtime.errors import InputError

    with pytest.raises(InputError, match="provider names \\(str\\), got tuple") as e:
        choose_providers([("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})])
    assert "from the bundle" in e.value.hint
    with pytest.raises(InputError, match="got NoneType"):
        choose_providers([None])
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
