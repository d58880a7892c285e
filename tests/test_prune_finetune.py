"""Torch-side pruning (FFN channels, 2:4) with a distillation fine-tune, and `dsedge build --prune / --qat-steps`
(real torch, real ORT, tiny models built here)."""
from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from dsedge.runtime.errors import ConfigError, SourceError, TargetError
from dsedge.toolchain.student import parse_prune
from dsedge.toolchain.finetune import distill_finetune, heldout_metrics
from dsedge.toolchain.pipeline import BuildOptions, build
from dsedge.toolchain.prune_torch import candidate_pairs, mask_2_4, prune_ffn_channels
from dsedge.toolchain.qat import fake_quant_weight
from tiny_models import mlp_onnx

NET = '''
import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm-free transformer FFN: h + fc2(gelu(fc1(h))) → LayerNorm."""

    def __init__(self, d=32, hidden=128):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, h):
        return self.norm(h + self.ffn(h))


class Mixer(nn.Module):
    """fc1/fc2 by name, but a softmax over channels between them: not channel-wise."""

    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, h):
        return h + self.fc2(torch.softmax(self.fc1(h), -1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(), Mixer(), Block())
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def make():
    torch.manual_seed(0)
    return Net().eval(), {"x": torch.randn(4, 16)}
'''


@pytest.fixture(scope="module")
def net_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinynet")
    (d / "tinyffn.py").write_text(NET)
    rng = np.random.default_rng(0)
    (d / "calib").mkdir()
    np.savez(d / "calib" / "a.npz", x=rng.standard_normal((64, 16)).astype(np.float32))
    ns: dict = {}
    exec(compile(NET, "tinyffn", "exec"), ns)
    return d, ns["make"]


def _data(seed: int, n: int = 4, rows: int = 16) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 16, generator=g),) for _ in range(n)]


def test_channel_pruning_removes_channels_and_fine_tune_recovers(net_module):
    _, make = net_module
    teacher, _ = make()
    student = copy.deepcopy(teacher)
    train, held = _data(1), _data(2)
    pairs = {(p.up, p.down) for p in candidate_pairs(student)}
    assert pairs == {("blocks.0.ffn.0", "blocks.0.ffn.2"), ("blocks.2.ffn.0", "blocks.2.ffn.2"),
                     ("blocks.1.fc1", "blocks.1.fc2")}

    # the pruned model is exactly the original with the dropped channels zeroed (GELU(0) = 0)
    zeroed = copy.deepcopy(teacher)
    rep = prune_ffn_channels(student, 0.5, train)
    assert rep["rejected"] == ["blocks.1.fc1 -> blocks.1.fc2"]      # softmax between: not channel-wise
    assert [b["hidden_before"] for b in rep["blocks"]] == [128, 128]
    assert sum(b["hidden_after"] for b in rep["blocks"]) <= 136 and rep["sparsity"] >= 0.46
    assert all(b["hidden_after"] % 8 == 0 for b in rep["blocks"])
    for b in rep["blocks"]:
        up = student.get_submodule(b["up"])
        assert up.weight.shape == (b["hidden_after"], 32) and student.get_submodule(b["down"]).in_features == \
            b["hidden_after"]
        orig = zeroed.get_submodule(b["up"])
        kept = [int((orig.weight == row).all(1).nonzero()[0]) for row in up.weight]
        drop = sorted(set(range(128)) - set(kept))
        with torch.no_grad():
            orig.weight[drop] = 0
            orig.bias[drop] = 0
    assert rep["params_after"] == sum(p.numel() for p in student.parameters()) < rep["params_before"]
    x = held[0][0]
    torch.testing.assert_close(student(x), zeroed(x), rtol=1e-5, atol=1e-5)

    before = heldout_metrics(student, teacher, {"x": torch.cat([b[0] for b in held]).numpy()})
    ft = distill_finetune(student, teacher, train, steps=80, lr=3e-3)
    after = heldout_metrics(student, teacher, {"x": torch.cat([b[0] for b in held]).numpy()})
    assert ft["loss_after"] < 0.5 * ft["loss_before"]
    assert before["cosine_mean"] < 0.995 and after["cosine_mean"] > before["cosine_mean"] + 0.002
    assert after["cosine_min"] > before["cosine_min"]


def test_2_4_masks_survive_the_masked_fine_tune(net_module):
    _, make = net_module
    teacher, _ = make()
    student = copy.deepcopy(teacher)
    train = _data(3)
    masks, rep = mask_2_4(student, train)
    assert rep["importance"] == "wanda" and len(rep["layers"]) == 8 and rep["skipped"] == []
    assert all(layer["sparsity"] == 0.5 for layer in rep["layers"])
    ft = distill_finetune(student, teacher, train, steps=40, lr=3e-3, masks=masks)
    assert ft["loss_after"] < ft["loss_before"]
    for w in masks:
        groups = (w.detach().reshape(w.shape[0], -1, 4) != 0).sum(-1)
        assert int(groups.max()) <= 2                               # still 2 of every 4 after training


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prune="channels:1.5"), ConfigError, r"must be a number in \(0, 1\)"),
    (dict(prune="channels:abc"), ConfigError, r"must be a number in \(0, 1\)"),
    (dict(prune="3:4"), ConfigError, "is not a pruning spec"),
    (dict(prune="2:4", target="t4"), TargetError, "t4 has no 2:4 sparse tensor cores"),
    (dict(prune="2:4", target="cpu"), TargetError, "cpu has no 2:4"),
    (dict(qat_steps=-1, precision="int4"), ConfigError, "--qat-steps must be >= 0"),
    (dict(prune="channels:0.3", finetune_steps=-5), ConfigError, "--finetune-steps must be >= 0"),
    (dict(finetune_steps=10), ConfigError, "needs --prune"),
    (dict(qat_steps=10, precision="fp16"), ConfigError, "--qat-steps fine-tunes for INT4"),
    (dict(qat_steps=10, precision="int4", algorithm="gptq"), ConfigError, "QAT trains for RTN codes"),
    (dict(prune="2:4", algorithm="gptq"), ConfigError, "refill the pruned zeros"),
])
def test_bad_compensation_options_fail_before_any_work(tmp_path, kwargs, error, message):
    out = tmp_path / "out"
    opts = dict(model="does-not-matter:make", target="jetson", out_dir=str(out))
    opts.update(kwargs)
    with pytest.raises(error, match=message):
        build(BuildOptions(**opts))
    assert not out.exists()


def test_parse_prune():
    assert (parse_prune("channels:0.3").pattern, parse_prune("channels:0.3").sparsity) == ("channels", 0.3)
    assert str(parse_prune(" 2:4 ")) == "2:4" and str(parse_prune("channels:0.25")) == "channels:0.25"


def test_onnx_source_prunes_without_fine_tune_and_refuses_qat(tmp_path):
    model = mlp_onnx(tmp_path / "clf.onnx")
    r = build(BuildOptions(model=str(model), target="cpu", out_dir=str(tmp_path / "o"), precision="fp32",
                           prune="channels:0.5", latency_iterations=2))
    assert r.report["compensation"]["prune"]["blocks"][0]["hidden_after"] == 64
    assert any("without a fine-tune" in n for n in r.report["notes"])
    # a pruned ONNX graph far from the original: the warning says no fine-tune ran (it said one "did not recover
    # it", a user's pass)
    lines: list[str] = []
    r = build(BuildOptions(model=str(model), target="jetson", out_dir=str(tmp_path / "o3"), precision="fp16",
                           prune="2:4", latency_iterations=2), log=lines.append)
    assert r.report["variants"][0]["accuracy"]["cosine_mean"] < 0.98
    assert [w for w in lines if "pruned without a fine-tune (an ONNX source has no weights to train)" in w], lines
    with pytest.raises(SourceError, match="source is an ONNX file"):
        build(BuildOptions(model=str(model), target="cpu", out_dir=str(tmp_path / "o2"), precision="int4",
                           qat_steps=5))


def test_build_prune_channels_with_fine_tune_reports_before_and_after(net_module, monkeypatch):
    d, _ = net_module
    monkeypatch.chdir(d)
    lines: list[str] = []
    r = build(BuildOptions(model="tinyffn:make", target="cpu", out_dir="out-prune", precision="fp32",
                           calib="calib", prune="channels:0.5", finetune_steps=60, latency_iterations=2),
              log=lines.append)
    # the student's parity, formatted like the export's line (it printed the float's every digit)
    diff = r.report["export"]["parity_max_abs_diff"]
    assert f"exported the fine-tuned student; parity max abs diff {diff:.3g}" in lines, lines
    comp = r.report["compensation"]["prune"]
    assert comp["spec"] == "channels:0.5" and comp["finetune"]["steps"] == 60
    assert comp["heldout_after"]["cosine_mean"] > comp["heldout_before"]["cosine_mean"]
    assert comp["heldout_before"]["n"] == 32                        # second half of --calib: never trained on
    fp32 = r.report["variants"][0]
    assert fp32["name"] == "fp32" and fp32["size_vs_fp32"] < 0.8
    # the shipped fp32 model is the student, measured against the teacher's export
    assert fp32["accuracy"]["cosine_mean"] == pytest.approx(comp["heldout_after"]["cosine_mean"], abs=1e-4)
    m = onnx.load(str(r.bundle / "models/fp32.onnx"))
    widths = sorted(numpy_helper.to_array(t).shape for t in m.graph.initializer if t.dims and len(t.dims) == 2)
    assert max(max(s) for s in widths) < 128                        # no 128-wide FFN weight left
    from dsedge.toolchain.report import compensation_lines

    assert compensation_lines(r.report) == [
        f"prune channels:0.5: fine-tune 60 steps ({comp['finetune']['time_s']:.0f} s); held-out vs fp32 teacher: "
        f"cosine mean {comp['heldout_before']['cosine_mean']:.4f} → {comp['heldout_after']['cosine_mean']:.4f}, "
        f"min {comp['heldout_before']['cosine_min']:.4f} → {comp['heldout_after']['cosine_min']:.4f}, top-1 "
        f"{comp['heldout_before']['argmax_agreement']:.3f} → {comp['heldout_after']['argmax_agreement']:.3f}"]
    saved = json.loads((r.bundle / "report.json").read_text())
    assert saved["compensation"]["prune"]["heldout_after"] == comp["heldout_after"]
    manifest = json.loads((r.bundle / "manifest.json").read_text())
    assert any("pruned/QAT-tuned student, not the original" in n for n in manifest["variants"][0]["notes"])


def test_build_qat_changes_the_int4_weights_and_reports_before_and_after(net_module, monkeypatch):
    d, make = net_module
    monkeypatch.chdir(d)
    r = build(BuildOptions(model="tinyffn:make", target="cpu", out_dir="out-qat", precision="int4",
                           calib="calib", qat_steps=40, latency_iterations=2, keep_fp32=False, embeddings=False))
    qat = r.report["compensation"]["qat"]
    assert qat["steps"] == 40 and qat["loss_after"] < qat["loss_before"]
    assert qat["heldout_after"]["cosine_mean"] >= qat["heldout_before"]["cosine_mean"]
    assert r.report["compression"]["algorithm"] == "rtn" and r.report["compression"]["clip_search"] is False
    int4 = r.report["variants"][0]
    # the INT4 ONNX computes what the fake-quantized student computed in torch
    assert int4["accuracy"]["cosine_mean"] == pytest.approx(qat["heldout_after"]["cosine_mean"], abs=2e-4)
    # and its weights are not RTN of the original weights: QAT moved some across rounding boundaries
    original, _ = make()
    rtn = {}
    for mod in original.modules():
        if isinstance(mod, torch.nn.Linear):
            fq = fake_quant_weight(mod.weight.detach()).numpy()             # [out, in], blocks along in
            rtn.setdefault(fq.shape, []).append(fq)
            rtn.setdefault(fq.T.shape, []).append(fq.T)
    q = onnx.load(str(r.bundle / "models/int4.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(dqs) == 8
    changed = 0
    for dq in dqs:
        attrs = {a.name: a.i for a in dq.attribute}
        codes, scale = inits[dq.input[0]].astype(np.float32), inits[dq.input[1]]
        axis = attrs.get("axis", 1) % codes.ndim
        if attrs.get("block_size"):
            scale = np.repeat(scale, attrs["block_size"], axis=axis).take(range(codes.shape[axis]), axis=axis)
        else:
            scale = np.expand_dims(scale, 1 - axis)
        w = codes * scale
        changed += min(int(np.count_nonzero(np.abs(w - c) > 1e-6)) for c in rtn[w.shape])
    assert changed > 0


def _cli(args, capsys):
    from dsedge.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_prune_torch_source_fine_tunes_and_build_rejects_bad_options(net_module, monkeypatch, capsys):
    d, _ = net_module
    monkeypatch.chdir(d)
    code, stdout, _ = _cli(["prune", "tinyffn:make", "-o", "p.onnx", "--pattern", "channels", "--sparsity", "0.5",
                            "--calib", "calib", "--finetune-steps", "30", "--report", "p.json"], capsys)
    assert code == 0 and "fine-tune 30 steps" in stdout
    from dsedge.runtime.bundle import usual_mode

    assert (d / "p.onnx").stat().st_mode & 0o777 == usual_mode()        # not mkstemp's 0600
    rep = json.loads((d / "p.json").read_text())
    assert rep["heldout_after"]["cosine_mean"] > rep["heldout_before"]["cosine_mean"]
    assert len(rep["blocks"]) == 2 and \
        sum(b["hidden_after"] for b in rep["blocks"]) <= 136
    import onnxruntime as ort

    s = ort.InferenceSession(str(d / "p.onnx"), providers=["CPUExecutionProvider"])
    assert s.run(None, {"x": np.ones((3, 16), np.float32)})[0].shape == (3, 8)
    code, _, err = _cli(["prune", d / "p.onnx", "-o", "q.onnx", "--finetune-steps", "5"], capsys)
    assert code == 2 and "needs a torch MODEL" in err and "Traceback" not in err
    code, _, err = _cli(["build", "--model", "tinyffn:make", "--target", "t4", "--prune", "2:4"], capsys)
    assert code == 2 and "t4 has no 2:4 sparse tensor cores" in err and "Traceback" not in err
    code, _, err = _cli(["build", "--model", "tinyffn:make", "--prune", "channels"], capsys)
    assert code == 2 and "channel sparsity must be a number" in err


def test_build_2_4_with_qat_for_orin_keeps_the_pattern_in_the_int4_codes(net_module, monkeypatch):
    d, _ = net_module
    monkeypatch.chdir(d)
    r = build(BuildOptions(model="tinyffn:make", target="jetson", out_dir="out-24", precision="int4",
                           calib="calib", prune="2:4", finetune_steps=20, qat_steps=20, latency_iterations=2,
                           keep_fp32=False, embeddings=False))
    comp = r.report["compensation"]
    assert comp["prune"]["pattern"] == "2:4" and comp["qat"]["steps"] == 20
    assert "INT4 algorithm rtn" in " ".join(r.report["notes"])
    assert "--sparsity=enable" in (r.bundle / "build/trtexec.sh").read_text()
    q = onnx.load(str(r.bundle / "models/int4.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    codes = [inits[n.input[0]] for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    # TensorRT's INT4 is blockwise along K with blocks of 64: the 3 layers of K 64/128 are INT4, the 5 of K 16/32
    # stay float (they were per-channel INT4, which TensorRT rejects)
    assert len(codes) == 3
    assert sorted(u["k"] for u in r.report["compression"]["tensorrt_int4"]["float"]) == [16, 32, 32, 32, 32]
    def two_of_four(c: np.ndarray, k_axis: int) -> bool:
        g = np.moveaxis(c, k_axis, -1)
        return g.shape[-1] % 4 == 0 and int((g.reshape(-1, 4) == 0).sum(1).min()) >= 2

    for c in codes:                    # 2 of every 4 consecutive codes along K are zero (either weight layout)
        assert two_of_four(c, 0) or two_of_four(c, 1)


def test_token_replacement_keeps_padding_and_the_sentence_boundaries():
    from dsedge.toolchain.finetune import token_replacement

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (8, 40), generator=g)
    mask = torch.ones(8, 40, dtype=torch.int64)
    mask[:, 30:] = 0
    ids[:, 0], ids[:, 29], ids[:, 30:] = 101, 102, 0                   # [CLS] … [SEP] then padding
    batch = (ids, mask, torch.zeros_like(ids))
    new = token_replacement(["input_ids", "attention_mask", "token_type_ids"], p=0.2)(batch, 0)
    assert new[1] is mask and new[2] is batch[2]
    changed = new[0] != ids
    assert not changed[:, 0].any() and not changed[:, 29:].any()        # boundaries and padding untouched
    assert 0.1 < changed[:, 1:29].float().mean() < 0.25                 # ~p of the inner tokens (a few redraw the same)
    assert set(new[0][changed].tolist()) <= set(ids[:, 1:29].flatten().tolist())


def test_auto_precision_after_pruning_judges_the_student_and_reports_vs_the_original(net_module, monkeypatch):
    d, _ = net_module
    monkeypatch.chdir(d)
    r = build(BuildOptions(model="tinyffn:make", target="jetson", out_dir="out-auto", calib="calib",
                           prune="channels:0.5", finetune_steps=20, latency_iterations=2))
    choice = r.report["precision_choice"]
    assert "vs the pruned/fine-tuned fp32 student" in choice["rule"] and choice["chosen"] == r.report["precision"]
    assert any(n.startswith("auto chose") for n in r.report["notes"])
    assert any("fp32 variant is the pruned, fine-tuned model" in n for n in r.report["notes"])
    by_name = {v["name"]: v for v in r.report["variants"]}
    # variants are measured against the unpruned teacher: the pruned fp32 is not "self" and matches the torch figure
    after = r.report["compensation"]["prune"]["heldout_after"]["cosine_mean"]
    assert by_name["fp32"]["accuracy"]["cosine_mean"] == pytest.approx(after, abs=1e-4)
    chosen = next(c for c in choice["candidates"] if c["precision"] == r.report["precision"])
    assert chosen["cosine_mean"] > by_name[r.report["precision"]]["accuracy"]["cosine_mean"]


@pytest.mark.parametrize("args, steps", [(["--qat-steps"], 500), (["--qat-steps", "20"], 20), ([], 0)])
def test_build_qat_steps_alone_means_the_default_500(args, steps, monkeypatch):
    from click.testing import CliRunner

    import dsedge.toolchain.pipeline as pipeline
    from dsedge.toolchain.commands.build import build

    seen = {}

    def record(opts, log=None):          # stop before any work: this test is about the option's parsing
        seen["qat_steps"] = opts.qat_steps
        raise SystemExit(0)

    monkeypatch.setattr(pipeline, "build", record)
    assert CliRunner().invoke(build, ["--precision", "int4", *args]).exit_code == 0
    assert seen == {"qat_steps": steps}


def test_gate_judges_the_shipped_model_against_the_original_not_the_student(net_module, monkeypatch):
    from dsedge.runtime.errors import AccuracyGateError

    d, _ = net_module
    monkeypatch.chdir(d)
    with pytest.raises(AccuracyGateError, match="vs the original model \\(the pruning/QAT cost included\\)"):
        build(BuildOptions(model="tinyffn:make", target="cpu", out_dir="out-gate", precision="fp32", calib="calib",
                           prune="channels:0.5", finetune_steps=0, accuracy_gate="cosine:0.9999",
                           latency_iterations=2))
    assert not [p for p in (d / "out-gate").iterdir() if p.name.endswith(".dse")]   # nothing half-written


def test_cli_prune_torch_source_with_a_calib_file_is_one_line(net_module, monkeypatch, capsys):
    """Found by a user: `--help` says --calib takes ".npz or dir", but a torch MODEL with a .npz file said
    "calibration directory 'calib/a.npz' does not exist" (it does: it is a file)."""
    d, _ = net_module
    monkeypatch.chdir(d)
    code, _, err = _cli(["prune", "tinyffn:make", "-o", "f.onnx", "--calib", d / "calib" / "a.npz",
                         "--finetune-steps", "1"], capsys)
    assert code == 2 and "Traceback" not in err and "does not exist" not in err, err
    assert "a directory of .npz files (this is a file)" in err and "hint:" in err
    assert not (d / "f.onnx").exists()


NAN_NET = '''
import torch
from torch import nn


class Net(nn.Module):
    """An FFN block plus sqrt(g - 1) with g = 1: a finite output, an infinite gradient from the first step."""

    def __init__(self):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
        self.g = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.ffn(x) + torch.sqrt(self.g - 1.0)


def make():
    torch.manual_seed(0)
    return Net().eval(), {"x": torch.randn(4, 16)}
'''


def test_fine_tune_stops_on_a_non_finite_loss_and_leaves_the_student_finite():
    """Found by a user: the pruning fine-tune had no NaN guard (`dsedge train` has one): an infinite gradient made
    every weight NaN, and the run went on to export. Non-finite steps are now skipped, 3 in a row stop it."""
    from dsedge.runtime.errors import TrainingError

    ns: dict = {}
    exec(compile(NAN_NET, "nanffn", "exec"), ns)
    teacher, _ = ns["make"]()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.ffn[0].weight.mul_(0.5)                        # unlike the teacher: a non-zero loss gradient
    with pytest.raises(TrainingError, match=r"non-finite for 3 steps in a row \(step 3 of 20\)") as e:
        distill_finetune(student, teacher, _data(0), steps=20)
    assert e.value.hint and "\n" not in str(e.value)
    assert all(torch.isfinite(p).all() for p in student.parameters())


def test_cli_prune_with_a_nan_fine_tune_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """`dsedge prune` of a torch source whose fine-tune goes non-finite: one line naming the fine-tune (it said
    "the model's outputs hold NaN/inf … fix the model's forward()" after exporting the NaN student), exit 2, no
    model, no report, no temporary file."""
    (tmp_path / "nanffn.py").write_text(NAN_NET)
    (tmp_path / "calib").mkdir()
    np.savez(tmp_path / "calib" / "a.npz", x=np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _cli(["prune", "nanffn:make", "-o", "p.onnx", "--pattern", "channels", "--sparsity", "0.5",
                         "--calib", "calib", "--finetune-steps", "5", "--report", "p.json"], capsys)
    assert code == 2 and "error: fine-tune loss or gradients non-finite for 3 steps in a row" in err, err
    assert "Traceback" not in err and "hint:" in err
    assert {p.name for p in tmp_path.iterdir()} - {"__pycache__"} == {"calib", "nanffn.py"}


def test_channel_pruning_of_a_bert_whose_layers_share_a_bias_loads_and_builds(tmp_path, capsys):
    """A helper's pass with user models: the TorchScript exporter shares equal initializers through Identity (a
    tiny BertModel's zero FFN biases: layer 1 reads layer 0's), channel pruning cut the bias for layer 0 only, and
    `dsedge prune` exited 0 with a model ONNX Runtime cannot load (then: refused, exit 2). Each pruned layer now
    cuts its own copy of a shared tensor: both blocks are pruned, the output loads and stays close to the source,
    and `dsedge build --prune channels:0.3` of the same model builds."""
    import onnxruntime as ort
    import torch
    from transformers import BertConfig, BertModel

    from cli_helpers import run_main

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=32)).eval()

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = bert

        def forward(self, ids, mask):
            return self.b(input_ids=ids, attention_mask=mask).last_hidden_state

    src = tmp_path / "bert.onnx"
    ids, mask = torch.randint(0, 500, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    torch.onnx.export(Wrap(), (ids, mask), str(src), input_names=["input_ids", "attention_mask"],
                      output_names=["h"], dynamic_axes={k: {0: "batch", 1: "seq"} for k in ("input_ids", "attention_mask", "h")},
                      opset_version=17, dynamo=False)
    out = tmp_path / "pruned.onnx"
    code, stdout, err = run_main(["prune", src, "-o", out, "--pattern", "channels", "--sparsity", "0.3"], capsys)
    assert code == 0 and "in 2 blocks" in stdout, err
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 500, (2, 8)), "attention_mask": np.ones((2, 8), np.int64)}
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    cos = (ref * got).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))
    assert got.shape == ref.shape and cos.min() > 0.99
    code, _, err = run_main(["build", "--model", src, "--target", "cpu", "--prune", "channels:0.3", "--out",
                             tmp_path / "b"], capsys)
    assert code == 0 and "Traceback" not in err, err
