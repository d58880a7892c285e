"""`dsedge quantize` and `dsedge prune` end to end on a tiny real ONNX model (the CLI entry point, real ORT)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest


from quantize_models import cosine, inputs, mlp, run
from cli_helpers import run_main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    onnx.save(mlp(), str(d / "mlp.onnx"))
    (d / "calib").mkdir()
    (d / "held").mkdir()
    for i, b in enumerate(inputs()):
        np.savez(d / "calib" / f"{i}.npz", **b)
    for i, b in enumerate(inputs(n_batches=2, seed=7)):
        np.savez(d / "held" / f"{i}.npz", **b)
    return d


def test_quantize_int4_gptq_with_gate_writes_model_and_report(files, capsys):
    out, rep = files / "q4.onnx", files / "q4.json"
    code, stdout, _ = run_main(["quantize", files / "mlp.onnx", "-o", out, "--algorithm", "gptq", "--block-size", 16,
                            "--calib", files / "calib", "--heldout", files / "held", "--accuracy-gate", "cosine:0.99",
                            "--report", rep], capsys)
    assert code == 0 and "wrote" in stdout
    report = json.loads(rep.read_text())
    assert report["gate"] == "cosine:0.99" and report["value"] >= 0.99 and report["precision"] == "int4"
    q = onnx.load(str(out))
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 3
    x = inputs(n_batches=1, seed=7)[0]
    assert cosine(run(mlp(), x), run(q, x)) >= 0.99
    assert not list(files.glob(".q4.onnx.tmp-*"))


@pytest.mark.parametrize("args", [["--precision", "fp16"], ["--precision", "int8", "--int8-mode", "dynamic"]])
def test_quantize_other_precisions(files, capsys, args):
    out = files / f"q_{args[1]}.onnx"
    code, stdout, _ = run_main(["quantize", files / "mlp.onnx", "-o", out, *args], capsys)
    assert code == 0 and args[1] in stdout
    x = inputs(n_batches=1, seed=3)[0]
    assert cosine(run(mlp(), x), run(onnx.load(str(out)), x)) > 0.99


def test_quantize_user_errors_are_one_line(files, capsys):
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "x.onnx", "--algorithm", "awq"], capsys)
    assert code == 2 and "AWQ needs calibration data" in err and "Traceback" not in err
    assert not (files / "x.onnx").exists()
    code, _, err = run_main(["quantize", files / "nope.onnx", "-o", files / "x.onnx"], capsys)
    assert code == 2 and "not found" in err
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "x.onnx", "--calib", files / "calib",
                         "--accuracy-gate", "cosine:0.99"], capsys)
    assert code == 2 and "--heldout" in err
    # an output path that cannot be a file: one line, exit 2, nothing left behind (was a FileExistsError /
    # IsADirectoryError traceback)
    (files / "afile").write_text("x")
    for bad, why in ((files / "afile" / "q.onnx", "a file is in the way"),
                     (files / "calib", "the path is a directory")):
        code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", bad, "--algorithm", "rtn"], capsys)
        assert code == 2 and why in err and "Traceback" not in err and err.count("\n") <= 2, err
    assert sorted(p.name for p in files.iterdir() if p.name.startswith(".")) == []


def test_prune_2_4(files, capsys):
    out = files / "p.onnx"
    code, stdout, _ = run_main(["prune", files / "mlp.onnx", "-o", out, "--calib", files / "calib"], capsys)
    assert code == 0 and "2:4 sparsity on 3 layers" in stdout
    w = onnx.numpy_helper.to_array(next(t for t in onnx.load(str(out)).graph.initializer if t.name == "w2"))
    assert (w == 0).mean() == 0.5


def test_quantize_refuses_heldout_that_is_the_calibration_data(files, capsys):
    """Found by a user: `--heldout` = `--calib` passed the gate on the data it calibrated on (dsedge build refuses
    it); the report's gate value was optimistic by construction."""
    for held, what in ((files / "calib", "is the same as"), (files / "calib" / "1.npz", "shares 1 file(s) with")):
        code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "hc.onnx", "--precision", "int8",
                                 "--calib", files / "calib", "--heldout", held, "--accuracy-gate", "cosine:0.99"],
                                capsys)
        assert code == 2 and f"{what} --calib" in err and "Traceback" not in err, err
    assert not (files / "hc.onnx").exists()


def test_prune_2_4_refuses_an_explicit_sparsity(files, capsys):
    """Found by a user: `--pattern 2:4 --sparsity 0.3` was silently ignored (only values other than the default
    were refused)."""
    code, _, err = run_main(["prune", files / "mlp.onnx", "-o", files / "s.onnx", "--sparsity", "0.3"], capsys)
    assert code == 2 and "--sparsity applies to --pattern channels" in err and "Traceback" not in err
    assert not (files / "s.onnx").exists()


@pytest.mark.parametrize("first", [["--precision", "int4", "--algorithm", "rtn"],
                                   ["--precision", "int8", "--int8-mode", "dynamic"]])
def test_quantize_refuses_a_model_that_is_already_quantized(files, capsys, first):
    """Found by a user: quantizing an INT4 (Q/DQ) or dynamic INT8 (MatMulInteger) model again "succeeded" — INT4 on
    INT4 wrote the same model back, INT8 dynamic on it wrapped the DequantizeLinear outputs again."""
    q = files / f"once_{first[1]}.onnx"
    code, _, _ = run_main(["quantize", files / "mlp.onnx", "-o", q, *first], capsys)
    assert code == 0
    for again in (["--precision", "int4", "--algorithm", "rtn"], ["--precision", "int8", "--int8-mode", "dynamic"],
                  ["--precision", "fp16"]):
        out = files / "twice.onnx"
        code, _, err = run_main(["quantize", q, "-o", out, *again], capsys)
        assert code == 2 and "error: the model is already quantized" in err and "Traceback" not in err, err
        assert "hint: quantize the fp32 source model it was made from" in err
        assert not out.exists() and not list(files.glob(".twice.onnx.tmp-*"))


def test_compress_refuses_quantized_models_and_keeps_int4_embedding_tables_quantizable(tmp_path):
    """The Python entry point refuses what `dsedge quantize` refuses (Q/DQ, QLinear*, MatMulNBits, …); a model whose
    only DequantizeLinear feeds a Gather (an INT4 embedding table, as `dsedge build` quantizes first under a gate)
    is still float where the quantizers work, and is compressed."""
    from onnx import TensorProto, helper

    from dsedge.runtime.errors import QuantizationError
    from dsedge.toolchain.quantize.compress import compress
    from dsedge.toolchain.quantize.weight_only import quantize_embedding_tables
    from tiny_models import embedding_onnx

    q = compress(mlp(), "int4-rtn").model
    with pytest.raises(QuantizationError, match=r"already quantized \(3 DequantizeLinear nodes") as e:
        compress(q, "int8-dynamic")
    assert e.value.hint
    nbits = helper.make_model(helper.make_graph(
        [helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], name="mm", domain="com.microsoft", K=64, N=8,
                          bits=4, block_size=32)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])]))
    with pytest.raises(QuantizationError, match=r"1 MatMulNBits node, e.g. 'mm'"):
        compress(nbits, "fp16")
    emb, tables = quantize_embedding_tables(onnx.load(str(embedding_onnx(tmp_path / "e.onnx"))))
    assert len(tables) == 1
    out = compress(emb, "int4-rtn").model
    assert sum(n.op_type == "DequantizeLinear" for n in out.graph.node) == 2      # the table's and the MatMul's


def test_quantize_in_place_replaces_the_model_only_once_the_new_one_is_complete(files, capsys, monkeypatch):
    """`-o MODEL` (the same file, or a path that resolves to it) is allowed and written atomically: the source is
    replaced only by a complete quantized model; a failure (a gate not met, a refused model, a write that dies
    half way) leaves it byte for byte as it was, with no temporary file beside it."""
    import hashlib

    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    model = files / "inplace.onnx"
    onnx.save(mlp(), str(model))
    before, size = digest(model), model.stat().st_size
    # a gate the FP16 model cannot meet: nothing written
    code, _, err = run_main(["quantize", model, "-o", model, "--precision", "fp16", "--heldout", files / "held",
                             "--accuracy-gate", "cosine:1"], capsys)
    assert code == 2 and "not met" in err and digest(model) == before
    # the write itself fails half way (a full disk): the source is intact
    real_save = onnx.save_model

    def dies_half_way(proto, f, *a, **kw):
        with open(f, "wb") as fh:
            fh.write(proto.SerializeToString()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", dies_half_way)
    code, _, err = run_main(["quantize", model, "-o", files / "." / model.name, "--precision", "int4", "--algorithm",
                             "rtn"], capsys)
    assert code != 0 and "Traceback" not in err and digest(model) == before, err
    monkeypatch.setattr(onnx, "save_model", real_save)
    # success: replaced by the INT4 model; the report still gives the source's size
    rep = files / "inplace.json"
    code, stdout, _ = run_main(["quantize", model, "-o", model, "--precision", "int4", "--algorithm", "rtn",
                                "--report", rep], capsys)
    assert code == 0 and "wrote" in stdout
    assert json.loads(rep.read_text())["source_size_bytes"] == size
    assert any(n.op_type == "DequantizeLinear" for n in onnx.load(str(model)).graph.node)
    # and a second in-place run is refused (already quantized): the INT4 model stays as it is
    after = digest(model)
    code, _, err = run_main(["quantize", model, "-o", model, "--precision", "int4", "--algorithm", "rtn"], capsys)
    assert code == 2 and "already quantized" in err and digest(model) == after
    assert not list(files.glob(".inplace.onnx.tmp-*"))


@pytest.mark.parametrize("preset", ["int4-rtn", "int8-dynamic", "fp16"])
def test_compress_refuses_an_fp16_model_naming_its_weights(preset):
    """Found in review: INT4 of an fp16 model wrote a graph ONNX Runtime cannot load (DequantizeLinear's fp32 output
    into an fp16 MatMul), and `fp16` of one said only "no float32 tensor". Refused before any work, naming what the
    weights are."""
    from onnx import numpy_helper

    from dsedge.runtime.errors import QuantizationError
    from dsedge.toolchain.quantize.compress import compress

    m = mlp()
    for t in m.graph.initializer:
        if len(t.dims) >= 2:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    with pytest.raises(QuantizationError, match=r"the model holds fp16 weights \(\d+ of \d+ float weight tensors") as e:
        compress(m, preset)
    assert "fp32 model" in e.value.hint


def test_quantize_int4_takes_the_word_embedding_table_too_as_build_does(tmp_path, capsys):
    """`dsedge quantize --precision int4` left the embedding table float, so the reference model came out at 61 % of
    its source where `dsedge build`'s int4 variant is 17 %: it now quantizes vocabulary Gather tables as build does
    (``--no-embeddings`` keeps them, ``--nodes`` picks layers only), gated or not, and the gate compares against the
    float source."""
    import onnxruntime as ort

    from tiny_models import embedding_onnx

    src = embedding_onnx(tmp_path / "e.onnx")
    rng = np.random.default_rng(3)
    for split in ("calib", "held"):
        (tmp_path / split).mkdir()
        np.savez(tmp_path / split / "0.npz", ids=rng.integers(0, 2048, (4, 8), dtype=np.int64))
    ids = rng.integers(0, 2048, (2, 5), dtype=np.int64)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]

    def quantized(name: str, *flags) -> tuple[list[str], dict]:
        out, rep = tmp_path / f"{name}.onnx", tmp_path / f"{name}.json"
        code, _, err = run_main(["quantize", src, "-o", out, "--algorithm", "rtn", "--report", rep, *flags], capsys)
        assert code == 0, err
        m = onnx.load(str(out))
        got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
        assert cosine(want, got) > 0.98
        feeds = {o: n.op_type for n in m.graph.node for i in n.input for o in [i]}
        dq_into = sorted(feeds[n.output[0]] for n in m.graph.node if n.op_type == "DequantizeLinear")
        return dq_into, json.loads(rep.read_text())

    dq, rep = quantized("both")
    assert dq == ["Gather", "MatMul"] and [t["name"] for t in rep["embeddings"]] == ["table"]
    assert rep["size_bytes"] < 0.25 * rep["source_size_bytes"]
    dq, rep = quantized("gated", "--calib", tmp_path / "calib", "--heldout", tmp_path / "held",
                        "--accuracy-gate", "cosine:0.9")
    assert dq == ["Gather", "MatMul"] and rep["value"] >= 0.9 and len(rep["embeddings"]) == 1
    assert quantized("kept", "--no-embeddings")[0] == ["MatMul"]
    assert quantized("picked", "--nodes", "proj")[0] == ["MatMul"]
    assert quantized("picked-too", "--nodes", "proj", "--embeddings")[0] == ["Gather", "MatMul"]
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "i8.onnx", "--precision", "int8", "--embeddings"],
                            capsys)
    assert code == 2 and "--embeddings applies to INT4 quantization" in err
    code, _, err = run_main(["quantize", src, "-o", tmp_path / "h.onnx", "--precision", "bf16", "--no-embeddings"],
                            capsys)  # the flag as given, and no converter registry key ("bf16 (bf16 float16)")
    assert code == 2 and "--no-embeddings applies to INT4 quantization, and this run is bf16 (bf16)" in err, err


def test_an_integer_table_a_gather_reads_is_not_an_embedding_to_quantize(tmp_path, capsys):
    """A vocabulary-sized INT32 table behind a Gather was quantized as if it were float: the INT4 model wrote a
    float DequantizeLinear where the graph takes integers and did not load (a user's pass)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table = rng.integers(-50, 50, (2048, 8)).astype(np.int32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"], name="ga", axis=0),
         helper.make_node("Cast", ["e"], ["f"], name="cast", to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["f", "w"], ["out"], name="proj")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4, 8])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "int.onnx"))
    code, _, err = run_main(["quantize", tmp_path / "int.onnx", "-o", tmp_path / "q.onnx", "--algorithm", "rtn"],
                            capsys)
    assert code == 0, err
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert np.array_equal(numpy_helper.to_array(next(t for t in q.graph.initializer if t.name == "table")), table)
    ids = rng.integers(0, 2048, (2, 4), dtype=np.int64)
    want = ort.InferenceSession(str(tmp_path / "int.onnx"), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    assert cosine(want[0], got[0]) > 0.98  # the MatMul is INT4; the table is untouched


def test_a_bf16_gate_runs_on_the_host_and_gate_output_is_checked(files, capsys):
    """A user's pass: a gated bf16 quantize could not measure (ORT CPU has no BF16 kernels), and the gate always
    measured the first output, with no way to pick another."""
    out = files / "q_bf16.onnx"
    name = mlp().graph.output[0].name
    code, stdout, err = run_main(["quantize", files / "mlp.onnx", "-o", out, "--precision", "bf16", "--heldout",
                                  files / "held", "--accuracy-gate", "cosine:0.999", "--gate-output", name, "--json"],
                                 capsys)
    assert code == 0, err
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["gate_values"]["cosine"] >= 0.999
    assert onnx.TensorProto.BFLOAT16 in {t.data_type for t in onnx.load(str(out)).graph.initializer}
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "never.onnx", "--precision", "bf16",
                             "--heldout", files / "held", "--accuracy-gate", "cosine:0.99", "--gate-output", "nope"],
                            capsys)
    assert code == 2 and f"--gate-output 'nope' is not an output of mlp.onnx" in err and f"outputs: {name}" in err
    code, _, err = run_main(["quantize", files / "mlp.onnx", "-o", files / "never.onnx", "--gate-output", name],
                            capsys)
    assert code == 2 and "no gate was given" in err
    assert not (files / "never.onnx").exists()


def test_int4_tables_are_symmetric_where_tensorrt_parses_them_and_the_recipe_flags_ones_it_cannot(tmp_path, capsys):
    """A helper's target pass: `dsedge build --target jetson --precision int4` wrote the word-embedding table as
    UINT4 with zero points, and TensorRT's ONNX parser refuses a DequantizeLinear with a UINT4 input or a non-zero
    zero point (TensorRT quantizes symmetrically), so trtexec could not parse the variant at all. `dsedge quantize`
    now writes tables as its weights (symmetric unless --asymmetric); build writes them symmetric for TensorRT
    targets (tests/test_quantize_reference.py checks the reference bundle); the recipe names a variant's
    unparsable DequantizeLinear nodes."""
    from dsedge.runtime.build_settings import engine_build_settings
    from dsedge.targets import get_target as load_target
    from dsedge.toolchain.stages.engine_recipe import _graph_facts
    from tiny_models import embedding_onnx

    src = embedding_onnx(tmp_path / "e.onnx")
    facts = {}
    for name, flags in (("sym", ()), ("asym", ("--asymmetric",))):
        out = tmp_path / f"{name}.onnx"
        code, _, err = run_main(["quantize", src, "-o", out, "--algorithm", "rtn", *flags], capsys)
        assert code == 0, err
        facts[name] = _graph_facts(out)
    assert facts["sym"]["dq_gather"] and facts["sym"]["dq_unparsable"] == []
    assert facts["asym"]["dq_gather"] and len(facts["asym"]["dq_unparsable"]) == 2  # the table's and the MatMul's
    assert _graph_facts(src) == {"ops": ["Gather", "MatMul"], "dq_gather": False, "dq_unparsable": [], "conv_spatial": 0, "int4_blocks": []}
    io = [{"name": "ids", "dtype": "int64", "shape": ["batch", "sequence"]}]
    ranges = {"batch": {"min": 1, "opt": 4, "max": 8}, "sequence": {"min": 1, "opt": 8, "max": 16}}

    def notes(name: str) -> str:
        v = {"name": "int4", "precision": "int4", "file": f"models/{name}.onnx", **facts[name]}
        return " | ".join(engine_build_settings(load_target("jetson"), v, io, ranges).notes)

    assert "parser refuses 2 DequantizeLinear" in notes("asym") and "parser refuses" not in notes("sym")
    assert "4-bit embedding" in notes("sym")
    no_table = {"name": "int4", "precision": "int4", "file": "models/e.onnx", **_graph_facts(src)}
    assert "4-bit embedding" not in " ".join(engine_build_settings(load_target("jetson"), no_table, io, ranges).notes)


@pytest.mark.parametrize("suffix", [".json", ".textproto"])
def test_quantize_to_an_output_named_like_another_onnx_format_reports_its_size(files, capsys, suffix):
    """A user's pass: `dsedge quantize M -o q.json` wrote a binary ONNX, then crashed (UnicodeDecodeError
    traceback, exit 1) re-reading it for the report: onnx picks its parser from the suffix."""
    out = files / f"q{suffix}"
    code, stdout, err = run_main(["quantize", files / "mlp.onnx", "-o", out, "--algorithm", "rtn", "--json"], capsys)
    assert code == 0 and "Traceback" not in err, err
    report = json.loads(stdout.splitlines()[-1])
    assert report["size_bytes"] == out.stat().st_size
    q = onnx.load(str(out), format="protobuf")  # what it always writes
    assert sum(n.op_type == "DequantizeLinear" for n in q.graph.node) == 3


def test_quantize_defaults_run_without_calibration_data_as_build_does(files, capsys):
    """A user's pass: the README's `dsedge quantize MODEL --output OUT` failed with its own defaults ("GPTQ needs
    calibration data"). The INT4 algorithm defaults to auto, as dsedge build: gptq with --calib, else rtn; the
    report says which ran, and an algorithm or preset named explicitly is kept."""
    out = files / "q_default.onnx"
    code, stdout, err = run_main(["quantize", files / "mlp.onnx", "--output", out, "--json"], capsys)
    assert code == 0 and json.loads(stdout.splitlines()[-1])["algorithm"] == "rtn", err
    code, stdout, err = run_main(["quantize", files / "mlp.onnx", "--output", out, "--calib", files / "calib",
                                  "--block-size", 16, "--json"], capsys)
    assert code == 0 and json.loads(stdout.splitlines()[-1])["algorithm"] == "gptq", err
    for explicit in (["--algorithm", "gptq"], ["--preset", "int4-gptq"]):
        code, _, err = run_main(["quantize", files / "mlp.onnx", "--output", out, *explicit], capsys)
        assert code == 2 and "GPTQ needs calibration data" in err, (explicit, err)
    code, stdout, _ = run_main(["quantize", "--help"], capsys)
    assert code == 0 and "auto = gptq with --calib data, else rtn" in " ".join(stdout.split())


def test_int8_refuses_asymmetric_and_calibration_the_model_cannot_run_is_one_line(tmp_path, capsys):
    """A helper's pass with user models: `--asymmetric` with --precision int8 was accepted and ignored (INT8's
    quantizers write symmetric weights), and INT8 static calibration on token ids past the vocabulary ended in an
    ONNX Runtime InvalidArgument traceback (INT4 with the same data gave one line). Both are now one-line errors,
    exit 2, nothing written."""
    from tiny_models import embedding_onnx

    src = embedding_onnx(tmp_path / "e.onnx")
    out = tmp_path / "q.onnx"
    code, _, err = run_main(["quantize", src, "-o", out, "--precision", "int8", "--asymmetric"], capsys)
    assert code == 2 and err.startswith("error: --asymmetric applies to INT4 quantization") and not out.exists()
    (tmp_path / "oob").mkdir()
    np.savez(tmp_path / "oob" / "0.npz", ids=np.full((2, 4), 10**6, np.int64))  # past the 2048-row table
    code, _, err = run_main(["quantize", src, "-o", out, "--precision", "int8", "--calib", tmp_path / "oob"], capsys)
    assert code == 2 and "Traceback" not in err and not out.exists()
    assert err.splitlines()[0].startswith("error: INT8 calibration failed:") and "vocabulary" in err
