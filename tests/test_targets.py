"""Target profiles, the `dsedge targets` command, precision choice and opset conversion (all real, no fakes)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from dsedge.cli import cli
from dsedge.runtime.errors import PrecisionNotSupported, TargetError
from dsedge.targets import get_target, list_targets, load_profile
from dsedge.toolchain.opset import convert_for_target, model_opset, uses_int4
from dsedge.toolchain.target_precision import choose_precision

SIX = {"jetson-orin", "jetson-xavier", "t4", "a100", "cpu", "h100"}


# ---- profiles ---------------------------------------------------------------------------------------------------
def test_all_six_profiles_load_with_the_documented_facts():
    ts = {t.name: t for t in list_targets()}
    assert SIX <= set(ts)
    assert get_target("jetson").name == "jetson-orin"
    orin, xav, t4, a100, h100 = (ts[n] for n in ("jetson-orin", "jetson-xavier", "t4", "a100", "h100"))
    assert (orin.sm, xav.sm, t4.sm, a100.sm, h100.sm) == ("sm87", "sm72", "sm75", "sm80", "sm90")
    # INT4 W4A16 only on Ampere and later; no BF16/INT4 on T4 or Xavier.
    assert orin.supports("int4") and a100.supports("int4") and h100.supports("int4")
    for t in (t4, xav):
        assert not t.supports("int4") and not t.supports("bf16")
    # No FP8 on the four deployment targets, FP8 on the lab H100.
    assert all("fp8" not in t.engine_flags for t in (orin, xav, t4, a100)) and "fp8" in h100.engine_flags
    assert "sparsity" in a100.engine_flags and "sparsity" in orin.engine_flags and "sparsity" not in t4.engine_flags
    assert (orin.dla_cores, xav.dla_cores, t4.dla_cores, a100.dla_cores) == (2, 2, 0, 0)
    # Software stacks: Xavier = JetPack 5.1 / TRT 8.5 / opset <= 17; Orin = TRT >= 10.3 (INT4 needs opset 21).
    assert xav.trt_version == (8, 5) and xav.opset["max"] == 17
    assert orin.trt_version >= (10, 3) and orin.opset["max"] >= 21
    assert all(t.trt_version[0] == 10 for t in (t4, a100, h100))
    assert ts["cpu"].backend == "onnxruntime" and ts["cpu"].trt_version is None
    for t in ts.values():
        assert t.precision_order and set(t.precision_order) <= set(t.precisions)
        assert t.default_budget_ms > 0


def test_user_profile_by_path_and_by_directory(tmp_path, monkeypatch):
    text = (get_target("t4").source and open(get_target("t4").source).read()).replace('name = "t4"', 'name = "my-t4"')
    text = text.replace('aliases = ["tesla-t4"]', 'aliases = ["mine"]')
    p = tmp_path / "my-device.toml"
    p.write_text(text)
    assert get_target(str(p)).name == "my-t4"
    monkeypatch.setenv("DSEDGE_TARGETS_DIR", str(tmp_path))
    assert get_target("mine").name == "my-t4"
    assert "my-t4" in {t.name for t in list_targets()}
    assert get_target("t4").name == "t4"  # a name beats an alias
    (tmp_path / "copy.toml").write_text(text.replace('name = "my-t4"', 'name = "copy"'))
    with pytest.raises(TargetError, match="claimed by"):
        get_target("mine")


def test_a_user_profile_named_like_a_builtin_in_another_file_overrides_it_once(tmp_path, monkeypatch, caplog):
    """Found by a user: name = "t4" in my-t4.toml listed two targets called t4, and `t4` resolved to the built-in."""
    import logging

    text = open(get_target("t4").source).read().replace('workspace_mb', '# edited\nworkspace_mb', 1)
    (tmp_path / "my-t4.toml").write_text(text)
    monkeypatch.setenv("DSEDGE_TARGETS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="dsedge"):
        listed = [t for t in list_targets() if t.name == "t4"]
    assert len(listed) == 1 and listed[0].source == str(tmp_path / "my-t4.toml")
    assert get_target("t4").source == str(tmp_path / "my-t4.toml")
    assert "overrides" in caplog.text and "my-t4.toml" in caplog.text


def test_a_user_alias_that_is_a_builtin_name_or_alias_is_dropped_with_a_warning(tmp_path, monkeypatch, caplog):
    """Found by a user: aliases = ["t4"] listed the profile as `mycpu (t4)`, and `t4` still meant the built-in
    (a name beats an alias); claiming `jetson` broke the built-in alias ("claimed by" both). The clashing aliases go,
    with a warning naming the file; the profile and its other aliases stay."""
    import logging

    text = open(get_target("cpu").source).read().replace('name = "cpu"', 'name = "mycpu"')
    text = text.replace('aliases = ["x86", "host"]', 'aliases = ["t4", "jetson", "mine"]')
    (tmp_path / "mycpu.toml").write_text(text)
    (tmp_path / "other.toml").write_text(text.replace('name = "mycpu"', 'name = "other"')
                                         .replace('"t4", "jetson", "mine"', '"mycpu"'))  # another user's name
    monkeypatch.setenv("DSEDGE_TARGETS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="dsedge"):
        ts = {t.name: t for t in list_targets()}
    assert ts["mycpu"].aliases == ("mine",) and ts["other"].aliases == () and ts["t4"].aliases == ("tesla-t4",)
    assert f"target profile {tmp_path / 'mycpu.toml'}: dropping alias 't4', it is the name of target t4" in caplog.text
    assert "dropping alias 'jetson', it is an alias of the built-in target jetson-orin" in caplog.text
    assert f"{tmp_path / 'other.toml'}: dropping alias 'mycpu', it is the name of target mycpu" in caplog.text
    assert (get_target("t4").name, get_target("jetson").name, get_target("mine").name) == ("t4", "jetson-orin",
                                                                                          "mycpu")
    r = CliRunner().invoke(cli, ["targets"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "mycpu (mine)" in r.output and "(t4" not in r.output, r.output


@pytest.mark.parametrize("body, words", [
    ('name = "x"\nprecisions = ["int3"]\n', "int3"),
    ('name = "x"\nbogus = 1\n', "bogus"),
    ('name = "x"\ndla_cores = -1\n', "dla_cores"),
    ('name = "x"\nbackend = "tensorrt"\n', "compute_capability"),
    ('name = "x"\nbackend = "tensorrt"\ncompute_capability = "8.7"\n', "tensorrt"),
    ('name = "x"\nopset = { min = 18, max = 17 }\n', "opset"),
    ('name = "x"\nshapes = { batch = { min = 4, opt = 2, max = 8 } }\n', "batch"),
    ('name = "x"\nengine_flags = ["fp4"]\n', "fp4"),
    ('name = "x"\nprecisions = [\n', "TOML"),
])
def test_malformed_profiles_fail_with_one_line_naming_the_key(tmp_path, body, words):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(TargetError) as e:
        load_profile(p)
    assert words in str(e.value) and "\n" not in str(e.value) and e.value.hint


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(TargetError) as e:
        get_target("jetson-nano-2gb")
    assert "jetson-orin" in e.value.hint and "t4" in e.value.hint


def test_targets_command_lists_all_six_and_shows_one():
    r = CliRunner().invoke(cli, ["targets", "--json"])
    assert r.exit_code == 0, r.output
    assert SIX <= {t["name"] for t in json.loads(r.output)}
    r = CliRunner().invoke(cli, ["targets"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and all(n in r.output for n in SIX)
    r = CliRunner().invoke(cli, ["targets", "jetson", "--json"])
    assert json.loads(r.output)["compute_capability"] == "8.7"
    r = CliRunner().invoke(cli, ["targets", "xavier"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "8.5" in r.output and "13–17" in r.output


def test_targets_with_an_empty_name_is_a_usage_error_not_the_list():
    """Found by a user: `dsedge targets ""` (an unset shell variable) printed every target as if NAME were left out."""
    for name in ("", "  "):
        r = CliRunner().invoke(cli, ["targets", name, "--json"])
        assert r.exit_code == 2 and "NAME is empty" in r.output and r.output.lstrip()[:1] != "[", r.output


def test_profile_text_that_looks_like_markup_is_shown_not_parsed(tmp_path, monkeypatch):
    """Found by a user: a description or note with `[/...]` in it (`dsedge targets ./dev.toml`) crashed the table
    with a rich MarkupError traceback; `[bold]` was silently eaten. Profile text is printed as written."""
    p = tmp_path / "dev[1].toml"
    p.write_text('name = "dev"\ndescription = "rack [/b] 2"\nnotes = ["[bold]raw[/bold] text", "x [/red]"]\n')
    r = CliRunner().invoke(cli, ["targets", str(p)], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "rack [/b] 2" in r.output and "[bold]raw[/bold] text" in r.output and "dev[1].toml" in r.output
    monkeypatch.setenv("DSEDGE_TARGETS_DIR", str(tmp_path))
    r = CliRunner().invoke(cli, ["targets"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and r.exception is None and "dev" in r.output, r.output


# ---- precision choice -------------------------------------------------------------------------------------------
def test_auto_picks_the_targets_first_preference():
    assert choose_precision(get_target("jetson"), "auto", False)[0] == "int4"
    assert choose_precision(get_target("t4"), "auto", False)[0] == "int8"
    p, notes = choose_precision(get_target("cpu"), "auto", False)
    assert p == "int8" and "auto" in notes[0]


def test_unsupported_precision_fails_naming_the_targets_precisions():
    with pytest.raises(PrecisionNotSupported) as e:
        choose_precision(get_target("t4"), "int4", fallback=False)
    assert "t4" in str(e.value) and "int8, fp16, fp32" in str(e.value) and "--fallback" in e.value.hint


def test_fallback_steps_down_and_says_so():
    assert choose_precision(get_target("t4"), "int4", True) == (
        "int8", ["int4 is not supported on t4 (supports: int8, fp16, fp32); fell back to int8 (--fallback)"])
    assert choose_precision(get_target("xavier"), "bf16", True)[0] == "fp16"
    assert choose_precision(get_target("cpu"), "fp16", True)[0] == "fp32"
    assert choose_precision(get_target("a100"), "bf16", True) == ("bf16", [])


@pytest.mark.parametrize("bad", ["tf32", "fp8", "int3"])
def test_engine_modes_and_unknown_names_are_not_precisions(bad):
    with pytest.raises(PrecisionNotSupported):
        choose_precision(get_target("h100"), bad, True)


# ---- opset conversion -------------------------------------------------------------------------------------------
def _matmul_model(opset: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("ReduceSum", ["m"], ["y"], keepdims=1)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _int4_model() -> onnx.ModelProto:
    q = helper.make_tensor("wq", TensorProto.INT4, [4, 3], np.array([1, -2, 3, 4, -5, 6, 7, -8, 0, 1, 2, 3]))
    s = numpy_helper.from_array(np.full((2, 3), 0.1, np.float32), "ws")
    g = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=2),
         helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [q, s])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_xavier_gets_opset_17_and_ir_8_with_the_same_outputs():
    m = _matmul_model(18)  # ReduceSum's axes moved to an input at 13; 18 changed other reductions
    out = convert_for_target(m, get_target("jetson-xavier"))
    assert model_opset(out) == 17 and out.ir_version == 8
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(m, x), rtol=1e-6)
    assert model_opset(m) == 18  # input untouched


def test_opset_inside_the_range_is_kept_and_old_opsets_are_raised():
    assert model_opset(convert_for_target(_matmul_model(18), get_target("t4"))) == 18
    up = convert_for_target(_matmul_model(11), get_target("t4"))
    assert model_opset(up) == 13 and up.ir_version == 7


def test_int4_stays_at_21_with_ir_10_and_is_refused_for_xavier():
    m = _int4_model()
    assert uses_int4(m)
    out = convert_for_target(m, get_target("jetson-orin"))
    assert model_opset(out) == 21 and out.ir_version == 10
    with pytest.raises(TargetError) as e:
        convert_for_target(m, get_target("jetson-xavier"))
    assert "opset 21" in str(e.value) and "≤ 17" in str(e.value) and "int8" in e.value.hint


def test_contrib_ops_are_refused_for_tensorrt_but_fine_for_cpu():
    m = _matmul_model(21)
    m.graph.node[0].domain = "com.microsoft"
    m.graph.node[0].op_type = "MatMulNBits"
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(TargetError, match="MatMulNBits"):
        convert_for_target(m, get_target("a100"))
    assert model_opset(convert_for_target(_matmul_model(21), get_target("cpu"))) == 21


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_lowered_so_a_transformer_reaches_opset_17(approximate):
    g = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], name="act", approximate=approximate)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    out = convert_for_target(m, get_target("jetson-xavier"))  # Gelu has no version before 20
    assert model_opset(out) == 17 and "Gelu" not in {n.op_type for n in out.graph.node}
    x = np.linspace(-4, 4, 24, dtype=np.float32).reshape(3, 8)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT would fuse the Erf form back
    ref = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, atol=2e-6)
    assert model_opset(convert_for_target(m, get_target("t4"))) == 21  # kept where the opset fits


@pytest.mark.parametrize("axis, bias", [(-1, True), (1, False)])
def test_layernorm_is_lowered_for_tensorrt_8_5_and_kept_where_the_parser_has_it(axis, bias):
    """A helper's target pass: Xavier bundles (TensorRT 8.5) kept ONNX LayerNormalization, which 8.5's ONNX parser
    has no importer for (added in 8.6), so trtexec failed at parse on every transformer built for the Xavier.
    It is now lowered to ReduceMean/Sub/Mul/Add/Sqrt/Div there, with the same outputs; kept for TensorRT ≥ 8.6."""
    rng = np.random.default_rng(0)
    init = [numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "scale")]
    ins = ["x", "scale"]
    if bias:
        init.append(numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "bias"))
        ins.append("bias")
    ln = helper.make_node("LayerNormalization", ins, ["y"], name="ln", axis=axis, epsilon=1e-3)
    g = helper.make_graph([ln], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], init)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    out = convert_for_target(m, get_target("jetson-xavier"))
    assert model_opset(out) == 17 and "LayerNormalization" not in {n.op_type for n in out.graph.node}
    x = rng.normal(size=(3, 8)).astype(np.float32) * 4 + 2
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT would fuse it back
    ref = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, atol=2e-6)
    for kept in ("jetson-orin", "t4"):  # TensorRT 10.x parses LayerNormalization
        assert "LayerNormalization" in {n.op_type for n in convert_for_target(m, get_target(kept)).graph.node}


def test_a_dynamo_global_average_pool_converts_down_to_xavier_opset():
    """A user's pass: torch's dynamo exporter writes ReduceMean(x, axes) with noop_with_empty_axes=0 (opset 18's
    form); onnx.version_converter put axes back as an attribute for opset 17 but kept noop_with_empty_axes, so every
    precision of a ResNet-style CNN failed for jetson-xavier ("Unrecognized attribute: noop_with_empty_axes"). The
    attribute is dropped below 18 (and a noop ReduceMean with no axes is the identity)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["pooled"], keepdims=1, noop_with_empty_axes=0),
             helper.make_node("ReduceMax", ["x"], ["same"], keepdims=1, noop_with_empty_axes=1),
             helper.make_node("Add", ["pooled", "same"], ["y"])]
    g = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 4])],
                          [numpy_helper.from_array(np.array([-1, -2], np.int64), "axes")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    out = convert_for_target(model, get_target("jetson-xavier"))
    assert model_opset(out) == 17
    ops = {n.op_type: {a.name for a in n.attribute} for n in out.graph.node}
    assert ops["ReduceMean"] == {"axes", "keepdims"} and "ReduceMax" not in ops and "Identity" in ops
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(out), x.mean(axis=(-1, -2), keepdims=True) + x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run(out), run(model), rtol=1e-6, atol=1e-6)
