"""Before/after of plateau-driven augmentation on the CT detector: ``python -m samples.ct plateau``.

Two arms, the same seeds: ``fixed`` trains the student architecture from scratch with ``dsedge train`` and the
sample's augmentations; ``plateau`` is the same config plus ``[augment] levels = [0.0, 0.2, 0.4]``: random erasing
starts off and the trainer's plateau monitor raises its probability one step each time the validation loss has
improved by < 0.5 % for 3 evaluations. Each run is scored by FROC on the held-out volume (torch fp32, same
lesions for every run); the summary gives mean ± sd over seeds per arm.

Until the monitor first fires the two arms train bit-identically (erasing at probability 0 draws no random
numbers, the monitor draws none either). So the ``plateau`` run of a seed is trained only when the monitor, replayed
on the ``fixed`` run's validation losses, would fire; otherwise its row is the fixed row, marked
``identical_to_fixed``.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .evaluate import FP_RATES, ModelEntry, evaluate

LEVELS = [0.0, 0.2, 0.4]


TRAIN_VOLUME = "../shared/data/ct-chest-lung-pet-ct-dx-a0002"


def config(out_dir: Path, seed: int, steps: int, every: int, plateau: bool,
           volume: str = TRAIN_VOLUME) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "seed": seed, "out_dir": str(out_dir), "steps": steps,
        "model": {"factory": "samples.ct.model:make_student", "kwargs": {"widths": [8, 16, 32]},
                  "input_names": ["patch", "meta"], "output_names": ["cell_logits"]},
        "data": {"factory": "samples.ct.data:make_datasets",
                 "kwargs": {"volume": volume, "train_scans": 3,
                            "val_scans": 1, "lesions_per_scan": 12, "train_items": 4096, "val_items": 128,
                            "seed": 0},
                 "batch_size": 16},
        "loss": {"kind": "samples.ct.model:cell_loss"},
        "optim": {"lr": 3e-3, "weight_decay": 1e-4, "clip_grad_norm": 5.0},
        "schedule": {"warmup_fraction": 0.05},
        "checkpoint": {"every": every, "keep": 1},
    }
    if plateau:
        cfg["augment"] = {"levels": LEVELS, "min_improvement": 0.005, "patience": 3}
    return cfg


def _events(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "event" in r]


def _would_fire(val_losses: list[float]) -> bool:
    """Whether the monitor raises at any of these evaluations (the last one, at the final step, never acts)."""
    from dsedge.toolchain.train.plateau import PlateauMonitor

    m = PlateauMonitor(LEVELS, 0.005, 3)
    return any(m.update(v) for v in val_losses)


def run_experiment(out: Path, seeds: list[int], steps: int, every: int, scans: list, threads: int = 2,
                   log=print, train_volume: str = TRAIN_VOLUME) -> dict[str, Any]:
    from dsedge.toolchain.train.config import dump_toml

    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"fixed": [], "plateau": []}
    for seed in seeds:
        for arm in runs:
            if arm == "plateau" and not _would_fire(runs["fixed"][-1]["val_loss"][:-1]):
                row = {**runs["fixed"][-1], "identical_to_fixed": True}
                log(json.dumps({"arm": arm, **row}))
                runs[arm].append(row)
                continue
            run_dir = out / f"{arm}-s{seed}"
            cfg_path = out / f"{arm}-s{seed}.toml"
            cfg_path.write_text(dump_toml(config(run_dir, seed, steps, every, arm == "plateau", train_volume)))
            if not (run_dir / "final" / "model.json").is_file():
                p = subprocess.run([sys.executable, "-m", "dsedge", "train", str(cfg_path)], text=True,
                                   capture_output=True)
                if p.returncode:
                    from dsedge import DsedgeError

                    sys.stderr.write(p.stderr[-1500:])
                    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
                    raise DsedgeError(f"dsedge train {cfg_path} failed (exit {p.returncode})"
                                      + (f": {lines[-1][:300]}" if lines else ""), "see the output above")
            cached = run_dir / "froc_row.json"
            if cached.is_file():  # scored already (seeds can run in separate processes, then be summarised)
                row = json.loads(cached.read_text())
                log(json.dumps({"arm": arm, **row}))
                runs[arm].append(row)
                continue
            ev = _events(run_dir)
            vals = [e["val_loss"] for e in ev if e["event"] == "checkpoint"]
            raised = [(e["step"], e["strength"]) for e in ev if e["event"] == "augment"]
            name = f"{arm} s{seed}"
            res = evaluate([ModelEntry(name, "torch", str(run_dir))], scans, threads=threads, repeats=1,
                           batch_sizes={name: 16})["models"][name]["froc"]   # FROC only: one timed pass
            row = {"seed": seed, "val_loss": vals, "augment_raised": raised,
                   "sensitivity_at": res["sensitivity_at"], "cpm": res["cpm"]}
            cached.write_text(json.dumps(row))
            log(json.dumps({"arm": arm, **row}))
            runs[arm].append(row)
    summary = {}
    for arm, rows in runs.items():
        keys = [f"{r:g}" for r in FP_RATES]
        figs = {f"sens@{k}": [float(r["sensitivity_at"][k]) for r in rows] for k in keys}
        figs["cpm"] = [float(r["cpm"]) for r in rows]
        figs["final_val_loss"] = [r["val_loss"][-1] for r in rows]
        summary[arm] = {k: {"mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0,
                            "values": v} for k, v in figs.items()}
    return {"steps": steps, "every": every, "levels": LEVELS, "seeds": seeds, "runs": runs, "summary": summary}


def markdown(result: dict[str, Any]) -> str:
    cols = [f"sens@{r:g}" for r in FP_RATES] + ["cpm", "final_val_loss"]
    lines = ["| arm | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for arm, s in result["summary"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{s[c]['mean']:.3f} ± {s[c]['sd']:.3f}" for c in cols) + " |")
    return "\n".join(lines)
