"""`dsedge export triton`: the model repository for the reference bundle of every target, config.pbtxt read back
field by field with tritonclient's ModelConfig, the batching settings checked against the bundle."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from dsedge.cli import main
from dsedge.runtime.bundle import verify_bundle
from dsedge.runtime.errors import TargetError
from dsedge.runtime.latency_profile import LatencyProfile
from dsedge.toolchain.triton import export_triton
from dsedge.toolchain.triton.policy import measured_seq
from triton_server import retarget_bundle

TARGETS = ("cpu", "jetson-orin", "jetson-xavier", "t4", "a100", "h100")
DTYPES = {"int64": model_config_pb2.TYPE_INT64, "float32": model_config_pb2.TYPE_FP32}


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    """config.pbtxt → ModelConfig; text_format raises ParseError on any field the proto does not have."""
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def target_bundles(reference_build, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    out = {"jetson-orin": reference_build.bundle}
    for t in TARGETS:
        if t != "jetson-orin":
            out[t] = retarget_bundle(reference_build.bundle, root / f"all-minilm-l6-v2-{t}.dse", t)
    return out


@pytest.fixture(scope="module")
def exports(target_bundles, tmp_path_factory):
    root = tmp_path_factory.mktemp("repos")
    return {t: export_triton(b, root / t) for t, b in target_bundles.items()}


def check_semantics(cfg: model_config_pb2.ModelConfig, manifest, variant_name: str) -> None:
    """What the parser does not check: IO as in the manifest, priorities in range, preferred ≤ max batch."""
    assert cfg.max_batch_size == manifest.shape_ranges["batch"]["max"] > 1
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        (s.name, DTYPES[s.dtype], [-1]) for s in manifest.inputs]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("last_hidden_state", [-1, 384]),
                                                            ("sentence_embedding", [384])]
    db = cfg.dynamic_batching
    assert db.preferred_batch_size and list(db.preferred_batch_size) == sorted(db.preferred_batch_size)
    assert all(1 <= b <= cfg.max_batch_size for b in db.preferred_batch_size)
    assert db.priority_levels >= 1 and 1 <= db.default_priority_level <= db.priority_levels
    q = db.default_queue_policy
    assert q.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT and q.allow_timeout_override
    assert 0 < q.default_timeout_microseconds <= manifest.latency_budget_ms * 1000
    assert db.max_queue_delay_microseconds < manifest.latency_budget_ms * 1000
    assert {w.batch_size for w in cfg.model_warmup} == {1, db.preferred_batch_size[-1]}
    assert cfg.name.endswith("_" + variant_name)


def test_every_target_exports_with_its_default_platform(exports, target_bundles):
    for target, result in exports.items():
        manifest = verify_bundle(target_bundles[target])
        gpu = target != "cpu"
        assert [m.variant for m in result.models] == ["int4", "fp32"]  # cascade variants: separate models
        assert sorted(p.name for p in result.repository.iterdir()) == ["all-minilm-l6-v2_fp32",
                                                                       "all-minilm-l6-v2_int4"]
        for m in result.models:
            cfg = parse_config(result.repository / m.name / "config.pbtxt")
            check_semantics(cfg, manifest, m.variant)
            assert cfg.platform == "onnxruntime_onnx" and cfg.backend == "onnxruntime"
            assert (result.repository / m.name / "1" / "model.onnx").is_file()
            kinds = {g.kind for g in cfg.instance_group}
            assert kinds == {model_config_pb2.ModelInstanceGroup.KIND_GPU if gpu
                             else model_config_pb2.ModelInstanceGroup.KIND_CPU}
            accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator
            if gpu:
                assert [a.name for a in accel] == ["tensorrt"]
                assert accel[0].parameters["precision_mode"] == {"int4": "FP16", "fp32": "FP32"}[m.variant]
                # no GPU latency measured: preferred sizes up to the optimization profile's opt batch
                opt = manifest.shape_ranges["batch"]["opt"]
                assert list(cfg.dynamic_batching.preferred_batch_size) == [b for b in (1, 2, 4, 8, 16, 32)
                                                                           if b <= opt][-4:]
                assert cfg.dynamic_batching.max_queue_delay_microseconds == int(manifest.latency_budget_ms * 100)
            else:
                assert not accel


def test_cpu_batching_holds_the_budget_by_the_measured_profile(exports, target_bundles):
    manifest = verify_bundle(target_bundles["cpu"])
    for m in exports["cpu"].models:
        cfg = parse_config(exports["cpu"].repository / m.name / "config.pbtxt")
        variant = manifest.variant(m.variant)
        prof, seq = LatencyProfile.from_variant(variant), measured_seq(variant)
        db = cfg.dynamic_batching
        top = db.preferred_batch_size[-1]
        budget_us = manifest.latency_budget_ms * 1000
        worst = db.max_queue_delay_microseconds + 1000 * (prof.predict(top, seq, k_dev=0) + prof.predict(top, seq))
        # (+1 µs: the manifest's latencies are whole µs, so delay + p50 + p99 can land on the budget exactly, and
        # float rounding put it a hair over)
        if worst > budget_us + 1:  # only when even one request cannot: batching off
            assert list(db.preferred_batch_size) == [1] and db.max_queue_delay_microseconds == 0
        else:
            # the next power of two would not have fitted
            nxt = 2 * top
            assert nxt > cfg.max_batch_size or (prof.predict(nxt, seq, k_dev=0) + prof.predict(nxt, seq)) * 1000 \
                > budget_us
            assert db.default_queue_policy.default_timeout_microseconds == pytest.approx(
                budget_us - 1000 * prof.predict(top, seq, k_dev=0), abs=2)


def test_cpu_int4_embedding_rewrite_is_in_the_exported_file(exports, target_bundles):
    repo = exports["cpu"].repository
    q = onnx.load(str(repo / "all-minilm-l6-v2_int4" / "1" / "model.onnx"))
    gbq = [n for n in q.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gbq) == 1 and gbq[0].domain == "com.microsoft"
    assert any(o.domain == "com.microsoft" for o in q.opset_import)
    # the GPU export keeps standard Q/DQ for TensorRT
    g = onnx.load(str(exports["t4"].repository / "all-minilm-l6-v2_int4" / "1" / "model.onnx"))
    assert not [n for n in g.graph.node if n.op_type == "GatherBlockQuantized"]
    # and the rewritten file still computes what the bundle does
    import onnxruntime as ort

    import dsedge

    feeds = {n: np.ones((2, 7), np.int64) for n in ("input_ids", "attention_mask", "token_type_ids")}
    feeds["input_ids"] = np.array([[101, 7592, 2088, 2001, 2397, 1012, 102]] * 2, np.int64)
    from dsedge.runtime.backends.ort import WIDE_INT4_ACCURACY_LEVEL

    # the reference int4 is at block 64 (a TensorRT target's), which dsedge runs at FP32 activations for batch
    # invariance (runtime/backends/ort.py); the same setting here, and the export says Triton's backend runs ORT's own
    so = ort.SessionOptions()
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", WIDE_INT4_ACCURACY_LEVEL)
    sess = ort.InferenceSession(str(repo / "all-minilm-l6-v2_int4" / "1" / "model.onnx"), so,
                                providers=["CPUExecutionProvider"])
    got = sess.run(["sentence_embedding"], feeds)[0]
    assert any("not batch-invariant" in n for m in exports["cpu"].models if m.variant == "int4" for n in m.notes)
    want = dsedge.load(target_bundles["cpu"]).run(feeds)["sentence_embedding"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_warmup_files_hold_valid_random_ids(exports, target_bundles):
    manifest = verify_bundle(target_bundles["cpu"])
    model_dir = exports["cpu"].repository / "all-minilm-l6-v2_int4"
    cfg = parse_config(model_dir / "config.pbtxt")
    seq = manifest.shape_ranges["sequence"]["opt"]
    for w in cfg.model_warmup:
        for spec in manifest.inputs:
            entry = w.inputs[spec.name]
            assert list(entry.dims) == [seq] and entry.input_data_file == spec.name
            data = np.fromfile(model_dir / "warmup" / spec.name, dtype="<i8")
            assert data.size == seq and spec.value_range[0] <= data.min() and data.max() <= spec.value_range[1]
    ids = np.fromfile(model_dir / "warmup" / "input_ids", dtype="<i8")
    assert len(set(ids.tolist())) > seq // 2  # random, not a constant


def test_tensorrt_platform_writes_the_trtexec_command(target_bundles, tmp_path):
    result = export_triton(target_bundles["t4"], tmp_path / "repo", platform="tensorrt", instances=2)
    model_dir = tmp_path / "repo" / "all-minilm-l6-v2_int4"
    cfg = parse_config(model_dir / "config.pbtxt")
    assert cfg.platform == "tensorrt_plan" and cfg.instance_group[0].count == 2
    script = (model_dir / "build_engine.sh").read_text()
    cmd = next(line for line in script.splitlines() if line.startswith("trtexec "))
    assert "--onnx=1/model.onnx" in cmd and "--saveEngine=1/model.plan" in cmd
    assert "--maxShapes=input_ids:64x512" in cmd and "--fp16" in cmd and "--skipInference" in cmd  # TensorRT 10
    assert (model_dir / "1" / "model.onnx").is_file() and not (model_dir / "1" / "model.plan").exists()
    assert "build_engine.sh" in " ".join(result.models[0].notes)
    ort = export_triton(target_bundles["cpu"], tmp_path / "ort", threads=2)
    cfg = parse_config(tmp_path / "ort" / ort.models[0].name / "config.pbtxt")
    assert cfg.parameters["intra_op_thread_count"].string_value == "2"
    with pytest.raises(TargetError, match="runs ONNX Runtime"):
        export_triton(target_bundles["cpu"], tmp_path / "nope", platform="tensorrt")
    assert not (tmp_path / "nope").exists()


def test_python_platform_layout(target_bundles, tmp_path):
    export_triton(target_bundles["cpu"], tmp_path / "repo", platform="python", threads=1)
    model_dir = tmp_path / "repo" / "all-minilm-l6-v2_fp32"
    cfg = parse_config(model_dir / "config.pbtxt")
    assert cfg.backend == "python" and not cfg.platform
    assert cfg.parameters["variant"].string_value == "fp32" and cfg.parameters["threads"].string_value == "1"
    assert all(i.allow_ragged_batch for i in cfg.input)  # model.py pads ragged sentences like dsedge does
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert verify_bundle(model_dir / "1" / "bundle.dse").name == "all-minilm-l6-v2"
    compile(( model_dir / "1" / "model.py").read_text(), "model.py", "exec")


def test_cli_export_json_and_errors(target_bundles, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "triton", str(target_bundles["a100"]), "--out", str(tmp_path / "r"), "--json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in out["models"]] == ["all-minilm-l6-v2_int4", "all-minilm-l6-v2_fp32"]
    assert out["models"][0]["platform"] == "onnxruntime" and out["models"][0]["preferred_batch_size"] == [4, 8, 16, 32]
    r = subprocess.run([sys.executable, "-m", "dsedge", "export", "triton", str(tmp_path / "missing.dse"),
                        "--out", str(tmp_path / "r2")], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    # a helper's target pass: the a100 profile builds version-compatible plans, which Triton's TensorRT backend
    # loads only with version-compatible=true: the TensorRT export and its serve line say so; t4's does not
    for target, said in (("a100", True), ("t4", False)):
        with pytest.raises(SystemExit) as e:
            main(["export", "triton", str(target_bundles[target]), "--out", str(tmp_path / f"trt-{target}"),
                  "--platform", "tensorrt"])
        text = capsys.readouterr().out
        serve = next(line for line in text.splitlines() if line.startswith("serve: tritonserver"))
        assert e.value.code == 0 and serve.endswith("--backend-config=tensorrt,version-compatible=true") is said


def test_cli_export_help_and_quiet(tmp_path, capsys):
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["export", "triton", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "-q, --quiet" in help_text and "atomically" not in help_text
    assert "an existing model repository updated in place (each model renamed into place, replacing one of the " \
           "same name unless dsedge exported that one for another target; other models are kept)" in help_text
    outs = {}
    for args in ([], ["-q"]):  # -q after the subcommand, as every other command takes it
        with pytest.raises(SystemExit) as e:
            main(["export", "triton", str(bundle), "--out", str(tmp_path / "repo"), *args])
        outs[tuple(args)], err = capsys.readouterr()
        assert e.value.code == 0 and err == ""
    assert outs[()].splitlines()[-1] == f"serve: tritonserver --model-repository={tmp_path / 'repo'}"
    assert outs[("-q",)].splitlines() == outs[()].splitlines()[:-1]  # the repository and its models, no next step
    assert outs[("-q",)].startswith(f"wrote Triton model repository {tmp_path / 'repo'}\n  mlp_fp32 (onnxruntime)")


def _manifest(latency_ms: dict, target: dict | None = None, shapes=("batch", "sequence")):
    from dsedge.runtime.bundle import IOSpec, Manifest, Variant

    ids = IOSpec("input_ids", "int64", shapes, (0, 99))
    mask = IOSpec("attention_mask", "int64", shapes, (0, 1))
    out = IOSpec("emb", "float32", (shapes[0], 8))
    v = Variant("int4", "int4", "models/int4.onnx", latency_ms=latency_ms)
    return Manifest("m", target or {"name": "cpu", "backend": "onnxruntime"}, [ids, mask], [out], [v], "int4",
                    shape_ranges={"batch": {"min": 1, "opt": 8, "max": 64}, "sequence": {"min": 1, "opt": 16,
                                                                                          "max": 64}},
                    latency_budget_ms=50.0), v


def test_policy_numbers_from_a_known_profile():
    from dsedge.toolchain.triton.policy import derive_policy, dynamic_batching

    shape = {"input_ids": [1, 32]}
    m, v = _manifest({"1": {"p50": 2.0, "p99": 5.0, "shape": shape},
                      "8": {"p50": 10.0, "p99": 19.0, "shape": {"input_ids": [8, 32]}}})
    p = derive_policy(m, v, gpu=False)
    # batch 8: p50 10 + p99 19 = 29 ms ≤ 50; batch 16 (extrapolated): p50 10 + 8·8/7 = 19.1 ms, p99 deviation
    # scaled ×2: 19.1 + 3·6 = 37.1 ms, sum 56.3 > 50
    assert p.max_batch_size == 64 and p.preferred_batch_sizes == (1, 2, 4, 8)
    assert p.max_queue_delay_us == 12500  # 50 − 29 = 21 ms left, capped at a quarter of the budget
    assert p.timeout_us == 40000  # budget − p50 of batch 8
    assert p.max_queue_size == 5 * 8  # 50 / 10 ms batches of 8
    db = dynamic_batching(p)
    assert db["default_queue_policy"]["timeout_action"] == "REJECT" and db["priority_levels"] == 2

    slow, sv = _manifest({"1": {"p50": 30.0, "p99": 40.0, "shape": shape}})
    p = derive_policy(slow, sv, gpu=False)
    assert p.preferred_batch_sizes == (1,) and p.max_queue_delay_us == 0 and p.timeout_us == 50000
    assert "batching off" in " ".join(p.derived_from)

    gpu = derive_policy(*_manifest({}, {"name": "t4", "backend": "tensorrt"}), gpu=True)
    assert gpu.preferred_batch_sizes == (1, 2, 4, 8) and gpu.max_queue_delay_us == 5000
    assert "no GPU latency" in " ".join(gpu.derived_from)

    static = derive_policy(*_manifest({}, shapes=(1, 16)), gpu=False)
    assert static.max_batch_size == 0 and dynamic_batching(static) is None


def test_warmup_of_integer_inputs_without_a_range_is_zeros(tmp_path):
    from dsedge.runtime.bundle import IOSpec
    from dsedge.toolchain.triton.policy import derive_policy
    from dsedge.toolchain.triton.repository import _warmup

    m, v = _manifest({})
    m.inputs = [IOSpec("ids", "int64", ("batch", "sequence")), IOSpec("x", "float32", ("batch", 4))]
    warm = _warmup(m, derive_policy(m, v, gpu=True), tmp_path)
    fields = {f["key"]: f["value"] for f in warm[0]["inputs"]}
    assert fields["ids"].get("zero_data") and fields["ids"]["dims"] == [16]
    assert fields["x"].get("random_data") and fields["x"]["dims"] == [4]
    assert [w["batch_size"] for w in warm] == [1, 8]


def _export_plans(bundle: Path, repo: Path) -> tuple[Any, dict[str, bytes]]:
    """Re-hash ``bundle`` (engines added), export it, check every model went to Triton's TensorRT backend (the
    default when every variant has an engine) without build_engine.sh; returns the export and each variant's
    ``1/model.plan`` bytes."""
    from dsedge.runtime.bundle import read_manifest, write_manifest

    write_manifest(bundle, read_manifest(bundle))
    result = export_triton(bundle, repo)
    assert {m.platform for m in result.models} == {"tensorrt"}
    plans = {}
    for v in ("int4", "fp32"):
        model_dir = repo / f"all-minilm-l6-v2_{v}"
        assert not (model_dir / "build_engine.sh").exists()
        plans[v] = (model_dir / "1" / "model.plan").read_bytes()
    return result, plans


def test_a_bundle_with_engines_exports_them_as_model_plan(target_bundles, tmp_path):
    b = retarget_bundle(target_bundles["a100"], tmp_path / "with-engines.dse", "a100")
    (b / "engines").mkdir()
    for v in ("int4", "fp32"):
        (b / "engines" / f"{v}.plan").write_bytes(f"engine bytes of {v}".encode())  # never parsed by the export
    _, plans = _export_plans(b, tmp_path / "repo")
    assert plans == {v: f"engine bytes of {v}".encode() for v in ("int4", "fp32")}
    for v in ("int4", "fp32"):
        cfg = parse_config(tmp_path / "repo" / f"all-minilm-l6-v2_{v}" / "config.pbtxt")
        assert cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 128


def test_engines_dsedge_build_wrote_are_exported_as_their_plan(target_bundles, tmp_path):
    """A helper's target pass: the export looked only for raw ``engines/<variant>.plan`` files, a name no dsedge
    command writes, so the engines ``dsedge build --engine`` ships (``engines/*.engine``: a dsedge header, then the
    plan) were never used. They are now exported as ``1/model.plan`` (the plan alone), with a note naming the GPU
    and TensorRT they need; an engine of another model file, or of a DLA core, is not."""
    from dsedge.runtime.bundle import read_manifest, write_manifest
    from dsedge.runtime.engine_cache import EngineKey, write_engine

    b = retarget_bundle(target_bundles["a100"], tmp_path / "with-engines.dse", "a100")
    m = read_manifest(b)

    def key(v: str, **kw) -> EngineKey:
        base = dict(variant=v, gpu="NVIDIA A100-SXM4-80GB", compute_capability="8.0", sm_count=108,
                    tensorrt="10.15.1.29", model_sha256=m.files[f"models/{v}.onnx"], settings_sha256="s" * 64)
        return EngineKey(**{**base, **kw})

    for v in ("int4", "fp32"):
        write_engine(b / "engines" / key(v).slot(), f"plan of {v}".encode(), key(v))
    stale = key("fp32", model_sha256="0" * 64)  # another model file: never exported
    write_engine(b / "engines" / stale.slot(), b"stale plan", stale)
    result, plans = _export_plans(b, tmp_path / "repo")
    assert plans == {v: f"plan of {v}".encode() for v in ("int4", "fp32")}
    note = next(n for mo in result.models for n in mo.notes if n.startswith("1/model.plan is"))
    assert "NVIDIA A100-SXM4-80GB (sm80) with TensorRT 10.15.1.29" in note
    # only a DLA engine for int4: no GPU engine for every variant, so the default stays onnxruntime
    c = retarget_bundle(target_bundles["a100"], tmp_path / "dla-only.dse", "a100")
    dla = key("int4", dla_core=0)
    write_engine(c / "engines" / dla.slot(), b"dla plan", dla)
    write_manifest(c, read_manifest(c))
    assert {mo.platform for mo in export_triton(c, tmp_path / "repo2").models} == {"onnxruntime"}


def test_pbtxt_strings_and_enums_round_trip():
    from dsedge.toolchain.triton.pbtxt import Enum, to_pbtxt

    text = to_pbtxt({"name": 'modèle "q" \\ x', "max_batch_size": 0,
                     "instance_group": [{"count": 2, "kind": Enum("KIND_CPU")}],
                     "parameters": [{"key": "k", "value": {"string_value": "a\nb"}}], "input": []}, ["µs ≤ budget"])
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.name == 'modèle "q" \\ x' and cfg.parameters["k"].string_value == "a\nb"
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU and not cfg.input
    with pytest.raises(text_format.ParseError):  # what "no unknown field" rests on
        text_format.Parse(to_pbtxt({"max_batch_sise": 4}), model_config_pb2.ModelConfig())


def test_export_adds_models_to_a_repository_and_never_replaces_a_users_folder(target_bundles, tmp_path):
    from dsedge.runtime.errors import DsedgeError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DsedgeError, match="not a Triton model repository"):
        export_triton(target_bundles["cpu"], mine, platform="python")
    assert (mine / "notes.txt").read_text() == "keep me" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]

    repo = tmp_path / "repo"
    (repo / "other_model").mkdir(parents=True)
    (repo / "other_model" / "config.pbtxt").write_text('name: "other_model"\n')
    export_triton(target_bundles["cpu"], repo, platform="python")
    export_triton(target_bundles["cpu"], repo, platform="python")  # a re-export replaces its own models
    assert sorted(p.name for p in repo.iterdir()) == ["all-minilm-l6-v2_fp32", "all-minilm-l6-v2_int4", "other_model"]
    assert (repo / "other_model" / "config.pbtxt").read_text() == 'name: "other_model"\n'
    # the same model for another target: same names, refused (one repository serves one machine), nothing replaced
    before = {p: p.read_bytes() for p in repo.rglob("config.pbtxt")}
    gpu = next(t for t in target_bundles if t != "cpu")
    with pytest.raises(DsedgeError, match=f"holds the cpu export of all-minilm-l6-v2; this bundle's target is {gpu}"):
        export_triton(target_bundles[gpu], repo)
    assert {p: p.read_bytes() for p in repo.rglob("config.pbtxt")} == before
    assert sorted(p.name for p in repo.iterdir()) == ["all-minilm-l6-v2_fp32", "all-minilm-l6-v2_int4", "other_model"]
