"""``dsedge distill CONFIG``: train a student against a frozen teacher run ([distill] section); torchrun-ready."""
from __future__ import annotations

import os
import sys

import click

from .train import check_launch, finished_line, launch_torchrun, run_rank, under_torchrun


@click.command(name="distill")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="Start N processes on this node via torchrun (default: run in this process, or as launched).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --nproc-per-node: restart the group this many times after a failure (resumes from the "
                   "latest checkpoint); not after a rank's config or training error (exit status 2).")
def distill(config: str, nproc: int | None, max_restarts: int) -> None:
    """Distill the [model] student from the [distill] teacher run (KL with temperature + hard-label loss)."""
    cfg = check_launch("distill", config, nproc, max_restarts)
    if nproc is not None and not under_torchrun():
        sys.exit(launch_torchrun("distill", config, nproc, max_restarts))
    from ..train.distill import run

    result = run_rank(run, cfg, "distill")
    if int(os.environ.get("RANK", 0)) == 0:
        click.echo(finished_line("distill", result))
