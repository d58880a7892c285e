"""Evaluation at each checkpoint and what it moves: the validation loss (per domain for multi-domain data), the
domain mixture (``DomainWeights.update``) and the augmentation strength (``PlateauMonitor``). Every rank runs the
same evaluation batches; rank 0's figures are broadcast so the mixture and the strength move alike on every rank."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from . import parallel as par
from .components import as_inputs, to_device
from .config import TrainConfig
from .domains import DomainWeights, MultiDomain
from .metrics import MetricsLog
from .plateau import PlateauMonitor
from .precision import PrecisionPolicy
from .reductions import global_loss
from .sampler import pad_collate, token_budget


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Any, cfg: TrainConfig, env: par.DistEnv, policy: PrecisionPolicy,
             loss_fn: Callable, schedule: Any = None) -> dict[str, float]:
    """Mean loss (and accuracy for cross_entropy, without pipeline) over the validation set; every rank runs the same
    batches (so FSDP/TP/pipeline collectives match). With a pipeline ``schedule`` the last stage computes the loss
    (``schedule.eval``), the tail that does not fill the micro-batches is left out, and the mean is shared."""
    from torch.utils.data import DataLoader

    model.eval()
    total, n, correct = 0.0, 0, 0
    d = cfg.data
    # variable-length samples (token-budget batches) are padded as in training: stacking them failed at the first
    # evaluation
    padded = token_budget(d)
    # a generator of its own, as the training loader has: without one, iterating draws the loader's base seed from
    # the global RNG, and every evaluation moved the dropout masks of the steps after it (runs differing only in
    # [checkpoint] every trained differently)
    loader = DataLoader(dataset, batch_size=max(1, d.batch_size // env.dp), shuffle=False,
                        drop_last=schedule is not None, collate_fn=pad_collate if padded else None,
                        generator=torch.Generator().manual_seed(0))
    for x, y in loader:
        x, y = to_device(as_inputs(x), env.device), to_device(y, env.device)
        with policy.autocast():
            if schedule is not None:
                losses: list = []
                if env.is_first_stage:
                    schedule.eval(*x, target=y if env.is_last_stage else None, losses=losses)
                else:
                    schedule.eval(target=y if env.is_last_stage else None, losses=losses)
                if losses:
                    total += float(torch.stack([v.float() for v in losses]).mean()) * len(y)
                n += len(y)
                continue
            out = model(*x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        total += float(loss_fn(out, y)) * len(y)
        n += len(y)
        if cfg.loss.kind == "cross_entropy":
            correct += int((out.argmax(-1) == y).sum())
    model.train()
    if schedule is not None:
        return {"val_loss": global_loss(torch.tensor(total / max(n, 1)), env)}
    res = {"val_loss": total / max(n, 1)}
    if cfg.loss.kind == "cross_entropy":
        res["val_accuracy"] = correct / max(n, 1)
    return res


def evaluate_domains(model: torch.nn.Module, dataset: MultiDomain, cfg: TrainConfig, env: par.DistEnv,
                     policy: PrecisionPolicy, loss_fn: Callable, schedule: Any = None) -> dict[str, Any]:
    """``evaluate`` per domain: ``domain_val_loss`` (and ``domain_val_accuracy``) {name: value}, and the
    sample-weighted overall ``val_loss`` (``val_accuracy``)."""
    per = {n: evaluate(model, dataset.domain(n), cfg, env, policy, loss_fn, schedule) for n in dataset.names}
    sizes = dict(zip(dataset.names, dataset.sizes))
    out: dict[str, Any] = {}
    for key in per[dataset.names[0]]:
        out[key] = sum(per[n][key] * sizes[n] for n in per) / sum(sizes.values())
        out[f"domain_{key}"] = {n: per[n][key] for n in per}
    return out



def validation_figures(model: torch.nn.Module, val_ds: Any, cfg: TrainConfig, env: par.DistEnv,
                       policy: PrecisionPolicy, loss_fn: Callable, schedule: Any, step: int, share: bool) -> dict:
    """``{"step": step, "val_loss": ..., ...}`` (no figures without a validation set); ``share`` broadcasts rank 0's
    figures to every rank (collective)."""
    ev: dict[str, Any] = {"step": step}
    if val_ds is not None:
        if isinstance(val_ds, MultiDomain):
            ev.update(evaluate_domains(model, val_ds, cfg, env, policy, loss_fn, schedule))
        else:
            ev.update(evaluate(model, val_ds, cfg, env, policy, loss_fn, schedule))
    if env.distributed and share:
        box = [ev]
        dist.broadcast_object_list(box, src=0)
        ev = box[0]
    return ev


def adapt(ev: dict, final: bool, train_ds: Any, domain_weights: DomainWeights | None,
          plateau: PlateauMonitor | None, log: MetricsLog) -> bool:
    """Move the domain mixture and raise the augmentation strength on a plateau from the figures ``ev`` (not at the
    ``final`` evaluation), recording ``domain_weights`` / ``augment_strength`` in ``ev``; True when the batches drawn
    from now on change (the caller drops prefetched ones)."""
    resample = False
    if domain_weights is not None:
        metric = "val_loss" if domain_weights.rule == "doremi" else domain_weights.metric
        if f"domain_{metric}" in ev and not final:
            before = list(domain_weights.weights)
            domain_weights.update(ev[f"domain_{metric}"])
            resample = domain_weights.weights != before
        ev["domain_weights"] = domain_weights.as_dict()
    if plateau is not None:
        if "val_loss" in ev and not final and plateau.update(ev["val_loss"]):
            train_ds.set_augment_strength(plateau.strength)
            log.event("augment", step=ev["step"], strength=plateau.strength, level=plateau.level)
            log.message(f"validation loss on a plateau: augmentation strength raised to {plateau.strength:g}")
            resample = True
        ev["augment_strength"] = plateau.strength
    return resample
