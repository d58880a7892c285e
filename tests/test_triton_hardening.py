"""`dsedge export triton` checks what `dsedge.load` checks (signatures under $DSEDGE_TRUSTED_KEYS), copies only a
bundle's own files for the python platform, writes a warm-up a decoder really runs (checked through ONNX Runtime on
the exported model, inputs as config.pbtxt gives them), says where each batching figure comes from, and refuses
--threads with a TensorRT plan."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import dsedge
from dsedge.cli import main
from dsedge.runtime.bundle import IOSpec, Variant, read_manifest, write_manifest
from dsedge.runtime.errors import DsedgeError, InputError, SignatureError
from dsedge.runtime.signing import ENV, generate_key, sign_bundle
from dsedge.toolchain.bundle_writer import write_bundle
from dsedge.toolchain.triton import export_triton
from tiny_models import mlp_onnx
from test_streaming_decode import gpt2  # noqa: F401  (fixture)

pytest.importorskip("cryptography")


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _mlp_bundle(root: Path, target: dict | None = None, shape_ranges=None) -> Path:
    onnx_path = mlp_onnx(root / "m.onnx")
    return write_bundle(root / "m-cpu.dse", name="m", target=target or {"name": "cpu", "backend": "onnxruntime"},
                        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                        models={"models/fp32.onnx": onnx_path}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                        default_variant="fp32",
                        shape_ranges={"batch": {"min": 1, "max": 8}} if shape_ranges is None else shape_ranges)


@pytest.fixture
def bundle(tmp_path):
    return _mlp_bundle(tmp_path)


@pytest.fixture
def keys(tmp_path):
    return generate_key(tmp_path / "keys" / "release")


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_export_refuses_what_load_refuses_under_trusted_keys(bundle, keys, tmp_path, monkeypatch, capsys):
    priv, pub = keys
    monkeypatch.setenv(ENV, os.fspath(pub))
    with pytest.raises(SignatureError, match="unsigned and trusted keys are configured"):
        dsedge.load(bundle)
    code, out = cli(capsys, "export", "triton", str(bundle), "--out", str(tmp_path / "r1"))
    assert code == 2 and "unsigned and trusted keys are configured" in out and "Traceback" not in out, out
    assert not (tmp_path / "r1" / "m_fp32").exists()
    sign_bundle(bundle, priv)
    assert [m.name for m in export_triton(bundle, tmp_path / "r2").models] == ["m_fp32"]
    m = read_manifest(bundle)
    m.latency_budget_ms = 1.0  # edited after signing (hashes re-written): load refuses it, so must export
    write_manifest(bundle, m)
    with pytest.raises(SignatureError, match="the manifest was changed after it was signed"):
        export_triton(bundle, tmp_path / "r3")
    assert not (tmp_path / "r3" / "m_fp32").exists()
    monkeypatch.delenv(ENV)
    export_triton(bundle, tmp_path / "r4")  # no keys configured: signatures are not required, as for load


def test_python_export_copies_only_the_bundles_listed_files_never_through_links(bundle, keys, tmp_path, monkeypatch):
    priv, pub = keys
    monkeypatch.delenv(ENV, raising=False)
    sign_bundle(bundle, priv)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "release.key").write_text("PRIVATE")
    (bundle / "keys").symlink_to(secret)  # a linked folder inside the bundle, not in the manifest
    (bundle / "notes.txt").write_text("not listed")
    (bundle / "models" / "extra.bin").write_bytes(b"not listed")
    export_triton(bundle, tmp_path / "repo", platform="python")
    copied = tmp_path / "repo" / "m_fp32" / "1" / "bundle.dse"
    got = sorted(p.relative_to(copied).as_posix() for p in copied.rglob("*") if not p.is_dir())
    assert got == ["manifest.json", "manifest.sig", "models/fp32.onnx"]
    assert not [p for p in (tmp_path / "repo").rglob("*") if p.is_symlink() or "PRIVATE" in _text(p)]
    monkeypatch.setenv(ENV, os.fspath(pub))  # the copy loads where the server requires signatures
    s = dsedge.load(copied, instances=1)
    assert s.run({"x": np.zeros((2, 64), "float32")})["logits"].shape == (2, 4)
    s.close()


def _text(p: Path) -> str:
    return p.read_text(errors="replace") if p.is_file() else ""


def test_an_out_inside_the_bundle_is_refused_in_one_line(bundle, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    before = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*"))
    for out in (bundle / "repo", bundle, bundle / "models" / "r"):
        with pytest.raises(DsedgeError, match="is inside the bundle") as e:
            export_triton(bundle, out, platform="python")
        assert "\n" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "dsedge", "export", "triton", str(bundle), "--platform", "python",
                        "--out", str(bundle / "repo")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is inside the bundle" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")) == before
    other = shutil.copytree(bundle, tmp_path / "other-cpu.dse")  # a user's pass: a repository into another bundle
    with pytest.raises(DsedgeError, match=f"is inside the bundle '{other}'"):
        export_triton(bundle, other / "triton", platform="python")
    assert not (other / "triton").exists()


def test_threads_with_a_tensorrt_plan_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    from dataclasses import asdict

    from dsedge.targets import get_target

    b = _mlp_bundle(tmp_path, target=asdict(get_target("t4")), shape_ranges={"batch": {"min": 1, "opt": 4, "max": 8}})
    assert read_manifest(b).target["backend"] == "tensorrt"
    with pytest.raises(InputError, match="--threads sets ONNX Runtime's intra-op threads"):
        export_triton(b, tmp_path / "r", platform="tensorrt", threads=2)
    code, out = cli(capsys, "export", "triton", str(b), "--out", str(tmp_path / "r"), "--platform", "tensorrt",
                    "--threads", "2")
    assert code == 2 and "--threads" in out and "Traceback" not in out
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    export_triton(b, tmp_path / "r", platform="tensorrt")  # without --threads it exports


def test_config_comments_say_where_each_figure_comes_from(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    b = _mlp_bundle(tmp_path, shape_ranges={})  # no batch range, no budget
    export_triton(b, tmp_path / "r")
    text = (tmp_path / "r" / "m_fp32" / "config.pbtxt").read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert parse_config(tmp_path / "r" / "m_fp32" / "config.pbtxt").max_batch_size == 32
    assert "# max_batch_size 32: dsedge's default 32: the bundle gives 'batch' no range" in comments
    assert "# latency budget 50 ms: dsedge's default: the bundle names none, nor does its target profile" in comments
    assert "opt batch 8 (dsedge's default min(8, max batch): the bundle gives 'batch' no range)" in text
    assert "(bundle)" not in text and "batch shape range max" not in text
    (tmp_path / "b2").mkdir()
    b2 = _mlp_bundle(tmp_path / "b2", shape_ranges={"batch": {"min": 1, "opt": 4, "max": 16}})
    m = read_manifest(b2)
    m.latency_budget_ms = 20.0
    write_manifest(b2, m)
    export_triton(b2, tmp_path / "r2")
    text = (tmp_path / "r2" / "m_fp32" / "config.pbtxt").read_text()
    assert "# max_batch_size 16: the bundle's shape range of 'batch' (max)" in text
    assert "# latency budget 20 ms: the bundle's latency_budget_ms" in text
    assert "opt batch 4 (the bundle's shape range of 'batch' (opt))" in text


def test_warmup_sizes_a_decoders_mask_from_the_same_symbols(tmp_path):
    from dsedge.runtime.bundle import Manifest
    from dsedge.toolchain.triton.policy import derive_policy
    from dsedge.toolchain.triton.repository import _warmup

    ins = [IOSpec("input_ids", "int64", ("batch", "seq")), IOSpec("past", "float32", ("batch", 2, "past", 4)),
           IOSpec("attention_mask", "int64", ("batch", "past + seq")), IOSpec("odd", "float32", ("batch", 3))]
    v = Variant("fp32", "fp32", "models/fp32.onnx")
    m = Manifest("d", {"name": "cpu"}, ins, [IOSpec("y", "float32", ("batch", "seq", 8))], [v], "fp32",
                 shape_ranges={"seq": {"min": 1, "opt": 3, "max": 8}, "past": {"min": 0, "opt": 5, "max": 64}})
    notes: list[str] = []
    warm = _warmup(m, derive_policy(m, v, gpu=False), tmp_path, notes=notes)
    fields = {f["key"]: f["value"] for f in warm[0]["inputs"]}
    assert fields["input_ids"]["dims"] == [3] and fields["past"]["dims"] == [2, 5, 4]
    assert fields["attention_mask"]["dims"] == [8]  # past + seq, from the same values
    assert np.fromfile(tmp_path / "warmup" / "attention_mask", "<i8").tolist() == [1] * 8
    assert any("past + seq = 8" in n for n in notes)
    m.inputs[2] = IOSpec("attention_mask", "int64", ("batch", "past * seq"))  # not a sum: no warm-up, said so
    notes.clear()
    assert _warmup(m, derive_policy(m, v, gpu=False), tmp_path / "x", notes=notes) is None
    assert notes and "no model_warmup" in notes[0]


_NP = {model_config_pb2.TYPE_FP32: np.float32, model_config_pb2.TYPE_INT64: np.int64}


@pytest.fixture(scope="module")
def gpt2_bundle(gpt2):  # noqa: F811  (test_streaming_decode's fixture, imported above)
    """The tiny GPT-2 bundle (2 layers, vocab 64, random weights, optimum export with past key/values) that
    test_streaming_decode.py builds."""
    return gpt2[0]


@pytest.mark.slow
def test_a_decoders_warmup_runs_on_the_exported_model(gpt2_bundle, tmp_path, monkeypatch):
    """Triton does not load a model whose warm-up fails: run every warm-up request of config.pbtxt (Triton forms
    batch_size requests of one row each and batches them) through ONNX Runtime on the exported 1/model.onnx."""
    import onnxruntime as ort

    monkeypatch.delenv(ENV, raising=False)
    mask = [s for s in read_manifest(gpt2_bundle).inputs if s.name == "attention_mask"][0]
    assert mask.shape[1] == "past_sequence_length + sequence_length"
    export_triton(gpt2_bundle, tmp_path / "repo")
    model_dir = tmp_path / "repo" / "tiny-gpt2_fp32"
    cfg = parse_config(model_dir / "config.pbtxt")
    assert cfg.max_batch_size > 0 and len(cfg.model_warmup) >= 2
    sess = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for w in cfg.model_warmup:
        feeds = {}
        for name, inp in w.inputs.items():
            dt, dims = _NP[inp.data_type], list(inp.dims)
            if inp.input_data_file:
                row = np.fromfile(model_dir / "warmup" / inp.input_data_file, dtype=np.dtype(dt).newbyteorder("<"))
                assert row.size == int(np.prod(dims))
                row = row.reshape(dims)
            elif inp.zero_data:
                row = np.zeros(dims, dt)
            else:
                assert inp.random_data
                row = rng.standard_normal(dims).astype(dt)
            feeds[name] = np.stack([row] * w.batch_size)
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        seq, total = feeds["input_ids"].shape[1], feeds["attention_mask"].shape[1]
        assert out["logits"].shape == (w.batch_size, seq, 64) and np.isfinite(out["logits"]).all()
        assert out["present.0.key"].shape[2] == total == feeds["past_key_values.0.key"].shape[2] + seq
    text = (model_dir / "config.pbtxt").read_text()
    assert "(bundle)" not in text and "latency budget 50 ms: dsedge's default" in text


def test_the_kserve_example_is_consistent_with_kserve_and_with_the_export():
    """RawDeployment (HPA) scales on cpu/memory only: a concurrency metric needs Knative (Serverless). The model names
    the example gives are those an export of its t4 bundle writes (t4 has no int4: its default variant is int8)."""
    import re

    import yaml

    from dsedge.targets import get_target

    path = Path(__file__).resolve().parents[1] / "examples" / "kserve" / "inferenceservice.yaml"
    text = path.read_text()
    doc = yaml.safe_load(text)
    mode = doc["metadata"].get("annotations", {}).get("serving.kserve.io/deploymentMode", "Serverless")
    metric = doc["spec"]["predictor"].get("scaleMetric")
    assert (mode == "RawDeployment" and metric in ("cpu", "memory")) or (
        mode == "Serverless" and metric in ("concurrency", "rps", None)), (mode, metric)
    assert "all-minilm-l6-v2-t4.dse" in text
    default = get_target("t4").precision_order[0]
    names = set(re.findall(r"all-minilm-l6-v2_(\w+)", text))
    assert names == {default, "fp32"}, names
    docs = (path.parents[2] / "docs" / "triton.md").read_text()
    assert f"t4 bundle\n`all-minilm-l6-v2_{default}`" in docs or f"all-minilm-l6-v2_{default}`" in docs


def test_export_stages_outside_the_repository_tritonserver_reads(tmp_path, monkeypatch):
    """tritonserver takes every folder of its repository for a model, hidden ones too ("failed to load model
    '.dsedge-export-…'": a server polling the repository during an export, or started after a killed one, failed).
    The repository only ever holds model folders: the staging folder is beside it."""
    from dsedge.toolchain.triton import repository

    (tmp_path / "b").mkdir()
    b = _mlp_bundle(tmp_path / "b")
    repo = tmp_path / "models"
    seen: list[list[str]] = []
    real = repository.to_pbtxt

    def spy(*a, **k):  # called while the models are written, before they are renamed into place
        seen.append(sorted(p.name for p in repo.iterdir()))
        return real(*a, **k)

    monkeypatch.setattr(repository, "to_pbtxt", spy)
    export_triton(b, repo, platform="onnxruntime")
    export_triton(b, repo, platform="python")  # into an existing repository: the model is replaced
    assert seen and all(names in ([], ["m_fp32"]) for names in seen), seen
    assert sorted(p.name for p in repo.iterdir()) == ["m_fp32"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "models"]  # no staging folder left beside it
    assert parse_config(repo / "m_fp32" / "config.pbtxt").backend == "python"


def test_staging_folders_a_killed_export_left_are_removed_and_staging_inside_is_said(tmp_path, monkeypatch, caplog):
    """A staging folder an export killed mid-way left (its pid no longer runs) fails every later tritonserver start
    when it is inside the repository: the next export removes it (beside the repository too), keeps one whose process
    still runs, and says when it has to stage inside (the folder above is on another file system: simulated by
    ``st_dev``)."""
    from dsedge.toolchain.triton import repository

    (tmp_path / "b").mkdir()
    b = _mlp_bundle(tmp_path / "b")
    repo = tmp_path / "models"
    repo.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    stale_inside = repo / f".dsedge-export-{dead}-abc"
    stale_beside = tmp_path / f".models.dsedge-export-{dead}-xyz"
    live = repo / f".dsedge-export-{os.getppid()}-live"  # the process running pytest's parent: alive
    for d in (stale_inside, stale_beside, live):
        (d / "m_fp32" / "1").mkdir(parents=True)
    real_stat = os.stat

    def stat(path, *a, **k):  # the folder above the repository is another file system
        st = real_stat(path, *a, **k)
        if Path(path).parent == tmp_path and Path(path).name.startswith(".models.dsedge-export-"):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1, *tuple(st)[3:]))
        return st

    monkeypatch.setattr(repository.os, "stat", stat)
    with caplog.at_level("WARNING", logger="dsedge"):
        export_triton(b, repo, platform="python")
    assert not stale_inside.exists() and not stale_beside.exists()
    assert live.is_dir()
    assert sorted(p.name for p in repo.iterdir() if not p.name.startswith(".")) == ["m_fp32"]
    assert [p.name for p in repo.iterdir() if p.name.startswith(".")] == [live.name]  # its own staging: removed
    said = [r.getMessage() for r in caplog.records if "staging the export inside" in r.getMessage()]
    assert len(said) == 1 and str(repo) in said[0] and "polling" in said[0], said
