"""Realistic mistakes of a new user of the host-side commands (quantize, prune, build sources, calibration files,
train launches, bench inputs): each is a one-line error with a hint and exit code 2, found before any work is done,
and never names a temporary path."""
from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest

from cli_helpers import run_main
from tiny_models import mlp_onnx


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return mlp_onnx(tmp_path_factory.mktemp("mlp") / "mlp.onnx")


def _one_line_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error: "), err
    assert ".tmp-" not in err, err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("command", [["quantize", "--algorithm", "rtn"], ["prune"]])
def test_an_output_path_that_is_a_directory_is_refused_before_the_work(mlp, tmp_path, capsys, command):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = run_main([command[0], mlp, "-o", out_dir, *command[1:]], capsys)
    _one_line_error(code, err, "-o/--output", "the path is a directory")
    assert list(out_dir.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_output_path_under_a_file_and_a_report_path_that_is_a_directory_are_refused(mlp, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, _, err = run_main(["prune", mlp, "-o", tmp_path / "afile" / "p.onnx"], capsys)
    _one_line_error(code, err, "a file is in the way", "is a file, not a directory")
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", "--algorithm", "rtn", "--report", tmp_path],
                            capsys)
    _one_line_error(code, err, "--report", "report.json")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("command", [["quantize", "--algorithm", "rtn"], ["prune"]])
def test_a_report_path_that_is_the_output_or_the_source_model_is_refused(mlp, tmp_path, capsys, command):
    """It replaced the model just written (or the source) with the JSON report, and the command said it wrote a
    model, exit 0."""
    model = tmp_path / "m.onnx"
    shutil.copy(mlp, model)
    before = model.read_bytes()
    out = tmp_path / "q.onnx"
    for report, which in ((out, "-o/--output"), (model, "MODEL")):
        code, _, err = run_main([command[0], model, "-o", out, *command[1:], "--report", report], capsys)
        _one_line_error(code, err, f"is the same file as {which}", "--report report.json")
        assert not out.exists() and model.read_bytes() == before
    code, _, err = run_main([command[0], model, "-o", out, *command[1:], "--report", tmp_path / "r.json"], capsys)
    assert code == 0 and out.read_bytes()[:1] != b"{" and (tmp_path / "r.json").read_text().startswith("{"), err


@pytest.mark.parametrize("command", [["quantize", "--precision", "fp16"], ["prune"]])
def test_writing_over_a_bundles_model_is_refused_and_the_bundle_still_loads(tmp_path, capsys, command):
    from dsedge.runtime.bundle import verify_bundle
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    model = bundle / "models" / "fp32.onnx"
    before = model.read_bytes()
    code, _, err = run_main([command[0], model, "-o", model, *command[1:]], capsys)
    _one_line_error(code, err, "is a file of the bundle", "sha256", "dsedge build")
    assert model.read_bytes() == before and verify_bundle(bundle).variant().name == "fp32"
    code, _, err = run_main([command[0], model, "-o", tmp_path / "next.onnx", *command[1:]], capsys)
    assert code == 0, err  # reading a bundle's model to write elsewhere is fine


@pytest.mark.parametrize("flags", [["--precision", "fp16"], ["--precision", "int8", "--int8-mode", "dynamic"]])
def test_nodes_on_a_precision_that_converts_every_layer_is_refused(mlp, tmp_path, capsys, flags):
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", *flags, "--nodes", "nope"], capsys)
    _one_line_error(code, err, "--nodes selects the layers of INT4", "--precision int4")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize("flags, words", [
    (["--precision", "fp16", "--smooth-alpha", "0.5"], "--smooth-alpha applies to INT8 static quantization"),
    (["--precision", "int8", "--int8-mode", "dynamic", "--block-size", "64"], "--block-size applies to INT4"),
    (["--precision", "int8", "--int8-mode", "dynamic", "--method", "entropy"], "--method applies to INT8 static"),
    (["--precision", "bf16", "--int8-mode", "static"], "--int8-mode applies to INT8 quantization"),
    (["--precision", "fp16", "--algorithm", "awq"], "--algorithm applies to INT4"),
    (["--preset", "int8-dynamic", "--algorithm", "awq"], "--algorithm applies to INT4"),
    (["--precision", "fp16", "--asymmetric"], "--asymmetric applies to INT4 quantization"),
])
def test_a_flag_the_chosen_quantization_ignores_is_refused(mlp, tmp_path, capsys, flags, words):
    """They were silently ignored (while --nodes and --qat-steps on the wrong precision were refused)."""
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", *flags], capsys)
    _one_line_error(code, err, words, "--list-presets")
    assert not (tmp_path / "q.onnx").exists()


def test_an_unknown_node_names_the_layers_there_are(mlp, tmp_path, capsys):
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", "--algorithm", "rtn", "--nodes", "nope"],
                            capsys)
    assert code != 0 and "no node named 'nope'" in err and "MatMul/Gemm weight layers: " in err, err
    assert "Traceback" not in err and "dsedge inspect" not in err


def test_a_failed_rename_names_the_users_destination_not_the_temporary_file(tmp_path):
    from dsedge.runtime.files import atomic_path
    from dsedge.runtime.storage import storage_error

    dest = tmp_path / "taken"
    (dest / "inside").mkdir(parents=True)
    with pytest.raises(OSError) as e:
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"x")
    err = storage_error(e.value, "writing")
    assert err is not None and str(dest) in str(err) and ".tmp-" not in str(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.fixture(scope="module")
def small_vocab_hf_dir(tmp_path_factory):
    """A real 1-layer BERT (vocab 1200) saved with safetensors, and no tokenizer."""
    pytest.importorskip("torch")
    from tiny_models import tiny_bert_dir

    return tiny_bert_dir(tmp_path_factory.mktemp("hf") / "no-tokenizer", hidden=8, vocab_size=1200, tokenizer=False)


def test_a_hf_directory_without_a_tokenizer_is_a_source_error(small_vocab_hf_dir, tmp_path, capsys):
    code, _, err = run_main(["build", "--model", small_vocab_hf_dir, "--target", "cpu", "--out", tmp_path], capsys)
    _one_line_error(code, err, "has no tokenizer", "save_pretrained")
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_larger_than_the_embedding_table_is_a_source_error(small_vocab_hf_dir, tmp_path):
    from dsedge.runtime.errors import SourceError
    from dsedge.toolchain import reference
    from dsedge.toolchain.sources import resolve_source

    d = tmp_path / "mismatch"
    shutil.copytree(small_vocab_hf_dir, d)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(reference.verified_model_dir() / f, d / f)
    with pytest.raises(SourceError, match=r"30522 tokens but the model's vocab_size is 1200"):
        resolve_source(str(d))


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """A real importable module of model factories; returns its (unique) name."""
    name = f"factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def not_a_module():\n    return 'hello', (torch.zeros(2, 3),)\n"
        "def wrong_inputs():\n    return torch.nn.Linear(16, 4), (torch.zeros(2, 7),)\n"
        "def raises():\n    raise RuntimeError('boom in user code')\n"
        "notfunc = 5\n"
        "def axes_str():\n    return torch.nn.Linear(16, 4), (torch.zeros(2, 16),), 'oops'\n"
        "def axes_unknown():\n    return torch.nn.Linear(16, 4), (torch.zeros(2, 16),), {'nothere': {0: 'batch'}}\n"
        "def axes_bad_axis():\n    return torch.nn.Linear(16, 4), (torch.zeros(2, 16),), {'input_0': {5: 'batch'}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("fn, words", [("not_a_module", ["returned a str", "torch.nn.Module"]),
                                       ("wrong_inputs", ["fails on its own example inputs", "input_0 [2, 7]",
                                                         "mat1 and mat2"]),
                                       ("raises", [":raises() failed: RuntimeError: boom in user code"]),
                                       ("notfunc", [":notfunc is a int, not a function"]),
                                       ("axes_str", ["returned dynamic_axes as a str, not a dict"]),
                                       ("axes_unknown", ["dynamic_axes names 'nothere', not one of its inputs"]),
                                       ("axes_bad_axis", ["dynamic_axes['input_0'] must map axes of its 2-d"])])
def test_a_factory_that_returns_no_module_or_inputs_it_rejects_is_a_source_error(factory_module, tmp_path, capsys,
                                                                                  fn, words):
    code, _, err = run_main(["build", "--model", f"{factory_module}:{fn}", "--target", "cpu", "--out", tmp_path],
                            capsys)
    _one_line_error(code, err, *words)


@pytest.mark.parametrize("spec", [":f", ".rel:f", "os.path:"])
def test_a_model_spec_that_is_not_module_colon_function_is_a_source_error(spec, tmp_path, capsys):
    code, _, err = run_main(["build", "--model", spec, "--target", "cpu", "--out", tmp_path], capsys)
    _one_line_error(code, err, "is not module.path:function")


def _bad_npz_dirs(root, good):
    """Directories of one bad .npz each: garbage, a .npy under a .npz name, a file cut short, object arrays."""
    import io

    made = {}
    for kind in ("garbage", "npy", "truncated", "objects"):
        d = root / kind
        d.mkdir()
        f = d / "a.npz"
        if kind == "garbage":
            f.write_bytes(b"not numpy at all\n")
        elif kind == "npy":
            buf = io.BytesIO()
            np.save(buf, good)
            f.write_bytes(buf.getvalue())
        elif kind == "truncated":
            buf = io.BytesIO()
            np.savez(buf, x=good)
            f.write_bytes(buf.getvalue()[:200])
        else:
            np.savez(f, x=np.array([{"a": 1}], dtype=object))
        made[kind] = d
    return made


_NPZ_REASONS = {"garbage": "not a zip archive", "npy": "is a .npy file", "truncated": "damaged or cut short",
                "objects": "object arrays"}


def test_a_bad_npz_file_says_why_in_every_reader(mlp, tmp_path, capsys):
    from dsedge.runtime.bundle import IOSpec
    from dsedge.runtime.errors import CalibrationError, InputError
    from dsedge.runtime.bench_load import read_inputs_dir
    from dsedge.toolchain.npz_inputs import read_npz_dir
    from dsedge.toolchain.quantize.calibration import read_batches

    good = np.zeros((4, 64), np.float32)
    specs = [IOSpec("x", "float32", ("batch", 64))]
    for kind, d in _bad_npz_dirs(tmp_path, good).items():
        reason = _NPZ_REASONS[kind]
        for read, error in ((lambda p: read_npz_dir(p, specs, "held-out"), CalibrationError),
                            (read_batches, CalibrationError), (lambda p: read_inputs_dir(p, specs), InputError)):
            with pytest.raises(error, match=reason) as e:
                read(d)
            assert "pickled (object) data" not in str(e.value) and str(d / "a.npz") in str(e.value)
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", "--calib", tmp_path / "truncated"], capsys)
    _one_line_error(code, err, "cut short")


def test_quantize_calibration_of_the_wrong_static_shape_names_the_axis(mlp, tmp_path, capsys):
    np.savez(tmp_path / "a.npz", x=np.zeros((8, 63), np.float32))
    code, _, err = run_main(["quantize", mlp, "-o", tmp_path / "q.onnx", "--calib", tmp_path], capsys)
    _one_line_error(code, err, "input 'x' axis 1 is 63, the model expects 64")
    assert not (tmp_path / "q.onnx").exists()


def _train_toml(tmp_path, name="c", **over):
    from dsedge.toolchain.train.config import dump_toml
    from train_models import config

    path = tmp_path / f"{name}.toml"
    path.write_text(dump_toml(config(tmp_path / name, **over)))
    return path


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A finished 2-step run of train_models:make_tiny (3 classes) and its config file."""
    from dsedge.toolchain.train import train
    from dsedge.toolchain.train.config import load_config

    path = _train_toml(tmp_path_factory.mktemp("teacher"), steps=2, checkpoint={"every": 2})
    train.run(load_config(path))
    return path


def test_training_a_finished_run_again_says_there_is_nothing_to_train(teacher_run, capsys):
    code, out, err = run_main(["train", teacher_run], capsys)
    assert code == 0 and "resumed from checkpoint step_2" in err
    assert "nothing to train" in out and "already at step 2" in out and "nan" not in out


def test_a_student_whose_outputs_differ_from_the_teachers_is_a_config_error(teacher_run, tmp_path, capsys):
    path = _train_toml(tmp_path, name="student", steps=2, model={"kwargs": {"classes": 5}},
                       distill={"teacher": str(teacher_run.parent / "c")})
    code, _, err = run_main(["distill", path], capsys)
    _one_line_error(code, err, "the student's output [8, 5] and the teacher's [8, 3]", "[model] kwargs")


@pytest.mark.parametrize("verb, args, over, words", [
    ("train", [], {"distill": {"teacher": "runs/t"}}, ["has a [distill] section", "dsedge distill"]),
    ("train", ["--nproc-per-node", "0"], {}, ["0 is not in the range x>=1"]),
    ("train", ["--max-restarts", "1"], {}, ["--max-restarts needs --nproc-per-node"]),
    ("train", ["--nproc-per-node", "2"], {"data": {"factory": "train_models:make_dataz"}}, ["no callable 'make_dataz'"]),
    ("distill", ["--nproc-per-node", "2"], {"distill": {"teacher": "no-such-run"}}, ["not a finished dsedge run"]),
])
def test_train_launch_mistakes_are_one_line_before_any_process_starts(tmp_path, capsys, verb, args, over, words):
    code, _, err = run_main([verb, _train_toml(tmp_path, **over), *args], capsys)
    assert code == 2 and "Traceback" not in err and "ChildFailedError" not in err, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "c").exists()


def test_a_factory_with_tuple_inputs_exports_with_dynamo_not_the_torchscript_fallback(tmp_path, monkeypatch):
    """Tuple example inputs are named input_0, …; nn.Sequential's forward() calls its argument ``input``."""
    import onnxruntime as ort

    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.sources import resolve_source

    name = f"seq_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def make():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), "
        "(torch.randn(3, 16),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    exported = export_onnx(resolve_source(f"{name}:make"), tmp_path / "m.onnx")
    assert exported.exporter == "dynamo" and exported.parity_max_abs_diff < 1e-5
    assert exported.inputs[0].shape[0] == "batch"
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"input_0": np.ones((5, 16), np.float32)})[0].shape == (5, 4)


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["bench", "--iterations", "2"]])
def test_the_build_out_folder_instead_of_its_bundle_names_the_bundle(tmp_path, capsys, command):
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "out" / "mlp-cpu.dse", tmp_path)
    code, _, err = run_main([command[0], tmp_path / "out", *command[1:]], capsys)
    _one_line_error(code, err, "is a folder of bundles (mlp-cpu.dse), not a bundle", repr(str(bundle)))


def test_the_config_in_docs_train_md_is_a_valid_config(tmp_path):
    from pathlib import Path

    from dsedge.toolchain.train.config import load_config

    doc = (Path(__file__).parents[1] / "docs" / "train.md").read_text()
    block = doc.split("### The config", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    (tmp_path / "c.toml").write_text(block)
    cfg = load_config(tmp_path / "c.toml", distill=True)
    assert cfg.steps == 1000 and cfg.model.input_names == ["features"] and cfg.distill.alpha == 0.7


@pytest.mark.parametrize("args", [["--precision", "fp16"], ["--precision", "int8", "--int8-mode", "dynamic"]])
def test_quantize_checks_the_accuracy_gate_for_precisions_without_a_gated_search(mlp, tmp_path, capsys, args):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "held.npz", x=rng.standard_normal((16, 64)).astype(np.float32))
    out = tmp_path / "q.onnx"
    code, _, err = run_main(["quantize", mlp, "-o", out, *args, "--accuracy-gate", "cosine:0.99"], capsys)
    _one_line_error(code, err, "--accuracy-gate needs --heldout")
    code, _, err = run_main(["quantize", mlp, "-o", out, *args, "--accuracy-gate", "cosin:0.99",
                             "--heldout", tmp_path / "held.npz"], capsys)
    _one_line_error(code, err, "'cosin:0.99' is not METRIC:THRESHOLD")
    code, _, err = run_main(["quantize", mlp, "-o", out, *args, "--accuracy-gate", "cosine-min:0.99999999",
                             "--heldout", tmp_path / "held.npz"], capsys)
    assert code == 2 and "accuracy gate cosine-min:0.99999999 not met" in err and "cosine-min = 0.9" in err, err
    assert not out.exists()
    code, stdout, _ = run_main(["quantize", mlp, "-o", out, *args, "--accuracy-gate", "cosine:0.9",
                                "--heldout", tmp_path / "held.npz", "--json"], capsys)
    import json

    report = json.loads(stdout.strip().splitlines()[-1])
    assert code == 0 and out.is_file() and report["gate"] == "cosine:0.9" and report["gate_values"]["cosine"] > 0.9


def test_a_broken_user_profile_overriding_a_target_says_why_not_unknown_target(tmp_path, monkeypatch, capsys):
    from dsedge.targets import PROFILE_DIR

    text = (PROFILE_DIR / "cpu.toml").read_text()
    (tmp_path / "cpu.toml").write_text(text.replace("default_budget_ms = 50.0", 'default_budget_ms = "fast"'))
    monkeypatch.setenv("DSEDGE_TARGETS_DIR", str(tmp_path))
    code, _, err = run_main(["targets", "cpu"], capsys)
    assert code == 2 and "Traceback" not in err and "unknown target" not in err, err
    assert "error: target profile cpu.toml field default_budget_ms: 'fast' is not of type 'number'" in err, err


@pytest.mark.parametrize("batch, precision", [(1, "fp32"), (2, "fp32"), (2, "auto")])
def test_an_onnx_model_with_a_static_batch_builds_and_is_timed_at_that_batch(mlp, tmp_path, capsys, batch,
                                                                             precision):
    """A static batch of 2 never built: build-time latency was timed at batch 1, which the model cannot run (and
    the error's hint spoke of bench). It is timed at its own batch size now."""
    import onnx

    import dsedge

    m = onnx.load(str(mlp))
    for v in (m.graph.input[0], m.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.save(m, str(tmp_path / "static.onnx"))
    code, _, err = run_main(["build", "--model", tmp_path / "static.onnx", "--target", "cpu", "--precision", precision,
                             "--out", tmp_path / "out", "-q"], capsys)
    assert code == 0, err
    s = dsedge.load(tmp_path / "out" / "static-cpu.dse")
    assert s.run({"x": np.ones((batch, 64), np.float32)})["logits"].shape == (batch, 4)
    rec = s.manifest.variant(s.variant.name).latency_ms
    assert list(rec) == [str(batch)] and rec[str(batch)]["shape"] == {"x": [batch, 64]} and rec[str(batch)]["p50"] > 0
    s.close()


def test_quantize_in_place_reports_the_size_against_the_original_source(mlp, tmp_path, capsys):
    model = tmp_path / "m.onnx"
    shutil.copy(mlp, model)
    before = model.stat().st_size
    code, out, _ = run_main(["quantize", model, "-o", model, "--algorithm", "rtn"], capsys)
    ratio = model.stat().st_size / before
    assert code == 0 and f"{ratio:.1%} of the source" in out and ratio < 0.5, out


def test_bench_seq_len_on_a_bundle_without_a_token_axis_is_a_usage_error(tmp_path, capsys):
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    code, _, err = run_main(["bench", bundle, "--iterations", 2, "--seq-len", 128], capsys)
    assert code == 2 and "--seq-len 128: the bundle's inputs have no variable axis" in err and "x ['batch', 64]" in err


def test_an_unfinished_training_run_is_named_as_such(teacher_run, tmp_path, capsys):
    run = tmp_path / "partial"
    shutil.copytree(teacher_run.parent / "c", run)
    shutil.rmtree(run / "final")
    code, _, err = run_main(["build", "--model", run, "--target", "cpu", "--out", tmp_path / "out"], capsys)
    _one_line_error(code, err, "is a training run that has not finished", "latest checkpoint is step_2", "resumes")


@pytest.mark.parametrize("kwargs, words", [({"hidden": 48}, ["blocks.0.up.weight is [32, 16] there, [48, 16] now"]),
                                           ({"depth": 3}, ["it has no model.blocks.2.norm.weight"])])
def test_resuming_a_run_with_a_changed_model_is_a_config_error_and_keeps_the_run(teacher_run, tmp_path, capsys,
                                                                                  kwargs, words):
    from dsedge.toolchain.train.config import dump_toml
    from train_models import config

    run = tmp_path / "run"
    shutil.copytree(teacher_run.parent / "c", run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    path = tmp_path / "changed.toml"
    path.write_text(dump_toml(config(run, steps=4, checkpoint={"every": 2}, model={"kwargs": kwargs})))
    code, _, err = run_main(["train", path], capsys)
    _one_line_error(code, err, "holds checkpoints of another model", *words, "another out_dir")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before == ["step_2"]


def test_yaml_configs_read_exponent_floats_as_numbers(tmp_path):
    pytest.importorskip("yaml")
    from dsedge.runtime.errors import ConfigError
    from dsedge.toolchain.train.config import load_config

    base = ("out_dir: runs/y\nsteps: 10\nmodel:\n  factory: train_models:make_tiny\n  input_names: [features]\n"
            "data:\n  factory: train_models:make_data\n  batch_size: 8\n")
    (tmp_path / "c.yaml").write_text(base + "optim:\n  lr: 1e-3\n  eps: 1.0e-8\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.optim.lr == 1e-3 and cfg.optim.eps == 1e-8 and cfg.steps == 10 and isinstance(cfg.steps, int)
    (tmp_path / "q.yaml").write_text(base + "optim:\n  lr: '1e-3'\n")  # quoted: still a string, still refused
    with pytest.raises(ConfigError, match="lr must be float"):
        load_config(tmp_path / "q.yaml")


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_providers_that_name_no_provider_are_refused(tmp_path, capsys, command):
    """``--providers ,`` fell back to the default providers without a word."""
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    for value in (",", " ", ", ,"):
        code, _, err = run_main([command, bundle, "--providers", value], capsys)
        assert code == 2 and "names no provider" in err and "Traceback" not in err, err
    code, _, err = run_main([command, bundle, "--providers", "CPUExecutionProvider", *(
        ["--iterations", 2] if command == "bench" else [])], capsys)
    assert "names no provider" not in err and (code == 0 or "no golden I/O" in err), err  # (this bundle has none)


def _graphless(path):
    import onnx

    model = onnx.ModelProto()
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("command", [["quantize", "--algorithm", "rtn"], ["quantize", "--precision", "int8",
                                                                          "--int8-mode", "dynamic"], ["prune"]])
@pytest.mark.parametrize("make", ["empty", "graphless"])
def test_an_empty_or_graphless_onnx_file_is_refused_like_a_build_source(tmp_path, capsys, command, make):
    """An empty file parses as an empty ModelProto: quantize ended in a traceback from the opset converter or ORT,
    prune wrote an invalid model and said 'wrote p.onnx: 2:4 sparsity on 0 layers', exit 0 (a user's pass)."""
    src = tmp_path / "m.onnx"
    src.write_bytes(b"") if make == "empty" else _graphless(src)
    code, _, err = run_main([command[0], src, "-o", tmp_path / "out.onnx", *command[1:]], capsys)
    _one_line_error(code, err, "is not a valid ONNX model", "torch.onnx.export")
    assert not (tmp_path / "out.onnx").exists()


def test_a_model_with_nothing_to_quantize_or_prune_is_refused(tmp_path, capsys):
    """It was written unchanged with a warning, exit 0 (now refused: tests/test_prune_quantize_cli_user.py)."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add", [x], [y])
    src = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    code, out, err = run_main(["quantize", src, "-o", tmp_path / "q.onnx", "--algorithm", "rtn"], capsys)
    _one_line_error(code, err, "int4 has nothing to quantize in add.onnx")
    code, out, err = run_main(["prune", src, "-o", tmp_path / "p.onnx"], capsys)
    _one_line_error(code, err, "2:4 sparsity has nothing to prune in")
    assert not (tmp_path / "q.onnx").exists() and not (tmp_path / "p.onnx").exists()


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_bundle_destination_that_is_not_a_bundle_is_refused_before_the_export(mlp, tmp_path, capsys, kind,
                                                                               monkeypatch):
    """It was refused only when the bundle was written, after the export, the fits and the timings (about 22 s
    for the reference model) (a user's pass)."""
    from dsedge.toolchain import pipeline

    def no_export(*_a, **_k):
        raise AssertionError("the export ran")

    monkeypatch.setattr(pipeline, "export", no_export)
    dest = tmp_path / "mlp-cpu.dse"
    dest.write_text("x") if kind == "file" else (dest.mkdir(), (dest / "notes.txt").write_text("x"))
    code, _, err = run_main(["build", "--model", mlp, "--target", "cpu", "--out", tmp_path], capsys)
    _one_line_error(code, err, "is not a dsedge bundle; refusing to replace it", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp-cpu.dse"]


def test_a_storage_error_names_the_command_that_failed(tmp_path, capsys):
    """It said "dsedge failed: …" whatever ran (a user's pass): now the command, a group's subcommand included."""
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "m-cpu.dse", tmp_path)
    (bundle / "manifest.sig").mkdir()  # in the way of the signature file
    assert run_main(["keygen", "--out", tmp_path / "k"], capsys)[0] == 0
    code, _, err = run_main(["sign", bundle, "--key", tmp_path / "k.key"], capsys)
    assert code == 2 and err.startswith("error: dsedge sign failed: the path is a directory"), err
    (tmp_path / "f").write_text("a file\n")
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n1,2\n3,4\n")
    code, _, err = run_main(["data", "check", csv, "--html", tmp_path / "f" / "x.html"], capsys)
    # --html is checked before the scan now (as bench's -o): the error names the option instead of the command
    assert code == 2 and err.startswith("error: --html ") and "a file is in the way" in err, err
