"""The distillation recipe: the training recipe (train.py) with a frozen teacher and the KD loss.

The teacher is a finished dsedge run (``[distill] teacher = RUN_DIR``), loaded with ``load_trained`` on every rank,
frozen (``requires_grad = False``, eval mode) and run under ``torch.no_grad`` in the same precision policy. The
student's loss is ``DistillLoss`` (Hinton et al., arXiv:1503.02531; optional FitNets feature matching).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...runtime.errors import ConfigError
from . import train as recipe
from .components import describe_inputs
from .config import TrainConfig
from .export_source import load_trained
from .losses import DistillLoss


def _capture(model: torch.nn.Module, names: list[str], store: dict[str, torch.Tensor]) -> None:
    mods = dict(model.named_modules())
    for n in names:
        # DDP/FSDP wrappers may prefix names; accept the plain name
        m = mods.get(n) or mods.get(f"module.{n}")
        if m is None:
            raise ConfigError(f"[distill] features: no module named {n!r}", "use names from model.named_modules()")

        def hook(_m: Any, _i: Any, out: Any, _n: str = n) -> None:
            store[_n] = out[0] if isinstance(out, (tuple, list)) else out
        m.register_forward_hook(hook)


def run(cfg: TrainConfig) -> recipe.RunResult:
    """Distill a student (``[model]``) from the teacher run in ``[distill]``; writes the same run directory layout as
    `dsedge train`.

    Raises:
        ConfigError: what ``train.run`` raises; at the first step, a teacher that cannot run on the data's inputs,
            student and teacher outputs of other shapes, a ``features`` module that does not exist or a pair whose
            outputs differ in shape.
        SourceError: the teacher is not a finished run. TrainingError: what ``train.run`` raises.
    """
    d = cfg.distill
    teacher_box: dict[str, Any] = {}

    def setup(env: Any, policy: Any) -> None:
        teacher, _ = load_trained(d.teacher)
        teacher.to(env.device)
        for q in teacher.parameters():
            q.requires_grad_(False)
        policy.apply(teacher)
        teacher_box["model"] = teacher

    def make_forward_loss(hard: Callable) -> recipe.ForwardLoss:
        kd = DistillLoss(hard, d.temperature, d.alpha, d.feature_weight or 0.0)
        teacher = teacher_box["model"]
        s_feats: dict[str, torch.Tensor] = {}
        t_feats: dict[str, torch.Tensor] = {}
        hooked = []

        def forward_loss(model: torch.nn.Module, x: tuple, y: torch.Tensor) -> torch.Tensor:
            if d.features and not hooked:
                _capture(model, list(d.features), s_feats)
                _capture(teacher, list(d.features.values()), t_feats)
            try:
                with torch.no_grad():
                    t_out = teacher(*x)
            except (RuntimeError, TypeError, ValueError, IndexError) as e:
                if hooked or isinstance(e, torch.OutOfMemoryError):  # the data fitted it before: not a config issue
                    raise
                raise ConfigError(f"{cfg.source}: the teacher {d.teacher} cannot run on this data's inputs "
                                  f"({describe_inputs(x)}):"
                                  f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                  "distill on inputs like the teacher's (its final/model.json lists them)") from None
            if not hooked:  # hooks in place (with features) and the teacher ran on this data once
                hooked.append(True)
            s_out = model(*x)
            t_out = t_out[0] if isinstance(t_out, (tuple, list)) else t_out
            s_out = s_out[0] if isinstance(s_out, (tuple, list)) else s_out
            if s_out.shape != t_out.shape:  # KL over the class axis: the same outputs or nothing to match
                raise ConfigError(f"{cfg.source}: the student's output {list(s_out.shape)} and the teacher's "
                                  f"{list(t_out.shape)} ({d.teacher}) differ in shape",
                                  "give the student the teacher's number of outputs ([model] kwargs)")
            pairs = [(s_feats[s], t_feats[t]) for s, t in d.features.items()] if d.features else []
            for (s, t), (sf, tf) in zip(d.features.items(), pairs):
                if sf.shape != tf.shape:  # MSE would broadcast, or fail with a traceback
                    raise ConfigError(f"{cfg.source}: [distill] features: the student's {s!r} gives "
                                      f"{list(sf.shape)} and the teacher's {t!r} {list(tf.shape)}",
                                      "pair modules whose outputs have the same shape")
            return kd(s_out, t_out, y, pairs)
        return forward_loss

    return recipe.run(cfg, forward_loss=make_forward_loss, setup_extra=setup)
