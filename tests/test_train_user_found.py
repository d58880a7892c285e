"""Found by a user trying `dsedge train` / `dsedge distill` (resume, mixed precision, torchrun, distillation
features): each test failed before its fix. Tiny real models, in one process or under real torchrun (gloo)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from train_models import config

from dsedge.runtime.errors import ConfigError
from dsedge.toolchain.train import distill, train
from dsedge.toolchain.train.config import dump_toml, from_dict
from dsedge.toolchain.train.metrics import read_metrics

from test_train_recipe import TESTS, losses, one_thread  # noqa: F401  (one_thread: the module's autouse fixture)


def cut_back_to_step_3(run_dir):
    """What a run killed between its checkpoints at steps 3 and 6 leaves."""
    shutil.rmtree(run_dir / "checkpoints" / "step_6")
    shutil.rmtree(run_dir / "final")


def test_resume_of_a_model_with_dropout_continues_the_same_trajectory(tmp_path):
    """The checkpoint's RNG state was defeated: the resumed run's new DataLoader drew its base seed from the global
    RNG (the uninterrupted run drew none at that step), so every dropout mask after the resume differed."""
    ref = train.run(from_dict(config(tmp_path / "ref", model={"factory": "train_models:make_dropout"})))
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    cut_back_to_step_3(tmp_path / "run")
    result = train.run(from_dict(config(tmp_path / "run", model={"factory": "train_models:make_dropout"})))
    assert result.resumed_from == 3 and result.steps == ref.steps == 6
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    a, b = load_file(tmp_path / "ref" / "final" / "model.safetensors"), load_file(tmp_path / "run" / "final" /
                                                                                   "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_how_often_it_checkpoints_does_not_change_the_trajectory(tmp_path):
    """Two runs differing only in [checkpoint] every trained differently after the first checkpoint: each
    evaluation's DataLoader drew its base seed from the global RNG, so the dropout masks after it moved (a user's
    pass: fraud-teacher losses diverged from step 201 with every = 200 against 500)."""
    finals = []
    for every in (2, 6):
        run = tmp_path / f"every{every}"
        train.run(from_dict(config(run, model={"factory": "train_models:make_dropout"}, checkpoint={"every": every})))
        finals.append(load_file(run / "final" / "model.safetensors"))
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_resume_takes_the_configs_optim_settings_not_the_checkpoints(tmp_path):
    """Rerunning with another [optim] lr / weight_decay resumed with the checkpoint's (loaded with the optimizer
    state), silently, while OUT/config.toml recorded the new values."""
    train.run(from_dict(config(tmp_path / "ref")))
    ref_lr = [r["lr"] for r in read_metrics(tmp_path / "ref" / "metrics.jsonl")]
    finals = {}
    for wd in (0.01, 0.5):
        run = tmp_path / f"wd{wd}"
        shutil.copytree(tmp_path / "ref", run)
        cut_back_to_step_3(run)
        train.run(from_dict(config(run, optim={"lr": 1e-2, "weight_decay": wd})))
        lr = [r["lr"] for r in read_metrics(run / "metrics.jsonl")]
        assert lr[:3] == ref_lr[:3]
        assert lr[3:] == pytest.approx([10 * x for x in ref_lr[3:]], rel=1e-9)  # the new lr's schedule
        finals[wd] = load_file(run / "final" / "model.safetensors")
    assert any(not torch.equal(finals[0.01][k], finals[0.5][k]) for k in finals[0.01])  # weight_decay counts too


def test_pipeline_with_fp16_or_distill_is_refused_before_launch(tmp_path, capsys):
    """Checked only by the ranks: `--nproc-per-node 2` printed it once per rank, then torchrun's ChildFailedError
    traceback, and left OUT/config.toml."""
    from dsedge.cli import main

    run = tmp_path / "run"
    cfg = config(run, device="cpu", model={"factory": "train_models:make_mlp"},
                 parallel={"data": "fsdp", "pipeline": 2}, precision={"mode": "fp16"})
    with pytest.raises(ConfigError, match="pipeline parallel supports fp32/bf16 training"):
        from_dict(cfg)
    path = tmp_path / "pp.toml"
    path.write_text(dump_toml(cfg))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "pipeline parallel supports fp32/bf16 training (no fp16, no distill)" in err
    assert not run.exists()
    cfg = config(run, parallel={"data": "fsdp", "pipeline": 2}, distill={"teacher": str(tmp_path / "t")})
    with pytest.raises(ConfigError, match="no fp16, no distill"):
        from_dict(cfg, distill=True)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    train.run(from_dict(config(out, steps=1)))
    return out


def test_distill_features_of_other_shapes_are_one_line(teacher, tmp_path, capsys):
    """A student/teacher feature pair of other shapes (student d = 8, teacher d = 16) ended in torch's broadcast
    RuntimeError traceback at the first step."""
    from dsedge.cli import main

    cfg = config(tmp_path / "run", model={"kwargs": {"d": 8}},
                 distill={"teacher": str(teacher), "features": {"embed": "embed"}, "feature_weight": 1.0})
    with pytest.raises(ConfigError, match=r"features: the student's 'embed' gives \[8, 8\] and the teacher's "
                                          r"'embed' \[8, 16\]"):
        distill.run(from_dict(cfg, distill=True))
    path = tmp_path / "d.toml"
    path.write_text(dump_toml(cfg))
    with pytest.raises(SystemExit) as e:
        main(["distill", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "pair modules whose outputs have the same shape" in err


def test_distill_features_and_feature_weight_come_together(teacher, tmp_path):
    """`features` without `feature_weight` (default 0) trained without any feature loss, and `feature_weight`
    without `features` was ignored: both silently."""
    base = config(tmp_path / "run", distill={"teacher": str(teacher)})
    with pytest.raises(ConfigError, match=r"\[distill\] features needs feature_weight"):
        from_dict({**base, "distill": {**base["distill"], "features": {"embed": "embed"}}}, distill=True)
    with pytest.raises(ConfigError, match=r"\[distill\] feature_weight = 0.5 needs features"):
        from_dict({**base, "distill": {**base["distill"], "feature_weight": 0.5}}, distill=True)
    off = from_dict({**base, "distill": {**base["distill"], "features": {"embed": "embed"}, "feature_weight": 0.0}},
                    distill=True)  # an explicit 0 turns the matching off
    assert off.distill.feature_weight == 0.0
    with pytest.raises(ConfigError, match=r"features must map student module names to teacher module names"):
        from_dict({**base, "distill": {**base["distill"], "features": {"embed": 3}, "feature_weight": 1.0}},
                  distill=True)


def test_progress_bar_counts_toward_the_runs_steps(tmp_path, capsys):
    """`[health] progress = true` drew a bar without a total ("6step [00:00, …]": no fraction, no ETA): the
    recipe never gave the log its step count."""
    train.run(from_dict(config(tmp_path / "run", health={"progress": True})))
    err = capsys.readouterr().err
    assert "6/6 [" in err, err


def torchrun_cli(tmp_path, verb, cfg):
    """``dsedge VERB CONFIG --nproc-per-node 2`` (the launcher starts torchrun, 2 ranks on gloo)."""
    path = tmp_path / f"{verb}.toml"
    path.write_text(dump_toml(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dsedge.cli", verb, str(path), "--nproc-per-node", "2"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_parameters_forward_leaves_unused_are_named_under_ddp(tmp_path):
    """A model with a parameter forward() never uses trains in one process; under `--nproc-per-node 2` DDP's
    reducer failed the second step with a RuntimeError traceback on every rank (then torchrun's own)."""
    proc = torchrun_cli(tmp_path, "train", config(tmp_path / "run", device="cpu",
                                                  model={"factory": "train_models:make_half_used"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert "forward() leaves spare.weight, spare.bias unused, which data-parallel training (DDP) cannot reduce" in out
    assert "hint: use them in forward(), or freeze them" in out


@pytest.mark.slow
def test_a_ranks_error_under_the_launcher_ends_without_torchruns_traceback(teacher, tmp_path):
    """`dsedge distill --nproc-per-node 2` whose ranks stop on a ConfigError: each printed its one line, then the
    launcher printed torchrun's ChildFailedError traceback and exited 1 (2 in one process)."""
    cfg = config(tmp_path / "run", device="cpu", model={"kwargs": {"d": 8}},
                 distill={"teacher": str(teacher), "features": {"embed": "embed"}, "feature_weight": 1.0})
    proc = torchrun_cli(tmp_path, "distill", cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out and "ChildFailedError" not in out, out
    assert "error: " in out and "features: the student's 'embed' gives [4, 8] and the teacher's 'embed' [4, 16]" in out


def test_resumed_log_drops_the_abandoned_trajectorys_events(tmp_path):
    """metrics.jsonl after a resume from step 3 still held the abandoned run's `checkpoint` event of step 6 and its
    `finished` event: two `finished` events and two step-6 validations in "one trajectory"."""
    import json

    train.run(from_dict(config(tmp_path / "run")))
    cut_back_to_step_3(tmp_path / "run")
    train.run(from_dict(config(tmp_path / "run")))
    events = [e for e in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "event" in e]
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint", 3), ("resumed", 3), ("checkpoint", 6),
                                                         ("finished", 6)]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_distill_on_data_the_teacher_cannot_take_is_one_line(teacher, tmp_path, capsys):
    """A teacher trained on 8 features and data of 6 (student built for 6): torch's matmul RuntimeError traceback
    from inside the teacher at the first step."""
    from dsedge.cli import main

    cfg = config(tmp_path / "run", model={"kwargs": {"din": 6}}, data={"kwargs": {"val": 16, "din": 6}},
                 distill={"teacher": str(teacher)})
    path = tmp_path / "d.toml"
    path.write_text(dump_toml(cfg))
    with pytest.raises(SystemExit) as e:
        main(["distill", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert f"the teacher {teacher} cannot run on this data's inputs ([8, 6] float32): RuntimeError: mat1" in err
    assert "hint: distill on inputs like the teacher's" in err


def test_mse_and_bce_take_the_targets_shape_or_say_so(tmp_path, capsys):
    """`kind = "mse"` with a one-output model ([N, 1]) and targets [N] broadcast to [N, N]: a wrong loss, silently
    (a learnable linear target stayed at its variance); `bce_with_logits` with a 3-class model ended in torch's
    ValueError traceback."""
    from dsedge.cli import main
    from dsedge.toolchain.train.config import LossConfig
    from dsedge.toolchain.train.losses import make_loss

    target = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert float(make_loss(LossConfig(kind="mse"))(target.unsqueeze(-1), target)) == 0.0  # perfect prediction
    for kind in ("mse", "bce_with_logits"):
        with pytest.raises(ConfigError, match=rf"\[loss\] kind = '{kind}' needs the model's output and the target "
                                              r"in the same shape; the model gives \[4, 3\] for targets \[4\]"):
            make_loss(LossConfig(kind=kind))(torch.zeros(4, 3), target)
    path = tmp_path / "bce.toml"
    path.write_text(dump_toml(config(tmp_path / "run", loss={"kind": "bce_with_logits"})))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "use kind = 'cross_entropy' for class ids" in err, err


def test_cross_entropy_on_a_single_logit_model_says_so(tmp_path, capsys):
    """The default loss (cross_entropy) with a one-logit binary model: torch's "IndexError: Target 1 is out of
    bounds" traceback (a device-side assert on CUDA)."""
    from dsedge.cli import main
    from dsedge.toolchain.train.config import LossConfig
    from dsedge.toolchain.train.losses import make_loss

    with pytest.raises(ConfigError, match=r"a target is class 1 and the model gives 1 class \(logits \(4, 1\)\)"):
        make_loss(LossConfig())(torch.zeros(4, 1), torch.tensor([0, 1, 1, 0]))
    with pytest.raises(ConfigError, match=r"a target is class -1 and the model gives 3 classes"):
        make_loss(LossConfig())(torch.zeros(4, 3), torch.tensor([0, 1, -1, 0]))
    path = tmp_path / "ce.toml"
    path.write_text(dump_toml(config(tmp_path / "run", model={"kwargs": {"classes": 1}})))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "or kind = 'bce_with_logits' for a single logit" in err


def test_resume_with_another_lamb_threshold_names_the_optimizer(tmp_path, capsys):
    """Rerunning with another [optim] lamb_threshold (parameters move between LAMB and AdamW) said the run "holds
    checkpoints of another model" and pointed at the [model] section, which had not changed."""
    from dsedge.cli import main

    train.run(from_dict(config(tmp_path / "run")))
    cut_back_to_step_3(tmp_path / "run")
    path = tmp_path / "t.toml"
    path.write_text(dump_toml(config(tmp_path / "run", optim={"lamb_threshold": 1024})))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert "holds checkpoints of another optimizer layout (step_3: it has no optim." in err
    assert "hint: restore the [optim] lamb_threshold" in err
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()


def test_token_budget_run_with_a_validation_set_evaluates(tmp_path):
    """Token-budget batches (variable-length sequences) with a validation set: the evaluation stacked the sequences
    without padding and the run ended in a RuntimeError traceback at its first checkpoint."""
    cfg = config(tmp_path / "run", steps=4, checkpoint={"every": 2}, model={"factory": "train_models:make_bag"},
                 data={"factory": "train_models:make_sequences_val", "kwargs": {}, "max_tokens": 40, "batch_size": 4})
    train.run(from_dict(cfg))
    import json

    ev = [e for e in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
          if e.get("event") == "checkpoint"]
    assert [e["step"] for e in ev] == [2, 4] and all(e["val_loss"] > 0 and 0 <= e["val_accuracy"] <= 1 for e in ev)


def test_activation_checkpointing_on_a_model_without_blocks_is_refused(tmp_path):
    """`activation_checkpointing = true` on a model with no ModuleList (and not a Sequential) wrapped nothing and
    trained without recomputing anything, silently."""
    cfg = config(tmp_path / "run", model={"factory": "train_models:make_half_used"},
                 checkpoint={"activation_checkpointing": True})
    with pytest.raises(ConfigError, match=r"activation_checkpointing needs repeated blocks: the model has no "
                                          r"nn.ModuleList and is not an nn.Sequential"):
        train.run(from_dict(cfg))
    assert not (tmp_path / "run").exists()


def test_pos_weight_without_bce_is_refused(tmp_path):
    """`pos_weight` with the default cross_entropy loss was silently unused (`class_weights` with another kind was
    already refused)."""
    with pytest.raises(ConfigError, match=r"\[loss\] pos_weight is for kind = 'bce_with_logits', not 'cross_entropy'"):
        from_dict(config(tmp_path / "run", loss={"pos_weight": 4.0}))
    assert from_dict(config(tmp_path / "run", loss={"kind": "bce_with_logits", "pos_weight": 4.0})).loss.pos_weight == 4


def test_fp16_resume_takes_the_configs_growth_interval(tmp_path):
    """Rerunning an fp16 run with another [precision] growth_interval kept the checkpoint's (the GradScaler state
    holds it): the loss scale kept growing every 2 steps when the config now said every 1000."""
    precision = {"mode": "fp16", "initial_scale": 1024.0, "growth_interval": 2}
    train.run(from_dict(config(tmp_path / "run", precision=precision)))
    cut_back_to_step_3(tmp_path / "run")
    train.run(from_dict(config(tmp_path / "run", precision={**precision, "growth_interval": 1000})))
    scales = [r["loss_scale"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert scales[:3] == [1024.0, 1024.0, 2048.0] and scales[3:] == [2048.0, 2048.0, 2048.0], scales


def test_a_refused_resume_keeps_the_runs_config_toml(tmp_path, capsys):
    """A resume refused because the checkpoints are of another model had already rewritten OUT/config.toml with the
    new config: the run directory then described a model its checkpoints and final/ are not."""
    from dsedge.toolchain.train.config import load_config

    train.run(from_dict(config(tmp_path / "run")))
    cut_back_to_step_3(tmp_path / "run")
    with pytest.raises(ConfigError, match="holds checkpoints of another model"):
        train.run(from_dict(config(tmp_path / "run", model={"kwargs": {"hidden": 48}})))
    assert load_config(tmp_path / "run" / "config.toml").model.kwargs == {}


def test_a_run_failing_at_its_first_step_leaves_no_run_directory(teacher, tmp_path):
    """A loss-shape error or a distill teacher/features error at the first step left OUT/config.toml (and
    metrics.jsonl) behind: the folder looked like a started run. A folder that was there before stays, without it."""
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="needs the model's output and the target in the same shape"):
        train.run(from_dict(config(run, loss={"kind": "bce_with_logits"})))
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="needs the model's output and the target in the same shape"):
        train.run(from_dict(config(run, loss={"kind": "bce_with_logits"})))
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    d = tmp_path / "distill"
    with pytest.raises(ConfigError, match="features: the student's 'embed' gives"):
        distill.run(from_dict(config(d, model={"kwargs": {"d": 8}}, distill={
            "teacher": str(teacher), "features": {"embed": "embed"}, "feature_weight": 1.0}), distill=True))
    assert not d.exists()


def make_data_with_a_nan(nan_index: int, **kw):
    """``train_models.make_data`` whose training sample ``nan_index`` has NaN features."""
    from train_models import make_data

    train_ds, val = make_data(**kw)
    train_ds.tensors[0][nan_index] = float("nan")
    return train_ds, val


def test_a_rollback_skips_the_batch_whose_loss_was_not_finite(tmp_path):
    """A rollback replayed exactly the same batches: one NaN sample in the data came back after every rollback
    until max_rollbacks was exhausted, and the run ended in a TrainingError instead of costing one rollback."""
    import json

    from dsedge.toolchain.train.sampler import ShardedBatchSampler

    batches = list(ShardedBatchSampler(64, 8, seed=0))
    bad = batches[4][0]                                     # a sample of step 5's batch (epoch 0, batch 4)
    cfg = config(tmp_path / "run", data={"factory": "test_train_user_found:make_data_with_a_nan",
                                         "kwargs": {"val": 16, "nan_index": bad}},
                 health={"max_nonfinite": 1, "max_rollbacks": 2})
    result = train.run(from_dict(cfg))
    assert result.steps == 6
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [e for e in lines if e.get("event") == "rollback"]
    assert len(rollbacks) == 1
    assert rollbacks[0]["from_step"] == 5 and rollbacks[0]["to_step"] == 3
    skips = [{k: v for k, v in e.items() if k != "time"} for e in lines if e.get("event") == "skipped_batches"]
    assert skips == [{"event": "skipped_batches", "step": 3, "batches": [{"step": 5, "epoch": 0, "batch": 4}]}]
    steps = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 4, 5, 6] and steps[4][1] is None
    assert all(v is not None for _, v in steps[5:])
    assert steps[5] == steps[3]                             # step 4 replayed on the same batch (after the rollback)
    # the checkpoint carries the data position (one batch ahead of the step) and the skip, for a resume
    trainer = json.loads((tmp_path / "run" / "checkpoints" / "step_6" / "trainer.json").read_text())
    assert trainer["data_position"] == 7 and trainer["skipped_batches"] == [4]


def torchrun_cli_args(tmp_path, verb, cfg, *args):
    path = tmp_path / f"{verb}.toml"
    path.write_text(dump_toml(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dsedge.cli", verb, str(path), "--nproc-per-node", "2", *args],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_max_restarts_does_not_restart_a_ranks_config_error(tmp_path):
    """`--max-restarts 2` restarted the group after a rank's ConfigError (exit 2) twice: the same error three times
    over, as it fails the same way every time. Now it fails once, with exit status 2, and leaves no run behind."""
    import time

    t0 = time.perf_counter()
    proc = torchrun_cli_args(tmp_path, "train", config(tmp_path / "run", device="cpu",
                                                       model={"factory": "train_models:make_half_used"}),
                             "--max-restarts", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert 1 <= out.count("which data-parallel training (DDP) cannot reduce") <= 2, out  # once per rank, one attempt
    assert not (tmp_path / "run" / "config.toml").exists()
    print(f"failed in {time.perf_counter() - t0:.1f} s")


@pytest.mark.parametrize("section, key, value, why", [
    ("parallel", "microbatches", 4, r"\[parallel\] microbatches = 4 has no effect with pipeline = 1"),
    ("parallel", "tensor_plan", {"blocks.*.up": "colwise"}, r"\[parallel\] tensor_plan has no effect with tensor = 1"),
    ("precision", "initial_scale", 1024.0, r"\[precision\] initial_scale = 1024.0 has no effect with mode = 'bf16'"),
    ("precision", "growth_interval", 10, r"\[precision\] growth_interval = 10 has no effect with mode = 'bf16'"),
])
def test_settings_without_effect_are_refused_at_load(tmp_path, section, key, value, why):
    """`microbatches` with pipeline = 1, `tensor_plan` with tensor = 1 and `initial_scale` / `growth_interval` with
    bf16 (no grad scaler) were silently unused. Their default values stay fine."""
    over = {section: {key: value, **({"mode": "bf16"} if section == "precision" else {})}}
    with pytest.raises(ConfigError, match=why) as e:
        from_dict(config(tmp_path / "run", **over))
    assert "\n" not in str(e.value) and e.value.hint
    defaults = {"microbatches": None, "tensor_plan": None, "initial_scale": 65536.0, "growth_interval": 2000}
    from_dict(config(tmp_path / "run", **{section: {**over[section], key: defaults[key]}}))
    if section == "parallel":  # where they do have an effect
        other = {"microbatches": "pipeline", "tensor_plan": "tensor"}[key]
        from_dict(config(tmp_path / "run", parallel={"data": "fsdp", key: value, other: 2}))
    else:
        from_dict(config(tmp_path / "run", precision={"mode": "fp16", key: value}))


def test_comm_hook_with_one_process_is_refused(tmp_path):
    """`comm_hook` with one process (no DDP, nothing to compress) was silently unused."""
    from dsedge.toolchain.train.validation import check_world

    cfg = from_dict(config(tmp_path / "run", device="cpu", parallel={"comm_hook": "fp16"}))
    assert check_world(cfg, 2, "cpu") == 2
    with pytest.raises(ConfigError, match=r"\[parallel\] comm_hook = 'fp16' has no effect with one data-parallel "
                                          r"process") as e:
        check_world(cfg, 1, "cpu")
    assert "remove comm_hook" in e.value.hint
    with pytest.raises(ConfigError, match="comm_hook = 'fp16' has no effect"):
        train.run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_launchers_output_is_clean_and_it_leaves_no_torchelastic_folder(tmp_path):
    """`dsedge train --nproc-per-node 2` passed torchrun's glog lines through ("W1205 06:12:33.123000 1234
    torch/distributed/run.py:874] Setting OMP_NUM_THREADS ...") and left a /tmp/torchelastic_* folder per run."""
    import re

    path, tmp = tmp_path / "train.toml", tmp_path / "tmp"
    path.write_text(dump_toml(config(tmp_path / "run", device="cpu", steps=2, checkpoint={"every": 2})))
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), TMPDIR=str(tmp))
    env.pop("OMP_NUM_THREADS", None)  # torchrun's notice about it is what users saw first
    proc = subprocess.run([sys.executable, "-m", "dsedge.cli", "train", str(path), "--nproc-per-node", "2"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "trained 2 steps, loss " in proc.stdout, out
    assert not re.search(r"^[IWEC]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", out, re.M), out   # no glog prefix
    assert "OMP_NUM_THREADS" not in out and "*****" not in out, out
    assert [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "dsedge-"))] == []


@pytest.mark.slow
def test_a_token_budget_run_resumed_on_another_process_count_is_refused(tmp_path):
    """A token-budget run checkpointed by 1 process resumed under `--nproc-per-node 2`: each step became 2 batches
    (one per rank) where it had been 1, silently: the resumed run was no longer the run it continued."""
    import json

    cfg = config(tmp_path / "run", device="cpu", model={"factory": "train_models:make_bag"},
                 data={"factory": "train_models:make_sequences_val", "kwargs": {}, "max_tokens": 40, "batch_size": 4})
    train.run(from_dict(cfg))
    cut_back_to_step_3(tmp_path / "run")
    trainer = tmp_path / "run" / "checkpoints" / "step_3" / "trainer.json"
    assert json.loads(trainer.read_text())["world_size"] == 1
    proc = torchrun_cli(tmp_path, "train", cfg)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert ("token-budget run checkpointed by 1 process (step_3) cannot resume on 2 processes: each process "
            "takes its own batch per step, so a step would take other batches") in out, out
    assert "hint: resume with --nproc-per-node 1, or set another out_dir for a new run" in out, out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_3"]
    # a checkpoint that does not say how many processes wrote it (an older one) resumes as before
    trainer.write_text(json.dumps({k: v for k, v in json.loads(trainer.read_text()).items() if k != "world_size"}))
    proc = torchrun_cli(tmp_path, "train", cfg)
    assert proc.returncode == 0 and "trained 6 steps" in proc.stdout, proc.stdout + proc.stderr


def test_a_model_whose_forward_does_not_take_the_datas_inputs_is_one_line(tmp_path):
    """A user's pass (2026-12-06): ``forward(features)`` fed two inputs ended in a raw ``TypeError … takes 2
    positional arguments but 3 were given`` (a traceback per rank under the launcher); a distillation teacher's
    mismatch was already one line. The student's is now too, naming the data's inputs."""
    cfg = from_dict(config(tmp_path / "run", model={"factory": "train_models:make_tiny", "input_names": []},
                           data={"factory": "train_models:make_two_input_data", "kwargs": {}}))
    with pytest.raises(ConfigError, match=r"the model \(train_models:make_tiny\) cannot run on this data's inputs "
                                          r"\(\[\d+, 4\] float32, \[\d+\] int64\): TypeError") as e:
        train.run(cfg)
    assert "make forward() take the [data] factory's inputs" in e.value.hint


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for t in os.listdir(f"/proc/{p}/task")
                    for k in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
        out.update(kids)
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    """A user's pass (2026-12-06): `kill PID` of `dsedge train … --nproc-per-node 2` (a job scheduler's stop) ended the
    launcher in 1 s, and its two ranks, re-parented to init, trained on to the end. The launcher now passes SIGTERM
    to torchrun, which stops its ranks."""
    import signal
    import time

    path = tmp_path / "train.toml"
    path.write_text(dump_toml(config(tmp_path / "run", device="cpu", steps=100_000, checkpoint={"every": 100_000})))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    log = open(tmp_path / "launcher.log", "w")  # not a pipe: orphaned ranks would hold it open to their end
    proc = subprocess.Popen([sys.executable, "-m", "dsedge.cli", "train", str(path), "--nproc-per-node", "2"],
                            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
            ranks |= _descendants(proc.pid)
            time.sleep(0.2)
        ranks |= _descendants(proc.pid)
        assert (tmp_path / "run" / "metrics.jsonl").exists(), "the ranks never started training"
        assert len(ranks) >= 3  # torchrun and its two ranks
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not [p for p in ranks if _alive(p)], (tmp_path / "launcher.log").read_text()
    finally:  # orphans too (what the bug left)
        for p in ranks | _descendants(proc.pid) | {proc.pid}:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        log.close()
