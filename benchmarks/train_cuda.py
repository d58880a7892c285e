"""GPU check for the precision policy (run by hand where a CUDA GPU is lent): fp32 vs bf16 vs fp16 + GradScaler.

Prints, per mode: median step time (ms), the loss after N steps, the fp16 loss-scale trajectory, peak CUDA memory
(bytes), and whether the LayerNorm outputs stay fp32 under autocast. Usage:
    python benchmarks/train_cuda.py [--device cuda] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dsedge.toolchain.train import train  # noqa: E402
from dsedge.toolchain.train.config import from_dict  # noqa: E402
from dsedge.toolchain.train.metrics import read_metrics  # noqa: E402
from dsedge.toolchain.train.precision import PrecisionPolicy  # noqa: E402

# torch.distributed.checkpoint says so on every single-process save (the trainer's final checkpoint): harmless here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming the "
                        "intent is to save in a single process", category=UserWarning)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit(f"train_cuda.py: torch {torch.__version__} sees no CUDA GPU here; run it where one is lent "
                 "(or pass --device cpu to try it)")
    model_kw = {"din": 256, "d": 1024, "hidden": 4096, "classes": 10, "depth": 4}
    if cuda:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(args.device)}")
    policy = PrecisionPolicy("bf16", args.device)
    norm = torch.nn.LayerNorm(8).to(args.device)
    policy.apply(norm)
    with policy.autocast():
        lin = torch.nn.Linear(8, 8).to(args.device)
        print(f"autocast bf16: Linear out {lin(torch.randn(2, 8, device=args.device)).dtype}, "
              f"LayerNorm out {norm(torch.randn(2, 8, device=args.device, dtype=torch.bfloat16)).dtype}")
    with tempfile.TemporaryDirectory() as t:
        for mode in ("fp32", "bf16", "fp16"):
            if cuda:
                torch.cuda.reset_peak_memory_stats(args.device)
            cfg = {"out_dir": f"{t}/{mode}", "steps": args.steps, "device": args.device,
                   "model": {"factory": "train_models:make_tiny", "kwargs": model_kw},
                   "data": {"factory": "train_models:make_data",
                            "kwargs": {"n": 8192, "din": 256, "classes": 10}, "batch_size": 256},
                   "precision": {"mode": mode, **({"initial_scale": 2.0 ** 16, "growth_interval": 20} if mode == "fp16" else {})},
                   "checkpoint": {"every": args.steps}, "health": {"progress": False}}
            train.run(from_dict(cfg))
            recs = read_metrics(Path(t) / mode / "metrics.jsonl")
            ms = statistics.median(r["step_time_ms"] for r in (recs[5:] or recs))  # first 5 steps: warm-up
            peak = f"{torch.cuda.max_memory_allocated(args.device):,} bytes" if cuda else "n/a (not CUDA)"
            scales = sorted({r["loss_scale"] for r in recs if "loss_scale" in r})
            skipped = sum(1 for r in recs if r.get("skipped"))
            print(f"{mode}: median step {ms:.2f} ms, loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}, "
                  f"peak memory {peak}, skipped {skipped}" + (f", loss scales {scales}" if scales else ""))


if __name__ == "__main__":
    main()
