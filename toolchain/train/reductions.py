"""Cross-rank figures of one optimizer step: the global gradient L2 norm (DTensor shards and pipeline stages
included), clipping by it, and the data-parallel mean loss."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import parallel as par


def grad_norm(params: list[torch.nn.Parameter], env: par.DistEnv) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32 scalar): DTensor shards reduced over their mesh, pipeline stages summed."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(g)
    sq = torch.zeros((), dtype=torch.float32, device=env.device)
    for key, grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        sq = sq + n.float() ** 2
    if env.pp > 1:
        dist.all_reduce(sq, group=env.group("pp"))
    return sq.sqrt()


def clip_(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def global_loss(loss: torch.Tensor | None, env: par.DistEnv) -> float:
    """Mean of the data-parallel ranks' losses (each already a batch mean); only last-stage, tp-rank-0 ranks hold one."""
    has = loss is not None and env.is_last_stage and env.tp_rank == 0
    t = torch.tensor([float(loss.detach()) if has else 0.0, 1.0 if has else 0.0], dtype=torch.float64)
    if env.distributed:
        t = t.to(env.device)
        dist.all_reduce(t)
    return float(t[0] / t[1]) if float(t[1]) > 0 else float("nan")


def dp_mean(value: torch.Tensor, env: par.DistEnv) -> torch.Tensor:
    """The mean of a scalar over the data-parallel ranks (all-reduce over the mesh's ``dp`` group); ``value`` as
    it is in one process. Not differentiable (a normalizer)."""
    if env.dp <= 1:
        return value
    t = value.detach().clone()
    dist.all_reduce(t, group=env.group("dp"))
    return t / env.dp
