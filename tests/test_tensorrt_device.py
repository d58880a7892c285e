"""On a machine with an NVIDIA GPU and TensorRT only (marked `device`; skipped elsewhere, CI skips it):
detect the GPU, build a real engine through `open_engine_backend`, run it with device buffers, compare with ORT,
and load it again from the cache."""
from __future__ import annotations

import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def trt_and_gpu():
    from dsedge.runtime.backends.tensorrt import import_tensorrt
    from dsedge.runtime.errors import BackendUnavailable
    from dsedge.runtime.gpu_info import detect_gpu

    try:
        trt = import_tensorrt()
    except BackendUnavailable as e:
        pytest.skip(str(e))
    gpu = detect_gpu()
    if gpu is None:
        pytest.skip("no NVIDIA GPU")
    return trt, gpu


def test_real_engine_builds_runs_matches_ort_and_is_cached(tmp_path, trt_and_gpu):
    from dsedge.runtime.backends.tensorrt import open_engine_backend
    from dsedge.runtime.bundle import IOSpec, Variant, verify_bundle
    from dsedge.runtime.engine_cache import EngineCache
    from dsedge.toolchain.bundle_writer import write_bundle

    trt, gpu = trt_and_gpu
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])], [w])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), model)
    target = {"name": "this-gpu", "backend": "tensorrt", "compute_capability": gpu.compute_capability,
              "tensorrt": {"version": trt.__version__}, "workspace_mb": 1024, "dla_cores": 0,
              "shapes": {"batch": {"min": 1, "opt": 4, "max": 16}}}
    bundle = write_bundle(tmp_path / "m-this-gpu.dse", name="m", target=target,
                          inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("y", "float32", ("batch", 32))],
                          models={"models/fp32.onnx": model}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                          default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 4, "max": 16}})
    m = verify_bundle(bundle)
    cache = EngineCache(tmp_path / "cache")
    t0 = time.perf_counter()
    backend = open_engine_backend(bundle, m, m.variant(), cache=cache, strict=True)
    t_build = time.perf_counter() - t0
    x = rng.standard_normal((5, 64)).astype(np.float32)
    got = backend.run({"x": x})["y"]
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)  # TF32 on Ampere+
    t0 = time.perf_counter()
    again = open_engine_backend(bundle, m, m.variant(), cache=cache, strict=True)
    t_load = time.perf_counter() - t0
    np.testing.assert_allclose(again.run({"x": x})["y"], got)
    print(f"\n{gpu} TensorRT {trt.__version__}: first load (build) {t_build:.2f} s, cached load {t_load:.3f} s, "
          f"max |TRT-ORT| {float(np.abs(got - ref).max()):.2e}", file=sys.stderr)
