"""Multi-domain sampling (threshold rule, DoReMi update) and plateau-driven augmentation: the rules in process, the
trainer under real torchrun (2 gloo processes): one domain schedule on every rank, exact resume, a plateau step."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsedge.runtime.errors import ConfigError
from dsedge.toolchain.train.config import dump_toml, from_dict
from dsedge.toolchain.train.domains import DomainBatchSampler, DomainWeights, MultiDomain
from dsedge.toolchain.train.plateau import PlateauMonitor

TESTS = Path(__file__).parent
NAMES = ["clean", "noisy", "random"]


class Domain(torch.utils.data.Dataset):
    """x [8] float32 → label in 0..2 from a fixed linear map, with ``noise`` of the labels replaced at random.
    Augmentation adds ``strength``·N(0, 1) to x. With ``log`` set, each served item appends
    ``strength name index`` to ``log`` + ``.rank{RANK}``."""

    def __init__(self, name: str, n: int, noise: float, seed: int, log: str | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        w = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))
        y = (self.x @ w).argmax(1)
        flip = torch.rand(n, generator=g) < noise
        self.y = torch.where(flip, torch.randint(0, 3, (n,), generator=g), y)
        self.name, self.log, self.strength = name, log, 0.0

    def __len__(self) -> int:
        return len(self.y)

    def set_augment_strength(self, strength: float) -> None:
        self.strength = strength

    def __getitem__(self, i: int):
        if self.log:
            with open(f"{self.log}.rank{os.environ.get('RANK', 0)}", "a") as f:
                f.write(f"{self.strength} {self.name} {i}\n")
        x = self.x[i]
        if self.strength:
            x = x + self.strength * torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, self.y[i]


def make_domains(log: str | None = None, n: int = 48):
    train = {nm: Domain(nm, n, noise, 10 + k, log) for k, (nm, noise) in enumerate(zip(NAMES, (0.0, 0.3, 1.0)))}
    val = {nm: Domain(nm, 16, noise, 20 + k) for k, (nm, noise) in enumerate(zip(NAMES, (0.0, 0.3, 1.0)))}
    return train, val


# ------------------------------------------------------------------------------------------------------ the rules
def test_doremi_update_is_the_exponentiated_excess_loss_mixed_with_uniform():
    w = DomainWeights(NAMES, "doremi", {"clean": 2, "noisy": 1, "random": 1}, eta=0.5, smoothing=1e-3)
    losses = {"clean": 0.2, "noisy": 0.7, "random": 1.1}
    got = w.update(losses)
    raw = [0.5 * math.exp(0), 0.25 * math.exp(0.5 * 0.5), 0.25 * math.exp(0.5 * 0.9)]
    want = [(1 - 1e-3) * r / sum(raw) + 1e-3 / 3 for r in raw]
    assert [got[n] for n in NAMES] == pytest.approx(want, abs=1e-12)
    assert got["random"] > 0.25 and got["clean"] < 0.5  # weight moved to the weakest domain


def test_threshold_rule_raises_reached_domains_by_a_capped_step():
    w = DomainWeights(NAMES, "threshold", metric="val_accuracy", threshold=0.9, step=0.15, max_weight=0.6)
    acc = {"clean": 0.95, "noisy": 0.6, "random": 0.3}
    first = w.update(acc)
    assert first["clean"] == pytest.approx(1 / 3 + 0.15)
    assert first["noisy"] == pytest.approx(first["random"]) and sum(first.values()) == pytest.approx(1)
    for _ in range(5):
        last = w.update(acc)
    assert last["clean"] == pytest.approx(0.6)  # capped
    assert w.update({"clean": 0.1, "noisy": 0.1, "random": 0.1}) == last  # nothing reached: unchanged
    fixed = DomainWeights(NAMES, "threshold", {"clean": 1, "noisy": 1, "random": 2})
    assert fixed.update(acc) == {"clean": 0.25, "noisy": 0.25, "random": 0.5}  # no threshold: a fixed mixture


def test_sampler_is_a_function_of_seed_step_and_weights():
    train, _ = make_domains()
    data = MultiDomain(train)
    w = DomainWeights(NAMES, initial={"clean": 0.7, "noisy": 0.2, "random": 0.1})
    one = DomainBatchSampler(data, w, 16, seed=3)
    ranks = [DomainBatchSampler(data, w, 16, dp_rank=r, dp=2, seed=3) for r in range(2)]
    assert [a + b for a, b in zip(*ranks)] == list(one)  # the ranks' shards tile the one-process batch
    assert list(ranks[0]) != list(ranks[1])
    assert list(DomainBatchSampler(data, w, 16, seed=3)) == list(one)
    assert list(DomainBatchSampler(data, w, 16, seed=4)) != list(one)
    doms = [d for s in range(300) for d in one.global_batch_at(s)[0]]
    share = [doms.count(k) / len(doms) for k in range(3)]
    assert share == pytest.approx([0.7, 0.2, 0.1], abs=0.02)
    one.set_position(*one.locate(5))
    assert next(iter(one)) == one.global_batch_at(5)[1]


def test_plateau_monitor_steps_after_patience_and_survives_a_state_round_trip():
    m = PlateauMonitor([0.2, 0.4, 0.6], min_improvement=0.005, patience=3)
    assert [m.update(v) for v in (1.0, 0.98, 0.978, 0.976)] == [False, False, False, False]
    assert m.stale == 2 and m.strength == 0.2  # 0.978 and 0.976 improve by < 0.5 %
    clone = PlateauMonitor([0.2, 0.4, 0.6])
    clone.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert clone.update(0.975) and clone.strength == 0.4 and clone.stale == 0
    assert not clone.update(0.9)  # a real improvement resets the count
    assert [clone.update(0.9) for _ in range(6)] == [False, False, True, False, False, False]
    assert clone.strength == 0.6  # the last level stays


def test_domain_and_augment_config_errors(tmp_path):
    base = {"out_dir": str(tmp_path), "steps": 2, "model": {"factory": "train_models:make_tiny"},
            "data": {"factory": "test_train_domains:make_domains", "batch_size": 8}}
    with pytest.raises(ConfigError, match="rule = 'dormi' is not one of"):
        from_dict({**base, "domains": {"rule": "dormi"}})
    with pytest.raises(ConfigError, match="needs \\[loss\\] kind = 'cross_entropy'"):
        from_dict({**base, "loss": {"kind": "mse"}, "domains": {"metric": "val_accuracy", "threshold": 0.9}})
    with pytest.raises(ConfigError, match="levels must be increasing"):
        from_dict({**base, "augment": {"levels": [0.4, 0.2]}})
    with pytest.raises(ConfigError, match="unknown domains"):
        DomainWeights(NAMES, initial={"cleen": 1.0})


# ------------------------------------------------------------------------------------------------------ torchrun
def _config(out: Path) -> dict:
    return {"out_dir": str(out), "seed": 5, "steps": 12,
            "model": {"factory": "train_models:make_tiny"},
            "data": {"factory": "test_train_domains:make_domains", "kwargs": {"log": str(out / "served")},
                     "batch_size": 8},
            "optim": {"lr": 1e-8},  # the validation loss stays flat: a synthetic plateau
            "checkpoint": {"every": 2},
            "domains": {"rule": "doremi", "eta": 4.0},
            "augment": {"levels": [0.0, 0.5, 1.0], "patience": 3}}


def _torchrun(cfg_path: Path, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--log-dir={cwd / 'torchrun-logs'}", str(TESTS / "train_dist_driver.py"), str(cfg_path)]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _events(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "checkpoint":
            out[rec["step"]] = rec  # a resumed run's record of a step replaces the earlier one
    return out


def _served(run: Path, rank: int, local: int) -> list[list[tuple]]:
    lines = (run / f"served.rank{rank}").read_text().split("\n")[1:-1]  # the first: the trainer's example item
    items = [(float(s), nm, int(i)) for s, nm, i in (x.split() for x in lines)]
    return [items[k:k + local] for k in range(0, len(items), local)]


@pytest.mark.distributed
def test_torchrun_same_schedule_exact_resume_and_plateau_step(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "a.toml").write_text(dump_toml(_config(a)))
    _torchrun(tmp_path / "a.toml", tmp_path)
    ev = _events(a)
    assert sorted(ev) == [2, 4, 6, 8, 10, 12]
    for e in ev.values():  # per-domain losses and weights logged each evaluation
        assert set(e["domain_val_loss"]) == set(NAMES) and set(e["domain_weights"]) == set(NAMES)
    loss2, w2 = ev[2]["domain_val_loss"], ev[2]["domain_weights"]
    assert w2[max(loss2, key=loss2.get)] > 1 / 3 > w2[min(loss2, key=loss2.get)]  # towards the weakest domain
    # plateau: evaluations 2, 3, 4 (steps 4, 6, 8) improve by < 0.5 % → strength 0.0 → 0.5 at step 8
    assert [ev[s]["augment_strength"] for s in (2, 4, 6, 8, 10)] == [0.0, 0.0, 0.0, 0.5, 0.5]
    aug = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines() if '"augment"' in x]
    assert [(r["step"], r["strength"]) for r in aug] == [(8, 0.5)]

    # every rank drew the same global batch: rank r served the r-th half of the one-process draw
    train, _ = make_domains()
    data = MultiDomain(train)
    w = DomainWeights(NAMES)
    ref = DomainBatchSampler(data, w, 8, seed=5)
    shards = [_served(a, r, 4) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 12
    for step in range(12):
        if step >= 2 and step % 2 == 0:
            w.weights = [ev[step]["domain_weights"][n] for n in NAMES]
        _, idx = ref.global_batch_at(step)
        strength = 0.5 if step >= 8 else 0.0
        for r in range(2):
            assert [data.offsets[NAMES.index(nm)] + i for _, nm, i in shards[r][step]] == idx[4 * r:4 * r + 4]
            assert {s for s, _, _ in shards[r][step]} == {strength}
        assert shards[0][step] != shards[1][step]

    # resume from step 6: the weights, the plateau count and the batches carry on exactly
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for s in (8, 10, 12):
        shutil.rmtree(b / "checkpoints" / f"step_{s}")
    shutil.rmtree(b / "final")
    for r in range(2):
        (b / f"served.rank{r}").unlink()
    (tmp_path / "b.toml").write_text(dump_toml(_config(b)))
    _torchrun(tmp_path / "b.toml", tmp_path)
    eb = _events(b)
    for s in (8, 10, 12):
        assert eb[s]["domain_weights"] == pytest.approx(ev[s]["domain_weights"], abs=1e-12)
        assert eb[s]["domain_val_loss"] == pytest.approx(ev[s]["domain_val_loss"], abs=1e-9)
    assert eb[8]["augment_strength"] == 0.5  # the plateau count (2 at step 6) came back with the checkpoint
    for r in range(2):
        assert _served(b, r, 4) == shards[r][6:]


def test_ct_random_erasing_spares_lesion_cells_and_is_off_by_default():
    import numpy as np

    from samples.ct.data import CELL, LesionPatches, _erase

    lab = np.zeros((16, 16, 16), dtype=np.int64)
    lab[6:10, 6:10, 6:10] = 1
    img = np.full((32, 32, 32), 0.5, dtype=np.float32)
    changed = 0
    for k in range(200):
        out = _erase(img, lab, np.random.default_rng(k))
        diff = np.argwhere(out != img)
        changed += len(diff) > 0
        assert not lab[tuple((diff // CELL).T)].any()  # no erased voxel lies in a lesion cell
    assert 20 < changed < 200
    ds = LesionPatches.__new__(LesionPatches)
    ds.erase_p = 0.0
    ds.set_augment_strength(0.4)
    assert ds.erase_p == 0.4
