"""torchrun worker for the distributed tests: runs several configs one after another in one process group
(one launch instead of one per config: process start-up dominates on 2 cores). Usage: CONFIG [CONFIG ...]."""
from __future__ import annotations

import sys

import torch.distributed as dist

from dsedge.toolchain.train import distill, train
from dsedge.toolchain.train.config import load_config


def main(paths: list[str]) -> None:
    dist.init_process_group("gloo")
    for p in paths:
        cfg = load_config(p)
        (distill.run if cfg.distill is not None else train.run)(cfg)
    # on an exception the process exits without a barrier (peers may sit in another collective); torchrun then
    # stops the group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
