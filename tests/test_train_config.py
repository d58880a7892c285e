"""The training config: TOML/YAML loading, clear errors for unknown keys, bad values and impossible meshes."""
from __future__ import annotations

import pytest

from dsedge.runtime.errors import ConfigError
from dsedge.toolchain.train.config import dump_toml, from_dict, load_config
from dsedge.toolchain.train.validation import check_world

BASE = """
seed = 3
out_dir = "runs/x"
steps = 10
[model]
factory = "pkg.model:make"
kwargs = { hidden = 8 }
input_names = ["dense", "ids"]
[data]
factory = "pkg.data:make"
batch_size = 8
[optim]
lr = 0.002
betas = [0.9, 0.95]
[parallel]
data = "fsdp"
tensor = 2
"""


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_toml_loads_with_defaults(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert (cfg.seed, cfg.steps, cfg.out_dir) == (3, 10, "runs/x")
    assert cfg.model.kwargs == {"hidden": 8} and cfg.model.input_names == ["dense", "ids"]
    assert cfg.optim.lr == 0.002 and cfg.optim.betas == [0.9, 0.95]
    assert cfg.optim.weight_decay == 0.01 and cfg.optim.eps == 1e-6 and cfg.optim.lamb_threshold == 1024
    assert cfg.optim.clip_grad_norm == 1.0 and cfg.schedule.warmup_fraction == 0.1
    assert (cfg.parallel.data, cfg.parallel.tensor, cfg.parallel.pipeline) == ("fsdp", 2, 1)
    assert cfg.distill is None


def test_yaml_equals_toml(tmp_path):
    yaml_text = """
seed: 3
out_dir: runs/x
steps: 10
model: {factory: "pkg.model:make", kwargs: {hidden: 8}, input_names: [dense, ids]}
data: {factory: "pkg.data:make", batch_size: 8}
optim: {lr: 0.002, betas: [0.9, 0.95]}
parallel: {data: fsdp, tensor: 2}
"""
    a = load_config(write(tmp_path, BASE)).to_dict()
    b = load_config(write(tmp_path, yaml_text, "c.yaml")).to_dict()
    assert a == b


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    again = load_config(write(tmp_path, dump_toml(cfg.to_dict()), "resolved.toml"))
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("edit, message, hint", [
    (("lr = 0.002", "lrr = 0.002"), "unknown key 'lrr' in [optim]", "did you mean 'lr'?"),
    (("seed = 3", "sed = 3"), "unknown key 'sed' in the top level", "did you mean 'seed'?"),
    (("batch_size = 8", "batch_size = \"8\""), "[data] batch_size must be int", ""),
    (("data = \"fsdp\"", "data = \"zero3\""), "[parallel] data = 'zero3' is not one of", "ddp"),
    (("steps = 10", "steps = 10\nepochs = 2"), "give exactly one of steps or epochs", ""),
    # a user's pass: steps = 1e19 trained at lr ~1e-17 (warm-up) and wrote 9 GB of checkpoints in 200 s
    (("steps = 10", "steps = 10000000000000000000"), "steps = 10000000000000000000 is more than 1,000,000,000",
     "steps = 1000"),
    (("factory = \"pkg.model:make\"", "factory = \"pkg.model\""), "[model] factory must be 'module:function'", ""),
    (("betas = [0.9, 0.95]", "betas = [0.9]"), "[optim] betas must be two numbers", ""),
])
def test_errors_name_file_section_and_key(tmp_path, edit, message, hint):
    path = write(tmp_path, BASE.replace(*edit))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and str(path) in str(e.value)
    assert hint in e.value.hint
    assert "\n" not in str(e.value)


def test_parse_error_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "steps = = 3"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_impossible_mesh_for_world_size(tmp_path):
    cfg = load_config(write(tmp_path, BASE))  # tensor = 2
    assert check_world(cfg, 4) == 2
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        check_world(cfg, 3)
    cfg.data.batch_size = 6
    with pytest.raises(ConfigError, match="batch_size = 6 is not divisible by the data-parallel degree 4"):
        check_world(cfg, 8)


def test_meshes_ddp_cannot_run_are_refused_before_launch(tmp_path, capsys):
    """Found by a user: `--nproc-per-node 4` with data = 'ddp', tensor = 2 (and comm_hook = 'bf16' on CPU) started
    torchrun, printed the error once per rank, then torchrun's ChildFailedError traceback, and left OUT/config.toml."""
    from dsedge.cli import main

    cfg = load_config(write(tmp_path, BASE.replace('data = "fsdp"', 'data = "ddp"')))
    assert check_world(cfg, 2) == 1                     # dp = 1: no DDP wrapper, tensor parallel alone is fine
    with pytest.raises(ConfigError, match="data = 'ddp' cannot be combined with tensor or pipeline parallel"):
        check_world(cfg, 4)
    cfg = load_config(write(tmp_path, BASE.replace("tensor = 2", 'comm_hook = "bf16"').replace("fsdp", "ddp")))
    assert check_world(cfg, 2, "cuda") == 2
    with pytest.raises(ConfigError, match="comm_hook = 'bf16' needs the NCCL backend"):
        check_world(cfg, 2, "cpu")
    run = tmp_path / "run"
    path = write(tmp_path, BASE.replace('data = "fsdp"', 'data = "ddp"').replace('out_dir = "runs/x"',
                                                                             f'out_dir = "{run}"\ndevice = "cpu"'))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path), "--nproc-per-node", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and "cannot be combined" in err and "Traceback" not in err
    assert not run.exists()


def test_distill_needs_teacher(tmp_path):
    with pytest.raises(ConfigError, match=r"needs a \[distill\] section"):
        load_config(write(tmp_path, BASE), distill=True)
    cfg = load_config(write(tmp_path, BASE + '\n[distill]\nteacher = "runs/t"\nalpha = 0.5\n'), distill=True)
    assert cfg.distill.teacher == "runs/t" and cfg.distill.temperature == 4.0 and cfg.distill.alpha == 0.5


def test_cli_prints_one_line_error_without_traceback(tmp_path, capsys):
    from dsedge.cli import main

    path = write(tmp_path, BASE.replace("lr = 0.002", "lrr = 0.002"))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "unknown key 'lrr'" in err and "hint: did you mean 'lr'?" in err
    assert "Traceback" not in err


def test_from_dict_validates():
    with pytest.raises(ConfigError, match="out_dir is missing"):
        from_dict({"steps": 1, "model": {"factory": "a:b"}, "data": {"factory": "a:b"}})


def test_a_missing_data_file_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    """Found by a fresh user: the traceback of a FileNotFoundError, and OUT/config.toml written before it."""
    from pathlib import Path

    from dsedge.cli import main

    text = (Path(__file__).resolve().parents[1] / "samples" / "fraud" / "teacher.toml").read_text()
    run = tmp_path / "run"
    missing = tmp_path / "nope.csv"
    text = text.replace('out_dir = "out/fraud/teacher-run"', f'out_dir = "{run}"')
    text = text.replace("../shared/data/creditcard-fraud-ulb/creditcard_fraud_subsample.csv", str(missing))
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"no such file or directory ({missing})" in err and "Traceback" not in err, err
    assert not run.exists()


@pytest.mark.parametrize("edit, message", [
    (("lr = 0.002", "lr = nan"), "[optim] lr must be a finite number > 0, got nan"),
    (("lr = 0.002", "lr = inf"), "[optim] lr must be a finite number > 0, got inf"),
    (("lr = 0.002", "lr = 0.002\neps = -1.0"), "[optim] eps must be a finite number > 0, got -1.0"),
    (("lr = 0.002", "lr = 0.002\neps = nan"), "[optim] eps must be a finite number > 0, got nan"),
    (("lr = 0.002", "lr = 0.002\nweight_decay = -1.0"), "[optim] weight_decay must be a finite number >= 0, got -1.0"),
    (("tensor = 2", "tensor = 2\n[loss]\nclass_weights = [1.0, -4.0]"), "[loss] class_weights must be finite numbers"),
    (("tensor = 2", "tensor = 2\n[loss]\nclass_weights = [1.0, nan]"), "[loss] class_weights must be finite numbers"),
    (("tensor = 2", "tensor = 2\n[loss]\nclass_weights = [0.0, 0.0]"), "[loss] class_weights must be finite numbers"),
    (("tensor = 2", "tensor = 2\n[loss]\nclass_weights = []"), "[loss] class_weights must be finite numbers"),
    (("tensor = 2", "tensor = 2\n[loss]\nclass_weights = [1.0, \"4\"]"), "[loss] class_weights must be finite numbers"),
    (("tensor = 2", "tensor = 2\n[loss]\nkind = \"mse\"\nclass_weights = [1.0, 4.0]"),
     "[loss] class_weights is for kind = 'cross_entropy', not 'mse'"),
    (("tensor = 2", "tensor = 2\n[loss]\nkind = \"bce_with_logits\"\npos_weight = -2.0"),
     "[loss] pos_weight must be a finite number > 0, got -2.0"),
])
def test_nan_negative_and_impossible_optim_and_loss_values_are_config_errors(tmp_path, edit, message):
    """Found by a user: lr = nan and eps = -1.0 died in torch with a traceback, weight_decay = -1.0 and negative
    class weights trained (to a negative loss) and exited 0."""
    path = write(tmp_path, BASE.replace(*edit))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and str(path) in str(e.value) and e.value.hint
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit, message", [
    (("betas = [0.9, 0.95]", 'betas = ["a", "b"]'), "[optim] betas must be two numbers in [0, 1)"),
    (("tensor = 2", "tensor = 2\n[schedule]\nmin_lr_ratio = -2.0"), "[schedule] min_lr_ratio must be in [0, 1]"),
    (("tensor = 2", "tensor = 2\n[schedule]\nmin_lr_ratio = nan"), "[schedule] min_lr_ratio must be in [0, 1]"),
    (("tensor = 2", "tensor = 2\n[checkpoint]\nkeep = 0"), "[checkpoint] keep must be > 0, got 0"),
    (("tensor = 2", "tensor = 2\n[precision]\nmode = \"fp16\"\ninitial_scale = 0.0"),
     "[precision] initial_scale must be a finite number > 0, got 0.0"),
    (("tensor = 2", "tensor = 2\n[precision]\ngrowth_interval = 0"), "[precision] growth_interval must be > 0"),
    (("tensor = 2", "tensor = 2\npowersgd_rank = 0"), "[parallel] powersgd_rank must be > 0"),
    (("tensor = 2", "tensor = 2\n[health]\nmax_rollbacks = -1"), "[health] max_rollbacks must be >= 0"),
    (("batch_size = 8", "batch_size = 8\nmax_tokens = 0"), "[data] max_tokens must be > 0, got 0"),
    (("batch_size = 8", "batch_size = 8\nmemory_limit_mb = nan\nbytes_per_token = 4.0"),
     "[data] memory_limit_mb must be a finite number > 0, got nan"),
    (("batch_size = 8", "batch_size = 8\nmemory_limit_mb = inf\nbytes_per_token = 4.0"),
     "[data] memory_limit_mb must be a finite number > 0, got inf"),
    (("batch_size = 8", "batch_size = 8\nmemory_limit_mb = 1.0\nbytes_per_token = -4.0"),
     "[data] bytes_per_token must be a finite number > 0"),
    (('input_names = ["dense", "ids"]', "input_names = [1, 2]"), "[model] input_names must be a list of distinct"),
    (('input_names = ["dense", "ids"]', 'input_names = ["dense", "dense"]'),
     "[model] input_names must be a list of distinct"),
    (('input_names = ["dense", "ids"]', "output_names = []"), "[model] output_names must be a non-empty list"),
    (("tensor = 2", "tensor = 2\n[domains]\nweights = { a = -1, b = 1 }"), "[domains] weights must be finite"),
    (("tensor = 2", "tensor = 2\n[domains]\nthreshold = nan"), "[domains] threshold must be a finite number"),
    (("tensor = 2", "tensor = 2\n[augment]\nlevels = [nan]"), "[augment] levels must be increasing numbers"),
])
def test_out_of_range_values_beyond_the_contract_are_config_errors(tmp_path, edit, message):
    """Found by a user: keep = 0 deleted every checkpoint (the last too) and exited 0, min_lr_ratio = -2 trained
    with a negative lr, memory_limit_mb = nan / inf and betas = ["a", "b"] died with a traceback, initial_scale = 0
    made every fp16 step non-finite, output_names = [] / input_names = [1] trained a run `dsedge build` cannot load."""
    path = write(tmp_path, BASE.replace(*edit))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and str(path) in str(e.value) and e.value.hint
    assert "\n" not in str(e.value)


def test_class_weights_are_checked_against_the_logits_classes():
    import torch

    from dsedge.toolchain.train.config import LossConfig
    from dsedge.toolchain.train.losses import make_loss

    logits, y = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    for weights in ([1.0], [1.0, 4.0, 2.0]):
        with pytest.raises(ConfigError, match=rf"class_weights has {len(weights)} weights? but the model gives 2 "
                                              r"classes \(logits \(2, 2\)\)") as e:
            make_loss(LossConfig(class_weights=weights))(logits, y)
        assert e.value.hint == "give 2 weights, one per class"
    assert float(make_loss(LossConfig(class_weights=[1.0, 4.0]))(logits, y)) > 0


def _fraud_config(tmp_path, data_dir, run, *edits):
    """The fraud sample's teacher.toml, 3 steps, out_dir ``run``, the real CSV, ``edits`` (old, new) applied."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "samples" / "fraud" / "teacher.toml").read_text()
    csv = data_dir / "creditcard-fraud-ulb" / "creditcard_fraud_subsample.csv"
    edits = (('out_dir = "out/fraud/teacher-run"', f'out_dir = "{run}"'), ("steps = 1000", "steps = 3"),
             ("../shared/data/creditcard-fraud-ulb/creditcard_fraud_subsample.csv", str(csv))) + edits
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    return write(tmp_path, text)


@pytest.mark.parametrize("weights", ["[1.0]", "[1.0, 4.0, 2.0]"])
def test_cli_class_weights_of_the_wrong_length_stop_before_a_step_without_traceback(tmp_path, capsys, shared_data,
                                                                                     weights):
    """Found by a user: a RuntimeError traceback from torch mid-run. The fraud model gives 2 classes."""
    from dsedge.cli import main

    run = tmp_path / "run"
    path = _fraud_config(tmp_path, shared_data, run, ("class_weights = [1.0, 4.0]", f"class_weights = {weights}"))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    n = weights.count(",") + 1
    assert e.value.code == 2 and "Traceback" not in err, err
    assert f"error: [loss] class_weights has {n} weight" in err and "the model gives 2 classes" in err, err
    assert not run.exists()  # found by a user: OUT/config.toml and metrics.jsonl were written before the check


@pytest.mark.parametrize("verb", ["train", "distill"])
def test_class_weights_of_the_wrong_length_leave_no_run_directory(tmp_path, capsys, verb):
    """`dsedge train` / `dsedge distill`: the class count is the model's (the config cannot know it), so one sample
    goes through the model before the run directory is written; a 3-class model with 2 weights leaves nothing."""
    from dsedge.cli import main
    from train_models import config

    run = tmp_path / "run"
    cfg = config(run, loss={"class_weights": [1.0, 2.0]}, device="cpu")
    if verb == "distill":
        cfg["distill"] = {"teacher": str(tmp_path / "teacher")}
        teacher = config(tmp_path / "teacher", steps=1, device="cpu")
        with pytest.raises(SystemExit) as e:
            main(["train", str(write(tmp_path, dump_toml(teacher), "teacher.toml"))])
        assert e.value.code == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([verb, str(write(tmp_path, dump_toml(cfg)))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert "error: [loss] class_weights has 2 weights but the model gives 3 classes" in err, err
    assert not run.exists()


def test_cli_nan_lr_is_one_line_and_leaves_no_run_directory(tmp_path, capsys, shared_data):
    from dsedge.cli import main

    run = tmp_path / "run"
    path = _fraud_config(tmp_path, shared_data, run, ("lr = 1e-3", "lr = nan"))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "[optim] lr must be a finite number > 0, got nan" in err and "Traceback" not in err
    assert not run.exists()


def _cuda_config(tmp_path):
    from train_models import config

    return write(tmp_path, dump_toml(config(tmp_path / "run", device="cuda")))


def test_a_rank_without_a_gpu_fails_fast_under_torchrun(tmp_path):
    """A rank as torchrun starts it (LOCAL_RANK 1 of WORLD_SIZE 2) with device = 'cuda' on a host without a usable
    GPU: one line, exit 2, before init_process_group (where it would wait for the other rank: the timeout says so),
    and no run directory."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(Path(__file__).parent)
    env = dict(os.environ, LOCAL_RANK="1", RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", DSEDGE_PG_TIMEOUT="30",
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "dsedge.cli", "train", str(_cuda_config(tmp_path))], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "device = 'cuda' but no CUDA GPU is visible" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_local_rank_past_the_visible_gpus_is_refused_before_the_process_group(tmp_path, monkeypatch):
    """More ranks per node than GPUs (LOCAL_RANK 1, one GPU): a ConfigError naming both, not torch's "invalid device
    ordinal" from set_device, and never init_process_group. The GPU count is faked (this host has none)."""
    import torch

    from dsedge.toolchain.train import parallel

    def no_group(*a, **kw):
        raise AssertionError("init_process_group reached")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i})"))
    monkeypatch.setattr(parallel.dist, "init_process_group", no_group)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(_cuda_config(tmp_path))
    with pytest.raises(ConfigError, match=r"this process is local rank 1 and only 1 CUDA GPU is visible") as e:
        parallel.init_distributed(cfg)
    assert e.value.hint == "start at most 1 process per node (--nproc-per-node 1), one per GPU"


def test_more_processes_than_gpus_are_refused_before_torchrun_starts(tmp_path, capsys, monkeypatch):
    """`dsedge train --nproc-per-node 2` with device = 'cuda' and no GPU: one line from the launcher (it started
    torchrun, whose ranks each printed the error, then its ChildFailedError traceback)."""
    from dsedge.cli import main
    from dsedge.toolchain.commands import train as train_cmd

    import torch

    monkeypatch.setattr(train_cmd, "launch_torchrun", lambda *a: pytest.fail("torchrun launched"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as e:
        main(["train", str(_cuda_config(tmp_path)), "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert "--nproc-per-node 2 on CUDA and no CUDA GPU visible" in err
    assert not (tmp_path / "run").exists()
