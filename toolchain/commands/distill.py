"""``dsedge distill CONFIG``: train a student against a frozen teacher run ([distill] section); torchrun-ready."""
from __future__ import annotations

import os
import sys

import click

from .train import launch_torchrun, under_torchrun


@click.command(name="distill")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--nproc-per-node", "nproc", type=int, default=None,
              help="Start N processes on this node via torchrun (default: run in this process, or as launched).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="With --nproc-per-node: restart the group this many times after a failure.")
def distill(config: str, nproc: int | None, max_restarts: int) -> None:
    """Distill the [model] student from the [distill] teacher run (KL with temperature + hard-label loss)."""
    if nproc is not None and not under_torchrun():
        sys.exit(launch_torchrun("distill", config, nproc, max_restarts))
    from ..train.config import load_config
    from ..train.distill import run

    result = run(load_config(config, distill=True))
    if int(os.environ.get("RANK", 0)) == 0:
        click.echo(f"distilled {result.steps} steps, loss {result.final_loss:.6g}: {result.run_dir}")
