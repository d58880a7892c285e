"""What ``dsedge build`` judges accuracy on: per-token outputs on the real tokens only (``attention_mask``), the
output named by ``--gate-output`` (auto, validate, ``--accuracy-gate``, the TensorRT INT8/INT4 gates), and what
``--json`` prints when the build fails."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsedge.runtime.errors import ConfigError
from dsedge.toolchain.config import BuildConfig, config_from_mapping
from dsedge.toolchain.evaluate import compare_models, model_outputs


def _token_model(path: Path, table: np.ndarray, pad_junk: np.ndarray) -> Path:
    """input_ids [N, T] int64, attention_mask [N, T] int64 → token_embeddings [N, T, D] = table[ids] +
    (1 - mask)[..., None] * pad_junk: the padded positions carry ``pad_junk``, the real ones the table rows."""
    d = table.shape[1]
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["e"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "m"], ["pad"]),
        helper.make_node("Unsqueeze", ["pad", "last"], ["pad3"]),
        helper.make_node("Mul", ["pad3", "junk"], ["j"]),
        helper.make_node("Add", ["e", "j"], ["token_embeddings"]),
    ]
    graph = helper.make_graph(
        nodes, "tokens",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
         for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("token_embeddings", TensorProto.FLOAT, ["batch", "sequence", d])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(pad_junk, "junk"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one"), numpy_helper.from_array(np.array([-1]), "last")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_a_per_token_output_is_judged_on_the_real_tokens_only(tmp_path):
    """A user's pass: an optimum MiniLM export (token_embeddings [N, 32, 384] first) built for cpu rejected int8 at
    cosine 0.884, judged with the padding (57 % of the tokens); on the real tokens it was 0.998. Here the two
    models agree closely on real tokens and differ wildly on padding."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    ref = _token_model(tmp_path / "ref.onnx", table, np.zeros(8, np.float32))
    noisy = (table + 0.01 * rng.standard_normal(table.shape)).astype(np.float32)
    test = _token_model(tmp_path / "test.onnx", noisy, (10 * rng.standard_normal(8)).astype(np.float32))
    lengths = [3, 5, 2, 8]
    ids = rng.integers(1, 50, (4, 8)).astype(np.int64)
    mask = (np.arange(8)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids[mask == 0] = 0  # the pad token

    rec = compare_models(ref, test, {"input_ids": ids, "attention_mask": mask})

    def cos(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    real = [cos(table[ids[i, :n]].ravel(), noisy[ids[i, :n]].ravel()) for i, n in enumerate(lengths)]
    assert rec["output"] == "token_embeddings" and rec["masked_by"] == "attention_mask" and rec["tokens"] == 18
    assert rec["cosine_mean"] == pytest.approx(np.mean(real), abs=1e-5) and rec["cosine_mean"] > 0.999
    assert rec["cosine_min"] == pytest.approx(min(real), abs=1e-5) and rec["n"] == 4
    assert rec["max_abs_diff"] == pytest.approx(float(np.abs(table[ids][mask == 1] - noisy[ids][mask == 1]).max()),
                                                rel=1e-5)
    assert rec["max_abs_diff"] < 0.1 and rec["pearson"] > 0.999 and rec["argmax_agreement"] == 1.0
    # the padding does differ: judged over every position (as before), the same models fall far below
    feeds = {"input_ids": ids, "attention_mask": mask}
    a, b = (model_outputs(m, feeds)["token_embeddings"].reshape(4, -1) for m in (ref, test))
    assert np.mean([cos(a[i], b[i]) for i in range(4)]) < 0.6
    assert compare_models(ref, test, feeds, output="token_embeddings") == rec


def _two_output_onnx(path: Path, k: int = 64, n: int = 16, seed: int = 0) -> Path:
    """x [batch, k] → ``drift`` [batch, n] = MatMul(x, W) - ReduceSum(x[..., None] * W, 1) (0 up to fp32 rounding
    in the fp32 model; the MatMul's quantization error once INT8/INT4 converts it: cosine ~0 vs fp32) and
    ``logits`` [batch, n] = MatMul(x, W) (quantizes fine). ``drift`` is the first output."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc"),
        helper.make_node("Unsqueeze", ["x", "two"], ["x3"]),
        helper.make_node("Mul", ["x3", "w"], ["xw"]),
        helper.make_node("ReduceSum", ["xw", "one"], ["h"], keepdims=0),
        helper.make_node("Sub", ["logits", "h"], ["drift"]),
    ]
    graph = helper.make_graph(
        nodes, "two_outputs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("drift", TensorProto.FLOAT, ["batch", n]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([2]), "two"),
         numpy_helper.from_array(np.array([1]), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``dsedge build ARGS`` in process, through the CLI's entry point: (exit code, stdout, stderr)."""
    from dsedge.cli import main

    with pytest.raises(SystemExit) as e:
        main(["build", *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_gate_output_picks_what_validate_and_the_accuracy_gate_judge_and_json_reports_a_failure(tmp_path, capsys):
    """The int8 variant is fine on ``logits`` and off on ``drift`` (the first output, judged by default): the gate
    fails by default, and --json still prints one JSON object on stdout; with --gate-output logits it ships."""
    model = _two_output_onnx(tmp_path / "m.onnx")
    common = ["--model", str(model), "--target", "cpu", "--precision", "int8", "--accuracy-gate", "cosine:0.99",
              "--no-fp32", "--json", "-q"]
    code, out, err = _cli(capsys, *common, "--out", str(tmp_path / "a"))
    assert code == 2 and "error: accuracy gate cosine:0.99 not met by the int8 variant" in err
    failed = json.loads(out.strip())
    assert failed["ok"] is False and failed["type"] == "AccuracyGateError" and failed["exit_code"] == 2
    assert "accuracy gate cosine:0.99 not met by the int8 variant" in failed["error"] and failed["hint"]
    cosine = float(failed["error"].split("cosine = ")[1].split()[0])
    assert cosine < 0.5  # drift: the MatMul's quantization error vs fp32 rounding noise
    assert not (tmp_path / "a" / "m-cpu.dse").exists()

    code, out, err = _cli(capsys, *common, "--out", str(tmp_path / "b"), "--gate-output", "logits")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] is True and report["precision"] == "int8"
    acc = report["variants"][0]["accuracy"]
    assert acc["output"] == "logits" and acc["cosine_mean"] > 0.99 and "masked_by" not in acc


def test_auto_judges_its_candidates_on_the_gate_output(tmp_path):
    from dsedge.toolchain.pipeline import build

    model = _two_output_onnx(tmp_path / "m.onnx")
    report = build(BuildConfig(model=str(model), target="cpu", out_dir=str(tmp_path / "o"), latency_iterations=3,
                               keep_fp32=False, gate_output="logits")).report
    int8 = next(c for c in report["precision_choice"]["candidates"] if c["precision"] == "int8")
    assert int8["qualifies"] is True and int8["cosine_mean"] > 0.99  # on drift (the default) it is < 0.5


def test_an_unknown_gate_output_is_refused_before_any_work_listing_the_outputs(tmp_path, capsys):
    model = _two_output_onnx(tmp_path / "m.onnx")
    code, out, err = _cli(capsys, "--model", str(model), "--target", "cpu", "--out", str(tmp_path / "o"),
                          "--gate-output", "sentence", "--json")
    assert code == 2
    failed = json.loads(out.strip())
    assert failed == {"ok": False, "error": "--gate-output 'sentence' is not an output of m.onnx",
                      "hint": "outputs: drift, logits", "type": "ConfigError", "exit_code": 2}
    assert "error: --gate-output 'sentence' is not an output of m.onnx" in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
    # a build.toml takes the key too
    assert config_from_mapping({"gate-output": "logits"}).gate_output == "logits"


def test_an_unknown_gate_output_of_an_exported_source_is_refused_before_compression(tmp_path, capsys):
    """A Hugging Face directory's outputs are known once exported: the name is checked there, not swallowed by
    auto's candidates (each would be skipped for it, ending in a misleading "no precision could be built")."""
    from tiny_models import tiny_bert_dir

    src = tiny_bert_dir(tmp_path / "tiny-bert", hidden=8)
    code, out, err = _cli(capsys, "--model", str(src), "--target", "cpu", "--out", str(tmp_path / "o"),
                          "--gate-output", "pooled", "--json")
    assert code == 2
    failed = json.loads(out.strip())
    assert (failed["type"], failed["error"]) == ("ConfigError", "--gate-output 'pooled' is not an output of the "
                                                 "exported model")
    assert "last_hidden_state" in failed["hint"] and "no precision" not in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_the_tensorrt_gates_measure_the_gate_output():
    """``_embedding_output`` picks what the INT8/INT4 accuracy gates of TensorRT targets measure."""
    from dsedge.toolchain.stages.compressors import _embedding_output

    exported = SimpleNamespace(outputs=[SimpleNamespace(name=n) for n in ("token_embeddings", "sentence_embedding")],
                               path=Path("model.onnx"))
    encoder = SimpleNamespace(task="sentence-embedding")
    assert _embedding_output(exported, encoder) == "sentence_embedding"
    assert _embedding_output(exported, encoder, "token_embeddings") == "token_embeddings"
    assert _embedding_output(exported, SimpleNamespace(task="generic")) == 0
    with pytest.raises(ConfigError, match="'logits' is not an output of model.onnx") as e:
        _embedding_output(exported, encoder, "logits")
    assert e.value.hint == "outputs: token_embeddings, sentence_embedding"
