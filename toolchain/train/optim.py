"""Hybrid optimizer (LAMB for large matrices, AdamW for the rest) and the warmup-cosine learning-rate schedule.

LAMB: You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", arXiv:1904.00962,
Algorithm 2 (bias-corrected Adam direction plus decoupled weight decay, scaled per tensor by the trust ratio
||w|| / ||update||, 1 when either norm is 0). Our own small implementation, because it must step DTensor parameters
(FSDP2/TP shards): norms are taken over the whole tensor (``full_tensor``), never over one rank's shard.
AdamW: ``torch.optim.AdamW`` (Loshchilov & Hutter, arXiv:1711.05101).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def _full_norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of the whole tensor, also when ``t`` is a DTensor shard (then reduced across its mesh), fp32."""
    n = torch.linalg.vector_norm(t.to(torch.float32))
    return n.full_tensor() if hasattr(n, "full_tensor") else n


class Lamb(torch.optim.Optimizer):
    """LAMB (arXiv:1904.00962, Alg. 2) for plain tensors and DTensors; state ``step``, ``exp_avg``, ``exp_avg_sq``.

    Args: lr, betas (beta1, beta2), eps (added to sqrt(v_hat)), weight_decay (decoupled, inside the trust ratio).
    Raises ValueError on negative hyper-parameters, RuntimeError on sparse gradients.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.98),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)
                if wd:
                    update.add_(p, alpha=wd)
                w_norm, u_norm = float(_full_norm(p)), float(_full_norm(update))
                trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-lr * trust)
        return loss


def _no_decay(name: str, p: torch.Tensor, module_of: dict[str, torch.nn.Module]) -> bool:
    """Biases and normalization weights (1-D tensors, or parameters of a norm layer) get no weight decay."""
    if p.ndim < 2 or name.endswith("bias"):
        return True
    mod = module_of.get(name)
    return mod is not None and "norm" in type(mod).__name__.lower()


class HybridOptimizer:
    """LAMB on parameters with ``p.ndim >= 2 and max(p.shape) > lamb_threshold``, AdamW on the rest, stepped together.

    ``optimizers`` holds the non-empty ones (LAMB first) so torch.distributed.checkpoint and GradScaler see plain
    torch optimizers. Weight decay is 0 for biases and norm weights. Shapes are the unsharded ones (DTensor shape).
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                 eps: float, lamb_threshold: int = 1024) -> None:
        module_of = {f"{mn}.{pn}" if mn else pn: m for mn, m in model.named_modules()
                     for pn, _ in m.named_parameters(recurse=False)}
        buckets: dict[tuple[str, bool], list] = {(k, d): [] for k in ("lamb", "adamw") for d in (True, False)}
        self.lamb_names: list[str] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            kind = "lamb" if p.ndim >= 2 and max(p.shape) > lamb_threshold else "adamw"
            if kind == "lamb":
                self.lamb_names.append(name)
            buckets[(kind, not _no_decay(name, p, module_of))].append(p)
        self.optimizers: list[torch.optim.Optimizer] = []
        for kind, cls in (("lamb", Lamb), ("adamw", torch.optim.AdamW)):
            groups = [{"params": buckets[(kind, True)], "weight_decay": weight_decay},
                      {"params": buckets[(kind, False)], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            if groups:
                # foreach kernels cannot mix DTensor and plain tensors (tensor parallel shards only some layers)
                kinds = {hasattr(q, "device_mesh") for g in groups for q in g["params"]}
                extra = {"foreach": False} if cls is torch.optim.AdamW and len(kinds) > 1 else {}
                opt = cls(groups, lr=lr, betas=tuple(betas), eps=eps, **extra)
                for g in opt.param_groups:
                    g["initial_lr"] = lr
                self.optimizers.append(opt)
        # the config's hyper-parameters per group, in order: loading a checkpoint replaces the groups' own
        self._hparams = [[{"initial_lr": lr, "weight_decay": g["weight_decay"], "betas": tuple(betas), "eps": eps}
                          for g in o.param_groups] for o in self.optimizers]

    def reset_hparams(self) -> None:
        """Give every group the constructor's ``initial_lr``, ``weight_decay``, ``betas`` and ``eps`` again, after a
        checkpoint's state (which holds the hyper-parameters of the run that wrote it) was loaded; the current
        ``lr`` is left to the schedule."""
        for o, hparams in zip(self.optimizers, self._hparams):
            for g, h in zip(o.param_groups, hparams):
                g.update(h)

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def set_lr_factor(self, factor: float) -> float:
        """Set every group's lr to ``initial_lr * factor``; returns the first group's lr."""
        lr = None
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = g["initial_lr"] * factor
                lr = g["lr"] if lr is None else lr
        return float(lr or 0.0)


class WarmupCosine:
    """lr factor at step ``s`` (0-based): linear warmup from 1/(W+1) to 1 over W = round(warmup_fraction * total)
    steps, then cosine decay to ``min_ratio`` at ``total`` (Loshchilov & Hutter, SGDR, arXiv:1608.03983, no restarts).
    """

    def __init__(self, total_steps: int, warmup_fraction: float = 0.1, min_ratio: float = 0.0) -> None:
        self.total = max(1, int(total_steps))
        self.warmup = int(round(warmup_fraction * self.total))
        self.min_ratio = min_ratio

    def schedulers(self, optimizer: "HybridOptimizer | torch.optim.Optimizer") -> list:
        """The same schedule as ``torch.optim.lr_scheduler`` objects, one per inner optimizer: ``LinearLR`` warmup
        (1/(W+1) → 1 over W steps) then ``CosineAnnealingLR`` to ``min_ratio`` × lr, chained by ``SequentialLR``;
        call ``.step()`` once per optimizer step. ``__call__`` is its closed form (stateless, for resuming at any
        step)."""
        from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

        out = []
        for opt in getattr(optimizer, "optimizers", [optimizer]):
            base = {g.get("initial_lr", g["lr"]) for g in opt.param_groups}
            if len(base) != 1:
                raise ValueError("WarmupCosine.schedulers needs one initial lr per optimizer (HybridOptimizer has)")
            cosine = CosineAnnealingLR(opt, T_max=max(1, self.total - self.warmup), eta_min=base.pop() * self.min_ratio)
            if self.warmup:
                warm = LinearLR(opt, start_factor=1 / (self.warmup + 1), end_factor=1.0, total_iters=self.warmup)
                out.append(SequentialLR(opt, [warm, cosine], milestones=[self.warmup]))
            else:
                out.append(cosine)
        return out

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
