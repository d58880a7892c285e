"""``dsedge train CONFIG``: train a model from a TOML/YAML config (see TRAIN_CONFIG.md); torchrun-ready."""
from __future__ import annotations

import os
import subprocess
import sys

import click


def launch_torchrun(verb: str, config: str, nproc: int, max_restarts: int) -> int:
    """Re-run ``dsedge VERB CONFIG`` under ``torch.distributed.run`` on this node (standalone rendezvous).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with a shared store, restarts after a killed rank hang (measured)."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "dsedge.cli", verb, config]
    return subprocess.call(cmd, env=env)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


@click.command(name="train")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--nproc-per-node", "nproc", type=int, default=None,
              help="Start N processes on this node via torchrun (default: run in this process, or as launched).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="With --nproc-per-node: restart the group this many times after a failure (resumes from the "
                   "latest checkpoint).")
def train(config: str, nproc: int | None, max_restarts: int) -> None:
    """Train the model a config describes; writes OUT/config.toml, metrics.jsonl, checkpoints/, final/."""
    if nproc is not None and not under_torchrun():
        sys.exit(launch_torchrun("train", config, nproc, max_restarts))
    from ..train.config import load_config
    from ..train.train import run

    result = run(load_config(config))
    if int(os.environ.get("RANK", 0)) == 0:
        click.echo(f"trained {result.steps} steps, loss {result.final_loss:.6g}: {result.run_dir}")
