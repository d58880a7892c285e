"""Training losses from the config's ``[loss]`` section, and the knowledge-distillation loss.

KD: Hinton, Vinyals, Dean, "Distilling the Knowledge in a Neural Network", arXiv:1503.02531 — KL(teacher_T ||
student_T) on temperature-softened logits, scaled by T^2 so its gradient magnitude does not shrink with T, weighted
``alpha``; the hard-label loss weighted ``1 - alpha``. Optional feature matching: MSE between named intermediate
activations (FitNets, arXiv:1412.6550), weighted ``feature_weight``. ``feature_distance`` is that matching term on
its own (MSE or 1 - cosine): the teacher-to-student loss of the compensation fine-tunes after pruning and of QAT.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...runtime.errors import ConfigError
from .config import LossConfig, resolve_callable

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_loss(cfg: LossConfig, weight_mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LossFn:
    """``loss(logits, target) -> scalar`` (mean over the batch, computed in fp32).

    cross_entropy: logits (N, C) float, target (N,) int64 class ids; ``class_weights`` (C floats): the weighted mean
    ``sum(w[y] * ce) / sum(w[y])``. ``weight_mean``: under data parallelism, the mean over the data-parallel ranks
    of a scalar (an all-reduce): the denominator is then the ranks' mean ``sum(w[y])``, so the ranks' averaged
    gradients are those of the global batch's weighted mean, as one process computes it (each rank's own weighted
    mean, averaged, is not: 0.02 apart in the weights after 200 steps of the fraud teacher on 2 processes).
    bce_with_logits: logits and target same shape (a trailing size-1 axis is squeezed), ``pos_weight``.
    mse: same shape (a trailing size-1 axis is squeezed). ``module:function``: the user's function, called as-is.
    The cross_entropy loss raises ConfigError (on its first call, before any weight moves) when ``class_weights``
    does not give one weight per class of the logits; the config cannot know C. bce_with_logits and mse raise
    ConfigError when the logits and the target differ in shape (mse broadcast them: a wrong loss, silently);
    cross_entropy when targets are not class ids of the logits (every batch on the CPU, the first on a GPU).
    """
    if cfg.kind == "cross_entropy":
        w = torch.tensor(cfg.class_weights, dtype=torch.float32) if cfg.class_weights else None
        first = [True]

        def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            classes = logits.shape[1 if logits.ndim >= 2 else 0] if logits.ndim else 0  # torch's class axis
            if w is not None and classes != len(w):
                raise ConfigError(f"[loss] class_weights has {len(w)} weight{'s' * (len(w) != 1)} but the model gives "
                                  f"{classes} classes (logits {tuple(logits.shape)})",
                                  f"give {classes} weights, one per class")
            if (first or target.device.type == "cpu") and target.numel():  # on a GPU once (a sync): torch's
                first.clear()                                                 # IndexError or a CUDA assert otherwise
                top, low = int(target.max()), int(target.min())
                if top >= classes or low < 0:
                    raise ConfigError(f"[loss] kind = 'cross_entropy': a target is class {top if low >= 0 else low} "
                                      f"and the model gives "
                                      f"{classes} class{'es' * (classes != 1)} (logits {tuple(logits.shape)})",
                                      "one output per class (2 for a binary task), or kind = 'bce_with_logits' for a "
                                      "single logit")
            if w is not None and weight_mean is not None:
                wd = w.to(logits.device)
                per = F.cross_entropy(logits.float(), target.long(), weight=wd, reduction="none")  # w[y] * ce
                return per.sum() / weight_mean(wd[target.long()].sum().detach())
            return F.cross_entropy(logits.float(), target.long(),
                                   weight=None if w is None else w.to(logits.device))
        return ce
    if cfg.kind == "bce_with_logits":
        pw = torch.tensor([cfg.pos_weight], dtype=torch.float32) if cfg.pos_weight is not None else None

        def bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = _same_shape(logits, target, "bce_with_logits")
            return F.binary_cross_entropy_with_logits(logits.float(), target.float(),
                                                      pos_weight=None if pw is None else pw.to(logits.device))
        return bce
    if cfg.kind == "mse":
        return lambda logits, target: F.mse_loss(_same_shape(logits, target, "mse").float(), target.float())
    return resolve_callable(cfg.kind, "[loss] kind")


def _same_shape(logits: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """``logits`` with a trailing size-1 axis squeezed when the target lacks it; ConfigError if the shapes differ."""
    if logits.ndim == target.ndim + 1 and logits.shape[-1] == 1:
        logits = logits.squeeze(-1)
    if logits.shape != target.shape:
        raise ConfigError(f"[loss] kind = {kind!r} needs the model's output and the target in the same shape; the "
                          f"model gives {list(logits.shape)} for targets {list(target.shape)}",
                          "use kind = 'cross_entropy' for class ids, or make the model give one output per target "
                          "value")
    return logits


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), averaged over the batch (all leading axes), fp32.

    Both (..., C); for a single logit (binary, C == 1) the two-class distribution [0, z] is used."""
    s, t = student_logits.float(), teacher_logits.float()
    if s.shape[-1] == 1:
        s, t = torch.cat([torch.zeros_like(s), s], -1), torch.cat([torch.zeros_like(t), t], -1)
    s, t = s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1])
    log_p_s = F.log_softmax(s / temperature, dim=-1)
    log_p_t = F.log_softmax(t / temperature, dim=-1)
    return F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean") * temperature ** 2


def feature_distance(student: torch.Tensor, teacher: torch.Tensor, kind: str = "cosine") -> torch.Tensor:
    """Feature / embedding matching between student and teacher tensors of the same shape ``(N, ...)``, fp32.

    ``cosine``: mean over the N samples of ``1 - cos(student_i, teacher_i)`` (each sample flattened) — scale-free,
    what sentence-embedding similarity uses. ``mse``: mean squared error over all elements (FitNets).
    Raises ValueError for another ``kind``.
    """
    s, t = student.float().reshape(student.shape[0], -1), teacher.float().reshape(teacher.shape[0], -1)
    if kind == "cosine":
        return (1 - F.cosine_similarity(s, t, dim=1)).mean()
    if kind == "mse":
        return F.mse_loss(s, t)
    raise ValueError(f"unknown feature distance {kind!r} (cosine or mse)")


class DistillLoss:
    """``alpha * kd_kl(student, teacher, T) + (1 - alpha) * hard(student, target) + feature_weight * feature MSE``."""

    def __init__(self, hard: LossFn, temperature: float = 4.0, alpha: float = 0.7, feature_weight: float = 0.0
                 ) -> None:
        self.hard, self.temperature, self.alpha, self.feature_weight = hard, temperature, alpha, feature_weight

    def __call__(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor,
                 features: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        loss = self.alpha * kd_kl(student_logits, teacher_logits, self.temperature)
        if self.alpha < 1:
            loss = loss + (1 - self.alpha) * self.hard(student_logits, target)
        if self.feature_weight and features:
            loss = loss + self.feature_weight * sum(feature_distance(s, t, "mse") for s, t in features)
        return loss
