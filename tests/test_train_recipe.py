"""The train/distill recipes in one process on tiny real models: run dir layout, resume, corrupt checkpoints,
non-finite steps and rollback, precision modes, distillation, `load_trained`."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from train_models import config
import torch
from safetensors.torch import load_file

from dsedge.runtime.errors import TrainingError
from dsedge.toolchain.train import distill, train
from dsedge.toolchain.train.config import from_dict, load_config
from dsedge.toolchain.train.export_source import load_trained
from dsedge.toolchain.train.metrics import read_metrics

TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # 2 shared cores: intra-op threads only add contention for models this small
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, TESTS)
    yield
    torch.set_num_threads(n)
    sys.path.remove(TESTS)


def losses(run_dir):
    return [r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    result = train.run(from_dict(config(out)))
    return out, result


def test_run_dir_layout_and_metrics(baseline):
    out, result = baseline
    assert result.steps == 6 and (out / "config.toml").is_file()
    assert load_config(out / "config.toml").to_dict() == from_dict(config(out)).to_dict()
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        assert {"loss", "lr", "grad_norm", "step_time_ms", "samples_per_s", "data_wait_fraction"} <= set(r)
        assert 0 <= r["data_wait_fraction"] <= 1 and r["samples_per_s"] > 0
    # warmup 10 % of 6 steps = 1 step at lr/2, then cosine
    assert recs[0]["lr"] == pytest.approx(5e-4) and recs[1]["lr"] == pytest.approx(1e-3)
    assert recs[-1]["lr"] < recs[2]["lr"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_6"]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "event" in line]
    ck = [e for e in events if e["event"] == "checkpoint"]
    assert [e["step"] for e in ck] == [3, 6] and 0 <= ck[-1]["val_accuracy"] <= 1 and ck[-1]["val_loss"] > 0


def test_load_trained_gives_eval_model_and_examples(baseline):
    out, _ = baseline
    model, examples = load_trained(out)
    assert not model.training
    assert list(examples) == ["features"] and examples["features"].shape == (1, 8)
    assert examples["features"].dtype == torch.float32
    sd = load_file(out / "final" / "model.safetensors")
    assert torch.equal(model.head.weight, sd["head.weight"])
    meta = json.loads((out / "final" / "model.json").read_text())
    assert meta["factory"] == "train_models:make_tiny" and meta["output_names"] == ["logits"]
    assert meta["step"] == 6
    # the weights get the mode model.json gets (the umask's), not safetensors' 0600 (a user's pass: another user or
    # a container running as non-root could not read them)
    from dsedge.runtime.files import usual_mode

    for f in ("model.safetensors", "model.json"):
        assert (out / "final" / f).stat().st_mode & 0o777 == usual_mode(), f


def test_resume_skips_corrupt_and_partial_checkpoints_and_matches(baseline, tmp_path, capsys):
    out, _ = baseline
    copy_dir = tmp_path / "run"
    shutil.copytree(out, copy_dir)
    shutil.rmtree(copy_dir / "final")
    # corrupt step_6 (same size, flipped bytes) and add a partial step_9 without its COMPLETE marker
    shard = next((copy_dir / "checkpoints" / "step_6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-8:] = bytes(8)
    shard.write_bytes(bytes(data))
    partial = copy_dir / "checkpoints" / "step_9"
    shutil.copytree(copy_dir / "checkpoints" / "step_3", partial)
    (partial / "COMPLETE").unlink()
    train.run(from_dict(config(copy_dir)))
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_9: no COMPLETE marker" in err and "sha256 mismatch" in err
    assert "resumed from checkpoint step_3" in err
    assert losses(copy_dir) == losses(out)  # bit-identical trajectory after resume
    a, b = load_file(out / "final" / "model.safetensors"), load_file(copy_dir / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [e["step"] for e in map(json.loads, (copy_dir / "metrics.jsonl").read_text().splitlines())
            if e.get("event") == "resumed"] == [3]


def test_nonfinite_step_is_skipped(tmp_path):
    out = tmp_path / "run"
    train.run(from_dict(config(out, steps=4, model={"factory": "train_models:make_nan_burst",
                                                    "kwargs": {"start": 2, "count": 1}})))
    recs = read_metrics(out / "metrics.jsonl")
    assert [r.get("skipped", False) for r in recs] == [False, True, False, False]
    assert recs[1]["loss"] is None and all(r["loss"] is not None for r in recs[2:])


def test_rollback_after_k_nonfinite_steps(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = config(out, steps=9, health={"max_nonfinite": 3, "progress": False},
                 model={"factory": "train_models:make_nan_burst", "kwargs": {"start": 5, "count": 3}})
    train.run(from_dict(cfg))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rb = [{k: v for k, v in e.items() if k != "time"} for e in lines if e.get("event") == "rollback"]
    assert rb == [{"event": "rollback", "from_step": 7, "to_step": 6, "nonfinite": 3, "rollbacks": 1}]
    assert "rolled back from step 7 to step_6" in capsys.readouterr().err
    recs = [r for r in lines if "event" not in r]
    assert recs[-1]["step"] == 9 and recs[-1]["loss"] is not None


def test_gives_up_after_max_rollbacks(tmp_path):
    cfg = config(tmp_path / "run", steps=12, checkpoint={"every": 2},
                 health={"max_nonfinite": 2, "max_rollbacks": 1, "progress": False},
                 model={"factory": "train_models:make_nan_burst", "kwargs": {"start": 3, "count": 100}})
    with pytest.raises(TrainingError, match="non-finite for 2 steps in a row after 1 rollbacks"):
        train.run(from_dict(cfg))


def test_bf16_close_to_fp32_and_fp16_scales(baseline, tmp_path):
    out, _ = baseline
    train.run(from_dict(config(tmp_path / "bf16", precision={"mode": "bf16"})))
    ref, got = losses(out), losses(tmp_path / "bf16")
    assert got != ref and max(abs(a - b) for a, b in zip(ref, got)) < 3e-2
    train.run(from_dict(config(tmp_path / "fp16", steps=3,
                               precision={"mode": "fp16", "initial_scale": 256.0, "growth_interval": 1})))
    recs = read_metrics(tmp_path / "fp16" / "metrics.jsonl")
    assert [r["loss_scale"] for r in recs] == [256.0, 512.0, 1024.0]
    assert max(abs(a - r["loss"]) for a, r in zip(ref, recs)) < 3e-2


def test_activation_checkpointing_same_numbers(baseline, tmp_path):
    out, _ = baseline
    train.run(from_dict(config(tmp_path / "ac", checkpoint={"every": 6, "activation_checkpointing": True})))
    assert losses(tmp_path / "ac") == pytest.approx(losses(out), rel=1e-6)


def test_two_inputs_and_token_budget(tmp_path):
    train.run(from_dict(config(tmp_path / "two", steps=3, data={"factory": "train_models:make_two_input_data",
                                                                "kwargs": {}, "batch_size": 8},
                               checkpoint={"every": 1, "keep": 2},
                               model={"factory": "train_models:make_two_input", "input_names": ["dense", "ids"]})))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_2", "step_3"]
    model, ex = load_trained(tmp_path / "two")
    assert {k: (tuple(v.shape), v.dtype) for k, v in ex.items()} == {"dense": ((1, 4), torch.float32),
                                                                     "ids": ((1,), torch.int64)}
    assert model(**ex).shape == (1, 2)
    train.run(from_dict(config(tmp_path / "tok", epochs=1, steps=None, data={
        "factory": "train_models:make_sequences", "kwargs": {}, "max_tokens": 48, "max_batch_size": 8},
        model={"factory": "train_models:make_bag", "input_names": ["ids"]})))
    recs = read_metrics(tmp_path / "tok" / "metrics.jsonl")
    assert len(recs) >= 5 and all(r["tokens_per_s"] > 0 for r in recs)


def test_distill_student_from_teacher(baseline, tmp_path):
    teacher, _ = baseline
    cfg = config(tmp_path / "student", steps=4, model={"factory": "train_models:make_tiny",
                                                       "kwargs": {"d": 8, "hidden": 16, "depth": 1}},
                 distill={"teacher": str(teacher), "temperature": 2.0, "alpha": 0.5})
    result = distill.run(from_dict(cfg, distill=True))
    recs = read_metrics(tmp_path / "student" / "metrics.jsonl")
    assert result.steps == 4 and all(r["loss"] > 0 for r in recs)
    student, _ = load_trained(tmp_path / "student")
    assert student.head.weight.shape == (3, 8)
    # feature matching: the student's embedding output (d=16 like the teacher) pulled toward the teacher's
    cfg = config(tmp_path / "feat", steps=2, model={"factory": "train_models:make_tiny", "kwargs": {"depth": 1}},
                 distill={"teacher": str(teacher), "features": {"embed": "embed"}, "feature_weight": 1.0})
    distill.run(from_dict(cfg, distill=True))
    with_feat = read_metrics(tmp_path / "feat" / "metrics.jsonl")[0]["loss"]
    cfg["distill"]["feature_weight"] = 0.0
    cfg["out_dir"] = str(tmp_path / "nofeat")
    from dsedge.cli import main
    from dsedge.toolchain.train.config import dump_toml

    (tmp_path / "nofeat.toml").write_text(dump_toml(cfg))
    with pytest.raises(SystemExit) as e:  # the `dsedge distill` command
        main(["distill", str(tmp_path / "nofeat.toml")])
    assert e.value.code == 0
    assert with_feat > read_metrics(tmp_path / "nofeat" / "metrics.jsonl")[0]["loss"]


def test_factory_errors_are_config_errors(tmp_path):
    from dsedge.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[model\] factory 'train_models:make_tiny' failed: .*widht"):
        train.run(from_dict(config(tmp_path / "a", model={"kwargs": {"widht": 3}})))
    # a user's pass: a value the factory refuses (ValueError) came out as a 43-line traceback
    with pytest.raises(ConfigError, match="failed: dropout probability has to be between 0 and 1, but got 1.5"):
        train.run(from_dict(config(tmp_path / "d", model={"factory": "train_models:make_dropout_mlp",
                                                           "kwargs": {"p": 1.5}})))
    with pytest.raises(ConfigError, match="input_names has 2 names but the data gives 1 inputs"):
        train.run(from_dict(config(tmp_path / "b", model={"input_names": ["a", "b"]})))
    with pytest.raises(ConfigError, match="module 'no_such_module' not found"):
        train.run(from_dict(config(tmp_path / "c", data={"factory": "no_such_module:make"})))


def test_cli_train(tmp_path, capsys):
    from dsedge.cli import main
    from dsedge.toolchain.train.config import dump_toml

    path = tmp_path / "c.toml"
    path.write_text(dump_toml(config(tmp_path / "cli", steps=2)))
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "metrics.jsonl").write_text('{"step": 99, "loss": 5.0}\n')  # an earlier run's leftovers
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    assert e.value.code == 0
    assert "trained 2 steps" in capsys.readouterr().out
    assert (tmp_path / "cli" / "final" / "model.safetensors").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "cli" / "metrics.jsonl")] == [1, 2]


def test_real_fraud_data_bce_with_pos_weight(shared_data, tmp_path):
    """The fraud contract on the real ULB subsample: bce_with_logits + pos_weight, logits (N, 1), target (N,)."""
    csv = shared_data / "creditcard-fraud-ulb" / "creditcard_fraud_subsample.csv"
    cfg = config(tmp_path / "fraud", steps=40, model={"factory": "train_models:make_fraud_mlp",
                                                      "input_names": ["dense"]},
                 data={"factory": "train_models:make_fraud_data", "kwargs": {"csv": str(csv)}, "batch_size": 256},
                 loss={"kind": "bce_with_logits", "pos_weight": 10.0}, optim={"lr": 1e-2},
                 checkpoint={"every": 40})
    train.run(from_dict(cfg))
    got = losses(tmp_path / "fraud")
    assert sum(got[-5:]) / 5 < 0.8 * sum(got[:5]) / 5
    ev = [json.loads(x) for x in (tmp_path / "fraud" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert ev and 0 < ev[-1]["val_loss"] < got[0]
    model, ex = load_trained(tmp_path / "fraud")
    assert ex["dense"].shape == (1, 30) and model(ex["dense"]).shape == (1, 1)
    import train_models

    _, val = train_models.make_fraud_data(str(csv))
    x, y = val.tensors
    with torch.no_grad():
        score = model(x).squeeze(-1)
    assert score[y == 1].mean() > score[y == 0].mean() + 1.0  # frauds score clearly higher
