"""Training-stack figures, measured side by side in one run (CPU here; numbers are noisy on a shared machine).

1. Trainer step time vs a plain hand-written PyTorch loop on the same model and data, 1 process (goal <= 1.05x).
2. Activation memory with and without activation checkpointing (bytes saved for backward, counted with
   torch.autograd.graph.saved_tensors_hooks: device independent).
3. DDP gradient bytes sent per step with no hook, the fp16 hook and PowerSGD (rank 1), 2 gloo processes.
4. Time to resume after a killed rank under torchrun --max-restarts 1 (kill -> 'resumed' record, and -> next step).

Usage: python benchmarks/train_step.py [--steps 40] [--skip-dist | --only-dist]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dsedge.toolchain.train import train  # noqa: E402
from dsedge.toolchain.train.config import dump_toml, from_dict  # noqa: E402
from dsedge.toolchain.train.metrics import read_metrics  # noqa: E402
from streaming import cpu_line  # noqa: E402  (benchmarks/streaming.py: CPU flags and load)

# torch.distributed.checkpoint says so on every single-process save (the trainer's final checkpoint): harmless here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming the "
                        "intent is to save in a single process", category=UserWarning)

MODEL = {"din": 64, "d": 256, "hidden": 1024, "classes": 10, "depth": 4}
N, BATCH = 4096, 64


def config(out: Path, steps: int, **over) -> dict:
    d = {"out_dir": str(out), "steps": steps, "seed": 0,
         "model": {"factory": "train_models:make_tiny", "kwargs": MODEL},
         "data": {"factory": "train_models:make_data",
                  "kwargs": {"n": N, "din": MODEL["din"], "classes": MODEL["classes"]}, "batch_size": BATCH},
         "optim": {"lamb_threshold": 10 ** 9},  # AdamW everywhere: same optimizer as the plain loop
         "checkpoint": {"every": 10 ** 6}, "health": {"progress": False}}
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def plain_loop(steps: int) -> list[float]:
    """The hand-written baseline: DataLoader, forward, CE loss, backward, clip, AdamW, zero_grad (ms per step)."""
    import train_models

    torch.manual_seed(0)
    model = train_models.make_tiny(**MODEL)
    ds, _ = train_models.make_data(n=N, din=MODEL["din"], classes=MODEL["classes"])
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    times, it = [], iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the trainer logs the loss every step
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def step_time(tmp: Path, steps: int) -> None:
    warm = 5
    rounds = []
    for r in range(3):  # interleave to share the machine's noise
        base = plain_loop(steps)[warm:]
        train.run(from_dict(config(tmp / f"bench{r}", steps)))
        ours = [m["step_time_ms"] for m in read_metrics(tmp / f"bench{r}" / "metrics.jsonl")][warm:]
        rounds.append((statistics.median(base), statistics.median(ours)))
    b = statistics.median(x for x, _ in rounds)
    o = statistics.median(y for _, y in rounds)
    print(f"step time, 1 process, {steps - warm} steps x 3 rounds (median ms): plain loop {b:.2f}, "
          f"dsedge trainer {o:.2f}, ratio {o / b:.3f}x (goal <= 1.05x)")


def activation_memory() -> None:
    import train_models

    from dsedge.toolchain.train.parallel import apply_activation_checkpointing

    x = torch.randn(BATCH, MODEL["din"])
    for ac in (False, True):
        torch.manual_seed(0)
        model = train_models.make_tiny(**MODEL)
        if ac:
            apply_activation_checkpointing(model)
        saved = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).logsumexp(-1).mean()
        loss.backward()
        print(f"activation bytes saved for backward, activation_checkpointing={ac}: {saved[0]:,} bytes "
              f"(parameters: {sum(p.numel() * 4 for p in model.parameters()):,} bytes)")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "tests"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                OMP_NUM_THREADS="1")


def comm_bytes(tmp: Path) -> None:
    paths = []
    for hook in (None, "fp16", "powersgd"):
        name = hook or "none"
        d = config(tmp / f"comm_{name}", 6, parallel={"comm_hook": hook} if hook else {})
        (tmp / f"comm_{name}.toml").write_text(dump_toml(d))
        paths.append(str(tmp / f"comm_{name}.toml"))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(ROOT / "tests" / "train_dist_driver.py"), *paths], env=env(), check=True,
                   stdout=subprocess.DEVNULL)
    base = None
    for hook in ("none", "fp16", "powersgd"):
        m = read_metrics(tmp / f"comm_{hook}" / "metrics.jsonl")
        per_step = m[-1]["comm_bytes"] - m[-2]["comm_bytes"]
        base = base or per_step
        print(f"DDP gradient bytes sent per step per rank, hook={hook}: {per_step:,} bytes "
              f"({per_step / base:.3f}x of hook=none)")


def resume_time(tmp: Path) -> None:
    d = config(tmp / "kill", 40, checkpoint={"every": 5})
    d["data"]["kwargs"]["delay_s"] = 0.002
    (tmp / "kill.toml").write_text(dump_toml(d))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", "-m", "dsedge.cli", "train", str(tmp / "kill.toml")],
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp / "kill" / "metrics.jsonl"
    t_kill = None
    while t_kill is None and proc.poll() is None:
        if metrics.is_file() and '"event": "checkpoint", "step": 10' in metrics.read_text():
            from test_train_distributed import _worker_pids

            pids = _worker_pids(proc.pid)
            if 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                t_kill = time.time()
        time.sleep(0.01)
    proc.wait()
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    resumed = next(r for r in recs if r.get("event") == "resumed")
    first = next(r for r in recs if "event" not in r and r["time"] > resumed["time"])
    print(f"resume after a killed rank (torchrun --max-restarts 1, 2 processes): kill -> resumed "
          f"{resumed['time'] - t_kill:.1f} s, kill -> first step after resume {first['time'] - t_kill:.1f} s "
          f"(resumed at step {resumed['step']})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per step-time round (the first 5 are warm-up)")
    dist = ap.add_mutually_exclusive_group()
    dist.add_argument("--skip-dist", action="store_true", help="skip parts 3 and 4 (2-process gloo runs)")
    dist.add_argument("--only-dist", action="store_true", help="run parts 3 and 4 only")
    args = ap.parse_args(argv)
    if args.steps <= 5:
        ap.error("--steps must be more than 5 (the first 5 steps of each round are warm-up, not timed)")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    print(cpu_line())
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if not args.only_dist:
            step_time(tmp, args.steps)
            activation_memory()
        if not args.skip_dist:
            comm_bytes(tmp)
            resume_time(tmp)


if __name__ == "__main__":
    main()
