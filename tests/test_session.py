"""The SDK: load verifies, picks providers honestly, validates inputs; imports without torch."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest

import dsedge
from dsedge.runtime.errors import BackendUnavailable, BundleIntegrityError, InputError
from tiny_models import tiny_bundle


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("session")
    return dsedge.load(tiny_bundle(tmp / "mlp-cpu.dse", tmp))


def test_run_matches_numpy_reference(session):
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(session.path / "models/fp32.onnx"))
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    want = np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"].T + w["b2"]
    got = session.run({"x": x})["logits"]
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_io_specs_and_providers_are_reported(session):
    assert [(s.name, s.dtype, s.shape) for s in session.inputs] == [("x", "float32", ("batch", 64))]
    assert session.outputs[0].name == "logits"
    assert session.providers and session.providers[-1] == "CPUExecutionProvider"
    assert session.describe()["variant"] == "fp32"


@pytest.mark.parametrize("inputs, message", [
    ({}, "missing input 'x'"),
    ({"x": np.zeros((1, 64), np.float32), "y": np.zeros(1)}, "unknown input 'y'"),
    ({"x": np.zeros((1, 64), np.float64)}, "dtype float64, expected float32"),
    ({"x": np.zeros((1, 63), np.float32)}, "dim 1 is 63, expected 64"),
    ({"x": np.zeros((64,), np.float32)}, "expected rank 2"),
    ({"x": np.zeros((33, 64), np.float32)}, "outside the bundle's range"),
])
def test_bad_inputs_raise_one_line_errors(session, inputs, message):
    with pytest.raises(InputError, match=message) as e:
        session.run(inputs)
    assert "\n" not in str(e.value) and e.value.hint


def test_symbolic_dims_must_agree_across_inputs():
    from dsedge.runtime.bundle import IOSpec
    from dsedge.runtime.io import validate_inputs

    specs = [IOSpec("a", "int64", ("batch", "sequence")), IOSpec("b", "int64", ("batch", "sequence"))]
    validate_inputs(specs, {"a": np.zeros((2, 5), np.int64), "b": np.zeros((2, 5), np.int64)})
    with pytest.raises(InputError, match="'b' has sequence=4 but 'a' has sequence=5"):
        validate_inputs(specs, {"a": np.zeros((2, 5), np.int64), "b": np.zeros((2, 4), np.int64)})


def test_a_dtype_mismatch_says_what_differs_and_how_to_pass_it():
    """A user's pass: a big-endian float32 array read "has dtype >f4, expected float32", and a Python list "has
    dtype float64", as if a float64 array had been passed."""
    from dsedge.runtime.bundle import IOSpec
    from dsedge.runtime.io import validate_inputs

    specs = [IOSpec("x", "float32", ("batch", 3))]
    with pytest.raises(InputError, match=r"^input 'x' has dtype >f4 \(big-endian float32\), expected float32$"):
        validate_inputs(specs, {"x": np.zeros((1, 3), ">f4")})
    with pytest.raises(InputError) as e:
        validate_inputs(specs, {"x": [[0.5, 1.0, 2.0]]})
    assert str(e.value) == ("input 'x' has dtype float64 (numpy's dtype for a Python list of such values), expected "
                            "float32") and e.value.hint == "pass np.asarray(..., dtype=np.float32)"
    with pytest.raises(InputError) as e:
        validate_inputs(specs, {"x": np.zeros((1, 3), np.float64)})
    assert str(e.value) == "input 'x' has dtype float64, expected float32"
    assert e.value.hint == "convert it with .astype(np.float32)"


def test_load_refuses_tampered_bundle(tmp_path):
    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    with open(b / "models/fp32.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleIntegrityError):
        dsedge.load(b)


def test_unknown_provider_is_refused(tmp_path):
    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    with pytest.raises(BackendUnavailable, match="NoSuchExecutionProvider"):
        dsedge.load(b, providers=["NoSuchExecutionProvider"])


@pytest.mark.parametrize("providers", [[], (), ""])
def test_empty_providers_are_refused_not_taken_as_the_default(tmp_path, providers):
    """Found by review: ``providers=[]`` loaded on the default chain without a word (None is "no preference")."""
    from dsedge.runtime.backends.ort import OrtBackend

    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    with pytest.raises(InputError, match="names no provider") as e:
        dsedge.load(b, providers=providers)
    assert "\n" not in str(e.value) and "omit providers=" in e.value.hint and "CPUExecutionProvider" in e.value.hint
    with pytest.raises(InputError, match="names no provider"):
        OrtBackend(b / "models/fp32.onnx", providers=providers)


@pytest.mark.parametrize("kwargs, words", [
    (dict(providers=123), "providers must be a list of ONNX Runtime provider names, got int 123"),
    (dict(providers={"CPUExecutionProvider": {}}), "providers must be a list of ONNX Runtime provider names"),
    (dict(instances=10**6), "instances=1000000 is more than 4 per core"),
    (dict(threads=100_000), "threads=100000 is more than 4 per core"),
])
def test_option_errors_come_before_anything_is_opened(tmp_path, monkeypatch, kwargs, words):
    """A user's pass: providers=123 raised a bare TypeError from inside the provider choice, and instances= past
    4 per core was refused only after the backend had been opened."""
    from dsedge.runtime import backends

    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    opened = []
    real = backends.open_backend
    monkeypatch.setattr(dsedge.session, "open_backend", lambda *a: opened.append(a) or real(*a))
    with pytest.raises(InputError, match=words):
        dsedge.load(b, **kwargs)
    assert opened == []


def test_an_intra_op_thread_count_past_4_per_core_is_refused_by_every_opener(tmp_path):
    """A user's pass: `dsedge bench --threads 100000` had ONNX Runtime start 100,000 OS threads and ran the host out
    of process ids; load(), the backend itself (bench, verify, build's timing) and `dsedge serve` refuse it first."""
    from dsedge.runtime.backends.ort import OrtBackend
    from dsedge.runtime.instances import host_cores

    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    most = 4 * host_cores()
    with pytest.raises(InputError, match=f"threads={most + 1} is more than 4 per core") as e:
        OrtBackend(b / "models/fp32.onnx", threads=most + 1)
    assert f"between 1 and {most}" in e.value.hint
    OrtBackend(b / "models/fp32.onnx", threads=most)  # the most is allowed
    for argv in (["bench", str(b), "--threads", str(most + 1), "--iterations", "2"],
                 ["serve", str(b), "--threads", str(most + 1), "--http-port", "0"]):
        r = subprocess.run([sys.executable, "-m", "dsedge", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (argv, r.stderr[-800:])
        assert "4 per core" in r.stderr, r.stderr[-800:]


def test_azure_provider_is_reported_as_the_cpu_it_runs_on(tmp_path, caplog):
    """Found by review: ORT's CPU wheels offer AzureExecutionProvider; asked for by name, the session reported
    ["AzureExecutionProvider", "CPUExecutionProvider"] while ORT placed every node on the CPU (Azure EP runs only
    ONNX Runtime extensions' cloud-invoker ops), with no warning, and was not treated as a CPU session. Real ORT."""
    import onnxruntime

    if "AzureExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime build has no AzureExecutionProvider")
    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    caplog.set_level(logging.WARNING, logger="dsedge")
    s = dsedge.load(b)  # the default chain never picks it
    assert s.providers == ["CPUExecutionProvider"] and "Azure" not in caplog.text
    s = dsedge.load(b, providers=["AzureExecutionProvider"], instances=2)
    assert s.providers == ["CPUExecutionProvider"] and s.describe()["instances"] == 2
    warned = [r.getMessage() for r in caplog.records if "AzureExecutionProvider" in r.getMessage()]
    assert len(warned) == 1 and "runs locally on CPUExecutionProvider" in warned[0], warned  # not once per instance
    x = np.ones((2, 64), np.float32)
    np.testing.assert_array_equal(s.run({"x": x})["logits"], dsedge.load(b).run({"x": x})["logits"])
    s.close()


def test_sdk_imports_and_runs_without_torch(tmp_path):
    b = tiny_bundle(tmp_path / "t.dse", tmp_path)
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import numpy as np, dsedge\n"
        f"s = dsedge.load({str(b)!r})\n"
        "print(s.run({'x': np.ones((2, 64), np.float32)})['logits'].shape)\n"
        "import dsedge.runtime.bundle, dsedge.runtime.io, dsedge.cli, dsedge.targets\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2, 4)"


def test_a_run_past_the_profiles_opt_shape_gives_the_cpu_arena_back(tmp_path):
    """ORT's CPU arena kept what the largest run took for the process's life (one 64 × 512-token MiniLM batch: 1,338
    MB held afterwards against 140 MB before, 202 MB with this): a run whose input is past the bundle's ``opt``
    shape asks ORT to shrink the arena after it; runs at or under ``opt`` keep it (shrinking costs there)."""
    from dsedge.runtime.backends.ort import OrtBackend
    from dsedge.runtime.bundle import verify_bundle

    bundle = tiny_bundle(tmp_path / "m.dse", tmp_path)  # batch opt 8, x[batch, 64]
    m = verify_bundle(bundle)
    backend = OrtBackend(bundle / "models" / "fp32.onnx", threads=1, bundle=(m, m.variants[0]))
    assert backend.shrink_above == ("x", 8 * 64)
    asked: list = []
    real = backend.session.run

    def spy(names, feeds, run_options=None):  # the real session runs; this notes what it was asked
        asked.append(None if run_options is None
                     else run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage"))
        return real(names, feeds, run_options)

    backend.session.run = spy
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    big, opt = backend.run({"x": x}), backend.run({"x": x[:8]})
    assert asked == ["cpu:0", None]
    np.testing.assert_allclose(big["logits"][:8], opt["logits"], rtol=1e-5, atol=1e-6)
    assert OrtBackend(bundle / "models" / "fp32.onnx", threads=1).shrink_above is None  # no bundle: no profile


def test_an_onnx_runtime_load_failure_hints_at_its_cause(tmp_path):
    """A user's pass: every ONNX Runtime load failure said "check the onnxruntime version supports its opset", a
    type mismatch in the graph included. Real ORT on two broken graphs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dsedge.runtime.backends.ort import OrtBackend
    from dsedge.runtime.errors import BundleError

    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("x", "y"))
    w = numpy_helper.from_array(np.ones((4, 4), np.float16), "w")  # a float16 weight for a float32 MatMul
    mixed = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    future = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                               opset_imports=[helper.make_opsetid("", 99)])
    for model, words in ((mixed, "a type or shape mismatch"), (future, "does not support the model's opset")):
        model.ir_version = 8
        onnx.save(model, tmp_path / "m.onnx")
        with pytest.raises(BundleError, match="ONNX Runtime cannot load") as e:
            OrtBackend(tmp_path / "m.onnx")
        assert words in e.value.hint, e.value.hint
