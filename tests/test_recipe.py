"""build/trtexec.sh per target: flags checked against each TensorRT version's trtexec, and the script run by bash."""
from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from dsedge.runtime.build_settings import engine_build_settings
from dsedge.runtime.errors import TargetError
from dsedge.targets import get_target, list_targets, load_profile
from dsedge.toolchain.recipe import TRTEXEC_FLAGS, recipe_notes, trtexec_script

INPUTS = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
          {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]}]
RANGES = {"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {"min": 1, "opt": 128, "max": 256}}
TRANSFORMER_OPS = ["Gather", "MatMul", "Add", "LayerNormalization", "Softmax", "Erf", "DequantizeLinear"]
CNN_OPS = ["Conv", "Relu", "MaxPool", "Add", "GlobalAveragePool", "QuantizeLinear", "DequantizeLinear", "Gemm"]


def variants(*precisions):
    return [{"name": p, "precision": p, "file": f"models/{p}.onnx"} for p in precisions]


def commands(script: str) -> list[dict[str, str]]:
    """Each trtexec command in the script as {flag: value}."""
    joined = script.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        if line.startswith('"$TRTEXEC"'):
            out.append({a[2:].split("=", 1)[0]: (a.split("=", 1)[1] if "=" in a else "") for a in shlex.split(line)[1:]})
    return out


def trt_profile(tmp_path: Path, version: str, name: str = "future") -> Path:
    text = Path(get_target("a100").source).read_text()
    text = text.replace('name = "a100"', f'name = "{name}"').replace('aliases = ["a100-sxm", "a100-pcie"]', "aliases = []")
    text = text.replace('tensorrt = { version = "10.15", min = "10.0" }', f'tensorrt = {{ version = "{version}" }}')
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


def test_every_tensorrt_target_gets_only_flags_its_trtexec_has():
    for t in list_targets():
        precisions = [p for p in ("int4", "int8", "fp16", "bf16", "fp32") if t.supports(p)]
        script = trtexec_script(t, variants(*precisions), INPUTS, RANGES)
        if t.backend != "tensorrt":
            assert "exit 0" in script and "$TRTEXEC" not in script
            continue
        cmds = commands(script)
        assert len(cmds) == len(precisions), t.name
        allowed = TRTEXEC_FLAGS[10 if t.trt_version[0] == 10 else 8]
        for c in cmds:
            assert set(c) <= allowed, (t.name, set(c) - allowed)
            assert c["memPoolSize"] == f"workspace:{t.workspace_mb}"
            assert c["timingCacheFile"] == "build/timing.cache"
            assert c["optShapes"] == "input_ids:8x128,attention_mask:8x128"
            assert c["maxShapes"] == "input_ids:32x256,attention_mask:32x256"


def test_xavier_trt85_spelling_and_refusals():
    t = get_target("jetson-xavier")
    cmds = commands(trtexec_script(t, variants("int8", "fp16", "fp32"), INPUTS, RANGES))
    int8, fp16, fp32 = cmds
    assert "int8" in int8 and "fp16" in int8 and "buildOnly" in int8
    assert "fp16" in fp16 and "stronglyTyped" not in fp16 and "fp16" not in fp32
    assert not any({"skipInference", "stronglyTyped", "bf16", "workspace", "versionCompatible"} & set(c) for c in cmds)
    for p in ("int4", "bf16"):
        with pytest.raises(TargetError, match="8.5"):
            trtexec_script(t, variants(p), INPUTS, RANGES)


def test_orin_trt10_precisions():
    cmds = commands(trtexec_script(get_target("jetson"), variants("int4", "int8", "fp16", "bf16", "fp32"), INPUTS, RANGES))
    by = {c["onnx"]: c for c in cmds}
    assert {"fp16", "skipInference"} <= set(by["models/int4.onnx"]) and "int8" not in by["models/int4.onnx"]
    assert {"int8", "fp16"} <= set(by["models/int8.onnx"])
    assert "stronglyTyped" in by["models/fp16.onnx"] and "fp16" not in by["models/fp16.onnx"]
    assert "stronglyTyped" in by["models/bf16.onnx"]
    assert not ({"fp16", "int8", "stronglyTyped"} & set(by["models/fp32.onnx"]))
    # a jetson engine is tied to its GPU: no hardware-compatibility flag
    assert not any("hardwareCompatibilityLevel" in c for c in cmds)


def test_int4_recipe_explains_the_4bit_embedding():
    script = trtexec_script(get_target("a100"), variants("int4"), INPUTS, RANGES)
    assert "Gather" in script and "W4A16" in script and "dequantized" in script


def test_a100_hardware_and_version_compatibility_and_sparsity():
    v = variants("int8") + [{"name": "sparse", "precision": "int8", "file": "models/sparse.onnx", "sparsity": "2:4"}]
    dense, sparse = commands(trtexec_script(get_target("a100"), v, INPUTS, RANGES))
    assert dense["hardwareCompatibilityLevel"] == "ampere+" and "versionCompatible" in dense
    assert "sparsity" not in dense and sparse["sparsity"] == "enable"
    (t4,) = commands(trtexec_script(get_target("t4"), v[1:], INPUTS, RANGES))
    assert "sparsity" not in t4  # Turing has no 2:4 sparse tensor cores


def test_trt11_has_no_precision_flags(tmp_path):
    t = load_profile(trt_profile(tmp_path, "11.4"))
    cmds = commands(trtexec_script(t, variants("int8", "fp16", "int4"), INPUTS, RANGES))
    for c in cmds:
        assert not ({"fp16", "int8", "bf16", "int4", "fp8", "best", "stronglyTyped"} & set(c))
        assert set(c) <= TRTEXEC_FLAGS[11]
    assert "strongly typed networks only" in trtexec_script(t, variants("fp16"), INPUTS, RANGES)


def test_dla_static_shapes_for_a_cnn_and_gpu_for_a_transformer():
    t = get_target("jetson-orin")
    cnn = [{"name": "int8", "precision": "int8", "file": "models/int8.onnx", "ops": CNN_OPS}]
    (c,) = commands(trtexec_script(t, cnn, INPUTS, RANGES, dla_core=1))
    assert c["useDLACore"] == "1" and "allowGPUFallback" in c and {"int8", "fp16"} <= set(c)
    assert c["minShapes"] == c["optShapes"] == c["maxShapes"] == "input_ids:8x128,attention_mask:8x128"
    script = trtexec_script(t, cnn, INPUTS, RANGES, dla_core=1)
    assert "fall back to the GPU: Gemm" in script
    # a helper's target pass: the recipe's DLA engine is not what dsedge.load builds on the device; said in the
    # script and in report.json's notes, only where the recipe builds for DLA
    assert "runtime does not run DLA engines yet" in script
    assert any("runtime does not run DLA" in n for n in recipe_notes(t, cnn, INPUTS, RANGES, dla_core=1)["int8"])
    bert = [{"name": "int8", "precision": "int8", "file": "models/int8.onnx", "ops": TRANSFORMER_OPS}]
    script = trtexec_script(t, bert, INPUTS, RANGES, dla_core=0)
    (c,) = commands(script)
    assert "useDLACore" not in c and c["maxShapes"] == "input_ids:32x256,attention_mask:32x256"
    assert "cannot run on DLA" in script and "MatMul" in script and "runtime does not run DLA" not in script
    (c,) = commands(trtexec_script(t, variants("int4"), INPUTS, RANGES, dla_core=0))
    assert "useDLACore" not in c  # DLA is INT8/FP16 only


@pytest.mark.parametrize("target, core, words", [("t4", 0, "no DLA"), ("jetson-orin", 2, "does not exist")])
def test_bad_dla_requests(target, core, words):
    with pytest.raises(TargetError, match=words):
        trtexec_script(get_target(target), variants("int8"), INPUTS, RANGES, dla_core=core)


def test_dynamic_dim_without_range_is_an_error_and_target_shapes_fill_gaps():
    with pytest.raises(TargetError, match="frames"):
        trtexec_script(get_target("t4"), variants("fp16"), [{"name": "x", "dtype": "float32", "shape": ["frames", 3]}], {})
    s = engine_build_settings(get_target("t4"), variants("fp16")[0], INPUTS, {})
    assert s.shapes["input_ids"] == ((1, 1), (8, 128), (64, 512))  # from the t4 profile
    x = [{"name": "x", "dtype": "float32", "shape": ["frames", 3]}]
    with pytest.raises(TargetError, match="range for 'frames' must give integer min, opt and max"):  # was KeyError
        trtexec_script(get_target("t4"), variants("fp16"), x, {"frames": {"min": 1, "max": 8}})


def test_script_runs_under_bash_and_passes_exact_args(tmp_path):
    bundle = tmp_path / "m-jetson-orin.dse"
    (bundle / "build").mkdir(parents=True)
    script = trtexec_script(get_target("jetson"), variants("int4", "int8"), INPUTS, RANGES)
    (bundle / "build" / "trtexec.sh").write_text(script)
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake-trtexec"  # stands in for NVIDIA's trtexec binary, which cannot exist here
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$PWD" "$@" "--" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    r = subprocess.run(["bash", str(bundle / "build" / "trtexec.sh")], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "TRTEXEC": str(fake)}, timeout=30)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().split("--\n")[:-1]
    assert len(calls) == 2
    first = calls[0].splitlines()
    assert first[0] == str(bundle)  # ran from the bundle root
    assert first[1:4] == ["--onnx=models/int4.onnx", "--saveEngine=engines/int4.plan",
                          "--minShapes=input_ids:1x1,attention_mask:1x1"]
    assert (bundle / "engines").is_dir()


def test_recipe_notes_for_the_report():
    from dsedge.toolchain.recipe import recipe_notes

    notes = recipe_notes(get_target("t4"), variants("int8", "fp16"), INPUTS, RANGES)
    assert "explicit quantization" in notes["int8"][0] and "strongly typed" in notes["fp16"][0]
    assert recipe_notes(get_target("cpu"), variants("int8"), INPUTS, RANGES) == {}


def test_weak_typing_on_tensorrt_10_12_and_later_says_it_is_deprecated():
    """Found by review: the t4/a100/h100 profiles ship TensorRT 10.15, whose weak typing (--int8/--fp16 builder
    flags) is deprecated since 10.12 (release notes: 'Weak typing APIs deprecated') and gone in 11.x; the recipe
    used it for int8/int4 without a word, while trtexec prints deprecation warnings on every build."""
    from dsedge.toolchain.recipe import recipe_notes

    notes = recipe_notes(get_target("t4"), variants("int8", "fp16"), INPUTS, RANGES)
    assert any("deprecated since TensorRT 10.12" in n and "--int8 --fp16" in n for n in notes["int8"])
    assert not any("deprecated" in n for n in notes["fp16"])  # strongly typed: nothing to say
    script = trtexec_script(get_target("a100"), variants("int4"), INPUTS, RANGES)
    assert "weak typing (--fp16) is deprecated since TensorRT 10.12" in script
    for t in ("jetson-orin", "jetson-xavier"):  # 10.3 / 8.5: weak typing is current there
        assert not any("deprecated" in n for ns in recipe_notes(get_target(t), variants("int8"), INPUTS, RANGES).values()
                       for n in ns)


def test_xavier_recipe_says_trt85_cannot_parse_layer_normalization():
    """Found by review: Xavier bundles of a transformer are written at opset 17 with ONNX LayerNormalization nodes,
    which TensorRT 8.5's ONNX parser cannot import (onnx-tensorrt release/8.5-GA operators.md: 'LayerNormalization
    | N'; the importer came with 8.6): build/trtexec.sh failed at parse time with no word of why in the recipe."""
    bert = [{"name": "int8", "precision": "int8", "file": "models/int8.onnx",
             "ops": TRANSFORMER_OPS + ["LayerNormalization"]}]
    script = trtexec_script(get_target("jetson-xavier"), bert, INPUTS, RANGES)
    assert "TensorRT 8.5's ONNX parser has no importer for LayerNormalization (added in 8.6)" in script
    for t in ("jetson-orin", "t4"):
        assert "no importer" not in trtexec_script(get_target(t), bert, INPUTS, RANGES)
    assert "no importer" not in trtexec_script(get_target("jetson-xavier"),
                                               [{**bert[0], "ops": CNN_OPS}], INPUTS, RANGES)


def test_int4_note_says_w4a16_only_where_the_fp16_flag_makes_it_so(tmp_path):
    """Found by review: the recipe told TensorRT 11.x users (strongly typed only, no --fp16) that their INT4 variant
    runs 'W4A16 … with FP16 activations', while dsedge's int4 ONNX has FP32 activations and scales, which a strongly
    typed network keeps: the GEMMs run at FP32 activations there."""
    t11 = load_profile(trt_profile(tmp_path, "11.4"))
    script = trtexec_script(t11, variants("int4"), INPUTS, RANGES)
    assert "W4A16" not in script.replace("not W4A16", "").replace("for W4A16", "")
    assert "FP32 with FP32 scales" in script
    typed = [{**variants("int4")[0], "strongly_typed": True}]  # a 10.x build asked for strong typing
    assert "FP32 with FP32 scales" in trtexec_script(get_target("jetson"), typed, INPUTS, RANGES)
    orin = trtexec_script(get_target("jetson"), variants("int4"), INPUTS, RANGES)  # weak typing, --fp16: W4A16
    assert "W4A16" in orin and "FP32 with FP32 scales" not in orin


def test_version_compatible_recipe_says_the_loader_must_allow_host_code():
    """Found by review: a100/h100 recipes (and the Triton export's build_engine.sh, built from the same settings) make
    --versionCompatible plans, which embed the lean runtime; TensorRT and Triton refuse them unless told to allow
    engine host code (Triton: --backend-config=tensorrt,version-compatible=true). Nothing said so."""
    script = trtexec_script(get_target("a100"), variants("fp16"), INPUTS, RANGES)
    assert "--versionCompatible" in script and "engine_host_code_allowed" in script
    assert "version-compatible=true" in script
    for t in ("t4", "jetson-orin", "jetson-xavier"):  # not version-compatible: nothing to allow
        assert "engine_host_code_allowed" not in trtexec_script(get_target(t), variants("fp16"), INPUTS, RANGES)


def test_dla_is_not_claimed_for_3d_convolutions(tmp_path):
    """A helper's target pass: a Conv3d model (the CT sample's U-Net is one) got "DLA core 0 with GPU fallback" with
    no blockers, though DLA's convolution is 2-D only: the whole model would fall back to the GPU while pinned to a
    fixed batch. The recipe reads the convolution rank from the graph (through a DequantizeLinear) and builds for
    the GPU, saying why."""
    from onnx import TensorProto, helper, numpy_helper

    from dsedge.toolchain.stages.engine_recipe import _graph_facts

    def conv(n_spatial: int, qdq: bool) -> dict:
        w = numpy_helper.from_array(np.ones([4, 1] + [3] * n_spatial, np.int8 if qdq else np.float32), "w")
        nodes, inits, wname = [], [w], "w"
        if qdq:
            inits.append(numpy_helper.from_array(np.array(0.1, np.float32), "ws"))
            nodes.append(helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"]))
            wname = "wd"
        nodes.append(helper.make_node("Conv", ["x", wname], ["y"]))
        shape = [1, 1] + [8] * n_spatial
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        path = tmp_path / f"c{n_spatial}{qdq}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return {"name": "int8", "precision": "int8", "file": "models/int8.onnx", **_graph_facts(path)}

    t = get_target("jetson-orin")
    for qdq in (False, True):
        flat, vol = conv(2, qdq), conv(3, qdq)
        assert (flat["conv_spatial"], vol["conv_spatial"]) == (2, 3)
        (c,) = commands(trtexec_script(t, [flat], INPUTS, RANGES, dla_core=0))
        assert c["useDLACore"] == "0"
        script = trtexec_script(t, [vol], INPUTS, RANGES, dla_core=0)
        (c,) = commands(script)
        assert "useDLACore" not in c and "2-D convolutions only" in script


def test_int4_blocks_and_quantized_biases_tensorrt_refuses_are_named(tmp_path):
    """A helper's pass with user models: TensorRT's INT4 takes per-block scales with blocks of 64 or 128 only, and
    its parser refuses an INT32 DequantizeLinear (a bias ORT's QDQ quantizer quantized); the recipe reads both
    from the graph and says so."""
    from onnx import TensorProto, helper, numpy_helper

    from dsedge.toolchain.stages.engine_recipe import _graph_facts

    nodes = [helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"], axis=0, block_size=32),
             helper.make_node("DequantizeLinear", ["b", "bs"], ["bd"]),
             helper.make_node("MatMul", ["x", "wd"], ["m"]), helper.make_node("Add", ["m", "bd"], ["y"])]
    inits = [numpy_helper.from_array(np.zeros((64, 4), np.int8), "w"), numpy_helper.from_array(np.ones((2, 4),
             np.float32), "ws"), numpy_helper.from_array(np.zeros(4, np.int32), "b"),
             numpy_helper.from_array(np.array(0.1, np.float32), "bs")]
    inits[0] = helper.make_tensor("w", TensorProto.INT4, [64, 4], np.zeros(64 * 4, np.int8).tolist())
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    facts = _graph_facts(path)
    assert facts["int4_blocks"] == [32] and len(facts["dq_unparsable"]) == 1  # the INT32 bias
    v = {"name": "int4", "precision": "int4", "file": "models/int4.onnx", **facts}
    notes = " | ".join(engine_build_settings(get_target("jetson-orin"), v, INPUTS, RANGES).notes)
    assert "blocks of 64 or 128 only" in notes and "blocks of 32" in notes and "UINT4 or INT32" in notes
    ok = {**v, "int4_blocks": [64], "dq_unparsable": []}
    notes = " | ".join(engine_build_settings(get_target("jetson-orin"), ok, INPUTS, RANGES).notes)
    assert "64 or 128 only" not in notes and "parser refuses" not in notes
