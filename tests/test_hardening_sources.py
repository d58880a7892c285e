"""Toolchain-side hardening: pickle weights refused and every loaded file fingerprinted, an INT8 gate choice never
writes an invalid graph, every model is fully checked before it enters a bundle; request options checked."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import dsedge
from dsedge.runtime.errors import InputError, QuantizationError, SourceError
from tiny_models import mlp_onnx, tiny_bert_dir, tiny_bundle


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny BERT saved with safetensors, with the reference tokenizer (a real HF directory)."""
    pytest.importorskip("torch")
    return tiny_bert_dir(tmp_path_factory.mktemp("hf") / "tiny-bert")


def _pickle_file(path: Path) -> None:
    import torch

    torch.save({"w": torch.zeros(2)}, path)


def test_pickle_weights_beside_safetensors_are_refused(hf_dir, tmp_path, monkeypatch):
    """Before: pytorch_model.bin plus any dummy *.safetensors passed the check and transformers loaded the pickle."""
    from dsedge.toolchain.sources import resolve_source

    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    (d / "dummy.safetensors").write_bytes(b"{}")
    _pickle_file(d / "pytorch_model.bin")
    with pytest.raises(SourceError, match=r"holds pickle files \(pytorch_model.bin\)"):
        resolve_source(str(d))
    (d / "pytorch_model.bin").rename(d / "weights.dat")          # a renamed pickle is recognised by content
    with pytest.raises(SourceError, match="weights.dat"):
        resolve_source(str(d))
    (d / "weights.dat").unlink()
    (d / "model.safetensors").rename(d / "other.safetensors")     # only a dummy safetensors: not a model
    with pytest.raises(SourceError, match="no model.safetensors"):
        resolve_source(str(d))


def test_allowed_pickle_warns_and_the_fingerprint_covers_every_file(hf_dir, tmp_path, monkeypatch, caplog):
    from dsedge.toolchain.sources import resolve_source

    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    clean = resolve_source(str(d)).fingerprint
    _pickle_file(d / "pytorch_model.bin")
    monkeypatch.setenv("DSEDGE_ALLOW_PICKLE", "1")
    with caplog.at_level("WARNING", logger="dsedge"):
        with_bin = resolve_source(str(d)).fingerprint
    assert "DSEDGE_ALLOW_PICKLE=1" in caplog.text and with_bin != clean
    (d / "vocab.txt").write_text((d / "vocab.txt").read_text() + "extra\n")   # tokenizer files count too
    assert resolve_source(str(d)).fingerprint != with_bin


def _gated_int8(tmp_path: Path):
    from dsedge.toolchain.quantize.int8_gate import quantize_int8_gated

    rng = np.random.default_rng(0)
    calib = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(2)]
    model = onnx.load(str(mlp_onnx(tmp_path / "g.onnx")))
    return quantize_int8_gated(model, calib, gate="cosine:0.99999", heldout=calib, smooth_alpha=None)


def test_int8_gate_keeping_a_gemm_float_writes_a_valid_graph(tmp_path):
    """Before: the Gemm's float bias was added beside the DequantizeLinear output of the same name
    (`Duplicate definition of name (b2)`)."""
    import onnxruntime as ort

    q, rep = _gated_int8(tmp_path)
    assert [k["node"] for k in rep["kept_float"]] == ["fc2"]
    onnx.checker.check_model(q, full_check=True)
    names = [t.name for t in q.graph.initializer] + [o for n in q.graph.node for o in n.output]
    assert len(names) == len(set(names))
    sess = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((1, 64), np.float32)})[0].shape == (1, 4)


def test_tensorrt_int8_build_with_few_samples_and_a_strict_gate_is_refused_in_one_line(tmp_path):
    """Four samples and a strict gate: the gate keeps every layer float. That used to ship the fp32 graph as the
    "int8" variant; it is a one-line error naming the gate (and it once crashed outright)."""
    calib = tmp_path / "calib"
    calib.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        np.savez(calib / f"{i}.npz", x=rng.standard_normal((1, 64)).astype(np.float32))
    r = subprocess.run([sys.executable, "-m", "dsedge.cli", "build", "--model", str(mlp_onnx(tmp_path / "m.onnx")),
                        "--target", "t4", "--out", str(tmp_path / "o"), "--precision", "int8", "--calib", str(calib),
                        "--accuracy-gate", "cosine:0.99999"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "int8 kept all 2 of m's layers float to meet the accuracy gate cosine:0.99999" in r.stderr, r.stderr
    assert "hint: loosen --accuracy-gate" in r.stderr and not (tmp_path / "o" / "m-t4.dse").exists()


def test_an_invalid_graph_never_enters_a_bundle(tmp_path):
    bad = onnx.load(str(mlp_onnx(tmp_path / "m.onnx")))
    bad.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(4, np.float32), "logits"))  # defined twice
    onnx.save(bad, str(tmp_path / "bad.onnx"))
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    with pytest.raises(QuantizationError, match="models/fp32.onnx is not a valid ONNX graph"):
        write_bundle(tmp_path / "b.dse", name="b", target={"name": "cpu"},
                     inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                     models={"models/fp32.onnx": tmp_path / "bad.onnx"},
                     variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx", "m.onnx"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s")
    s = dsedge.load(tiny_bundle(tmp / "mlp-cpu.dse", tmp))
    yield s
    s.close()


@pytest.mark.parametrize("kw, words", [
    ({"budget_ms": float("nan")}, "budget_ms must be a finite number"),
    ({"budget_ms": float("inf")}, "budget_ms must be a finite number"),
    ({"budget_ms": "5"}, "budget_ms must be a number"),
    ({"budget_ms": 0}, "budget_ms must be a finite number"),
    ({"budget_ms": True}, "budget_ms must be a number"),
    ({"budget_ms": 10**400}, "budget_ms must be a finite number"),  # float() of it raised OverflowError
    ({"priority": "high"}, "priority must be an integer"),
    ({"priority": None}, "priority must be an integer"),
    ({"priority": float("nan")}, "priority must be an integer"),
    ({"priority": 1.5}, "priority must be an integer"),
    ({"priority": 10**30}, "outside"),
])
def test_bad_request_options_are_input_errors_and_metrics_stay_balanced(session, kw, words):
    """Before: raw ValueError/TypeError/OverflowError, metrics counting more submitted than answered, and a float
    priority silently truncated."""
    x = {"x": np.ones((1, 64), np.float32)}
    with pytest.raises(InputError, match=words):
        session.submit(x, **kw)
    ok = session.submit(x, budget_ms=1000.0, priority=np.int64(3)).result(timeout=30)
    assert ok.error is None
    m = session.metrics()
    assert m["submitted"] == m["answered"] + sum(m["rejected"].values()) and m["in_flight"] == 0


def test_a_default_budget_that_is_not_a_number_is_an_input_error(tmp_path):
    from dsedge.runtime.io import check_request_options

    with pytest.raises(InputError, match="budget_ms must be a finite number"):
        dsedge.load(tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path), budget_ms=float("nan"))
    with pytest.raises(InputError, match="default latency budget must be a finite number"):
        check_request_options(None, 0, lambda: float("nan"))
    with pytest.raises(InputError, match="default latency budget is not a number"):
        check_request_options(None, 0, lambda: float("abc"))


@pytest.mark.parametrize("kw, words", [
    ({"max_batch": -1}, "max_batch must be an integer >= 1"),
    ({"max_batch": "8"}, "max_batch must be an integer"),
    ({"max_queue": 0}, "max_queue must be an integer >= 1"),
    ({"max_delay_ms": float("nan")}, "max_delay_ms must be a finite number"),
    ({"max_delay_ms": 10**400}, "max_delay_ms must be a finite number"),
    ({"budget_ms": -10**400}, "budget_ms must be a finite number"),
    ({"budget_ms": -5}, "budget_ms must be a finite number"),
    ({"budget_ms": 1e9}, re.escape("budget_ms must be a finite number in (0, 3600000] ms, got 1000000000.0")),
    ({"profile": "fast"}, "profile must be one of auto, measure, bundle"),
    ({"threads": 0}, "threads must be an integer >= 1"),
    # a user's pass, 2026-12-06: the bound broken is the one said (not ">= 1" for 10**12, not "1 or more" for -1)
    ({"max_queue": 10**12}, re.escape("max_queue must be an integer in 1..2147483647, got 1000000000000")),
    ({"reserve_cores": -1}, "reserve_cores must be an integer >= 0, got -1"),
])
def test_load_options_are_checked_before_anything_opens(tmp_path, kw, words):
    """Found beyond the issue: a negative max_batch or a str one died in raw ValueError/TypeError at the first
    submit, max_queue=0 or max_delay_ms=nan rejected every request, an unknown profile was silently ignored."""
    b = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    with pytest.raises(InputError, match=words) as e:
        dsedge.load(b, **kw)
    if "reserve_cores" in kw:
        assert e.value.hint == "pass reserve_cores=0 or more"


def test_an_empty_variant_name_is_refused_not_read_as_the_default(tmp_path):
    from dsedge.runtime.errors import BundleError

    b = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    with pytest.raises(BundleError, match="bundle has no variant ''"):
        dsedge.load(b, variant="")
    with dsedge.load(b, variant=None) as s:  # None is the default variant
        assert s.variant.name == s.manifest.default_variant


@pytest.mark.parametrize("path", [b"/x.dse", 5, None])
def test_load_path_of_the_wrong_type_is_an_input_error(path):
    with pytest.raises(InputError, match="bundle path must be a str or pathlib.Path"):
        dsedge.load(path)


def test_ragged_inputs_are_input_errors(session):
    with pytest.raises(InputError, match="input 'x' is not an array"):
        session.run({"x": [[1.0] * 64, [1.0]]})


@pytest.mark.parametrize("precision, target", [("int4", "cpu"), ("int8", "cpu"), ("int8", "t4")])
def test_calibration_data_with_nan_is_refused_naming_the_file(tmp_path, precision, target):
    """Found beyond the issue: NaN calibration data gave a raw torch LinAlgError (GPTQ), a bundle calibrated on NaN
    (ORT INT8), or a misleading "weights hold NaN" (SmoothQuant spread it into the weights)."""
    from dsedge.runtime.errors import CalibrationError
    from dsedge.toolchain.pipeline import BuildOptions, build

    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        np.savez(calib / f"{i}.npz", x=np.full((1, 64), np.nan if i == 0 else 1.0, np.float32))
    with pytest.raises(CalibrationError, match=r"0.npz: input 'x' holds 64 NaN/Inf values"):
        build(BuildOptions(model=str(mlp_onnx(tmp_path / "m.onnx")), target=target, precision=precision,
                           calib=str(calib), out_dir=str(tmp_path / "o")))
    assert not list((tmp_path / "o").iterdir())


def test_quantize_api_refuses_nan_calibration_batches(tmp_path):
    from dsedge.runtime.errors import CalibrationError
    from dsedge.toolchain.quantize.int8 import quantize_int8_static

    model = onnx.load(str(mlp_onnx(tmp_path / "m.onnx")))
    batches = [{"x": np.ones((1, 64), np.float32)}, {"x": np.full((1, 64), np.inf, np.float32)}]
    with pytest.raises(CalibrationError, match="calibration batch 1: input 'x' holds 64 NaN/Inf"):
        quantize_int8_static(model, batches)


@pytest.mark.parametrize("window", [-1, 0, 1.5, "8"])
def test_stream_window_is_checked(session, window):
    with pytest.raises(InputError, match="window must be an integer >= 1"):
        list(session.stream([{"x": np.ones((1, 64), np.float32)}], window=window))


@pytest.mark.parametrize("ordered", ["no", 1, None])
def test_stream_ordered_must_be_a_bool_at_the_call(session, ordered):
    """Found by a user: stream(ordered="no") was taken as True and delivered in input order."""
    for stream in (session.stream, session.stream_async):
        with pytest.raises(InputError, match="ordered must be True or False") as e:
            stream([{"x": np.ones((1, 64), np.float32)}], ordered=ordered)
        assert e.value.hint and "\n" not in str(e.value)
    got = list(session.stream([{"x": np.ones((1, 64), np.float32)}] * 3, ordered=np.bool_(True)))
    assert [a.id for a in got] == [0, 1, 2]


@pytest.mark.parametrize("inputs, words", [
    (5, "stream() takes an iterable of requests (each a mapping of input name to array), got int"),
    ({"x": np.ones((1, 64), np.float32)}, "stream() takes an iterable of requests, got a single request"),
    (np.ones((4, 64), np.float32), "stream() takes an iterable of requests (each a mapping of input name to array), "
                                   "got ndarray"),
], ids=["int", "mapping", "ndarray"])
def test_stream_of_something_not_iterable_is_an_input_error_at_the_call(session, inputs, words):
    import asyncio
    import threading

    threads = threading.active_count()
    with pytest.raises(InputError, match=re.escape(words)) as e:
        session.stream(inputs)        # at the call: no iteration, no feeder thread
    assert e.value.hint and threading.active_count() == threads
    with pytest.raises(InputError, match=re.escape(words.replace("stream()", "stream_async()"))):
        session.stream_async(inputs)

    async def agen():
        yield {"x": np.ones((1, 64), np.float32)}

    async def drain():
        return [r async for r in session.stream_async(agen())]

    assert [r.ok for r in asyncio.run(drain())] == [True]


def test_result_repr_shows_output_shapes_not_values(session):
    r = session.submit({"x": np.ones((3, 64), np.float32)}, id="req-1").result(timeout=30)
    text = repr(r)
    assert text.startswith("Result(id='req-1', variant='fp32', latency_ms=")
    assert text.endswith(f"batch_size={r.batch_size}, outputs={{'logits': float32[3, 4]}}, error=None)")
    assert "\n" not in text and len(text) < 160 and r.outputs["logits"].shape == (3, 4)


def test_cpu_fallback_warning_reaches_stderr_once_with_or_without_app_logging(tmp_path):
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    bundle = write_bundle(
        tmp_path / "mlp-t4.dse", name="mlp", target={"name": "t4", "backend": "tensorrt"},
        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
        models={"models/fp32.onnx": mlp_onnx(tmp_path / "m.onnx")},
        variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
        default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 1, "max": 4}})
    script = ("import logging, sys, dsedge\n"
              "dsedge.load(sys.argv[1]).close()\n"                       # no logging configured by the app
              "logging.basicConfig(format='app %(levelname)s %(name)s: %(message)s')\n"
              "dsedge.load(sys.argv[1]).close()\n")                      # the app's handler, and only it
    p = subprocess.run([sys.executable, "-c", script, str(bundle)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    warning = "bundle for t4 runs on ONNX Runtime's CPU provider here (no TensorRT/CUDA found)"
    assert [line for line in p.stderr.splitlines() if warning in line] == [
        warning, f"app WARNING dsedge: {warning}"], p.stderr


def test_a_checkpoint_marker_naming_files_outside_is_not_loadable(tmp_path):
    """Found beyond the issue: a COMPLETE marker listing ``../../x`` made resume hash files outside the run."""
    import json

    pytest.importorskip("torch")
    from dsedge.toolchain.train.checkpoint import COMPLETE, Checkpointer

    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    (step / COMPLETE).write_text(json.dumps({"step": 1, "files": {"../../secret": {"bytes": 1, "sha256": "0"}}}))
    assert "leaves the checkpoint" in Checkpointer(tmp_path).verify(step)


def test_an_onnx_file_with_external_weights_is_a_source(tmp_path, monkeypatch):
    """model.onnx + its weights file was refused as "not a valid ONNX model": the checker looked for the weights in
    the working directory."""
    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.sources import resolve_source

    d = tmp_path / "m"
    d.mkdir()
    model = onnx.load(str(mlp_onnx(tmp_path / "mlp.onnx")))
    onnx.save(model, str(d / "mlp.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    source = resolve_source(str(d / "mlp.onnx"))
    exported = export_onnx(source, tmp_path / "out.onnx")   # weights inside the single exported file
    assert {i.name for i in onnx.load(str(exported.path), load_external_data=False).graph.initializer
            if i.data_location == onnx.TensorProto.EXTERNAL} == set()
    with pytest.raises(SourceError, match="--model is empty"):
        resolve_source("")


def _one_op_onnx(path, op, elem):
    from onnx import helper

    x = helper.make_tensor_value_info("x", elem, ["batch", 8])
    y = helper.make_tensor_value_info("y", elem, ["batch", 8])
    model = helper.make_model(helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def test_float64_models_and_nan_outputs_are_source_errors_before_any_file_is_written(tmp_path, monkeypatch):
    """A float64 model, NaN example inputs and a model whose outputs are NaN on its validation inputs all ran the
    whole build and failed writing manifest.json / report.json, as "a dsedge bug"."""
    from dsedge.toolchain import pipeline
    from dsedge.toolchain.config import BuildConfig

    (tmp_path / "nanmods.py").write_text(
        "import torch\n"
        "class Log(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.log(x)\n"
        "def nan_inputs():\n"
        "    return torch.nn.Linear(8, 8), (torch.full((2, 8), float('nan')),)\n"
        "def nan_outputs():\n"
        "    return Log(), (-torch.ones(2, 8),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [(str(_one_op_onnx(tmp_path / "dbl.onnx", "Relu", onnx.TensorProto.DOUBLE)), "'x' is float64"),
             (str(_one_op_onnx(tmp_path / "log.onnx", "Log", onnx.TensorProto.FLOAT)), "output 'y' holds .* NaN/inf"),
             ("nanmods:nan_inputs", "example inputs: input 'input_0' holds 16 NaN"),
             ("nanmods:nan_outputs", "outputs hold NaN/inf on its example inputs")]
    for model, words in cases:
        out = tmp_path / "out"
        with pytest.raises(SourceError, match=words):
            pipeline.build(BuildConfig(model=model, target="cpu", precision="int8", out_dir=str(out)))
        assert not out.exists() or list(out.iterdir()) == []


def test_callable_outputs_and_example_inputs_the_build_cannot_carry_are_one_line(tmp_path, monkeypatch):
    """A dict or nested-tuple output, a scalar example input and an empty batch each ended in a traceback (or a
    message about dynamic_axes the user never passed)."""
    from dsedge.toolchain.sources import resolve_source

    (tmp_path / "oddmods.py").write_text(
        "import torch\n"
        "class Odd(torch.nn.Module):\n"
        "    def __init__(self, kind):\n"
        "        super().__init__()\n"
        "        self.kind, self.l = kind, torch.nn.Linear(4, 2)\n"
        "    def forward(self, x, *rest):\n"
        "        y = self.l(x)\n"
        "        return {'a': y} if self.kind == 'dict' else (y, (y, y)) if self.kind == 'nested' else y\n"
        "def dict_out():\n    return Odd('dict'), (torch.ones(2, 4),)\n"
        "def nested_out():\n    return Odd('nested'), (torch.ones(2, 4),)\n"
        "def scalar_in():\n    return Odd('plain'), (torch.ones(2, 4), torch.tensor(2.0))\n"
        "def empty_batch():\n    return Odd('plain'), (torch.ones(0, 4),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for fn, words in (("dict_out", "returns a dict, not a tensor or a flat tuple"),
                      ("nested_out", "returns a tuple of Tensor, tuple, not a tensor or a flat tuple"),
                      ("scalar_in", r"example input 'input_1' has shape \[\], without a batch axis 0"),
                      ("empty_batch", r"example input 'input_0' has shape \[0, 4\], without a batch axis 0")):
        with pytest.raises(SourceError, match=words):
            resolve_source(f"oddmods:{fn}")


def test_output_names_that_name_no_output_are_refused_at_export(tmp_path):
    """A training run's config named two outputs of a one-output model: `dsedge build` dropped the extra name without a
    word (torch's exporter names the first outputs only). Now the export refuses it, naming what names nothing."""
    import torch

    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.sources import Source

    ex = {"x": np.zeros((2, 4), np.float32)}

    def source(names):
        return Source(kind="run", name="lin", example_inputs=ex, output_names=names,
                      module=torch.nn.Linear(4, 3).eval(), dynamic_axes={"x": {0: "batch"}})

    with pytest.raises(SourceError, match=r"returns 1 output but output_names names 2: 'extra' names nothing") as e:
        export_onnx(source(["logits", "extra"]), tmp_path / "a.onnx")
    assert "output_names" in e.value.hint
    assert [o.name for o in export_onnx(source(["logits"]), tmp_path / "b.onnx").outputs] == ["logits"]
