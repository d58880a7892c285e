"""Plateau-driven augmentation: raise the augmentation strength one step when validation loss stops improving.

An evaluation *improves* when its loss is below ``best · (1 − min_improvement)`` (``min_improvement`` a fraction,
default 0.5 %); after ``patience`` evaluations in a row that do not (default 3) the monitor moves to the next entry of
``levels`` (e.g. random-erasing probability 0.2 → 0.4), resets its count and keeps its best loss. It stops at the last
level. Like Keras' ``ReduceLROnPlateau`` but acting on augmentation, not the learning rate. The state
(``state_dict``) is saved in every checkpoint, so a resumed run raises at the same evaluation.

The trainer hands the strength to the training set through ``dataset.set_augment_strength(float)``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from ...runtime.errors import ConfigError


class PlateauMonitor:
    """Args: levels (increasing strengths, the first used from the start), min_improvement (fraction), patience
    (evaluations). ``update(val_loss) -> bool``: True when it raised the strength at this evaluation."""

    def __init__(self, levels: Sequence[float], min_improvement: float = 0.005, patience: int = 3) -> None:
        if not levels:
            raise ConfigError("[augment] levels is empty", "e.g. levels = [0.2, 0.4, 0.6]")
        if patience < 1 or not 0 <= min_improvement < 1:
            raise ConfigError(f"[augment] patience must be ≥ 1 and min_improvement in [0, 1), got {patience}, "
                              f"{min_improvement}", "e.g. patience = 3, min_improvement = 0.005")
        self.levels = [float(x) for x in levels]
        self.min_improvement, self.patience = float(min_improvement), int(patience)
        self.level = 0
        self.best = math.inf
        self.stale = 0

    @property
    def strength(self) -> float:
        return self.levels[self.level]

    def update(self, val_loss: float) -> bool:
        if val_loss < self.best * (1 - self.min_improvement) or self.best == math.inf:
            self.best, self.stale = float(val_loss), 0
            return False
        self.best = min(self.best, float(val_loss))
        self.stale += 1
        if self.stale >= self.patience and self.level + 1 < len(self.levels):
            self.level += 1
            self.stale = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "best": None if self.best == math.inf else self.best, "stale": self.stale,
                "levels": self.levels}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.level = min(int(state["level"]), len(self.levels) - 1)
        self.best = math.inf if state.get("best") is None else float(state["best"])
        self.stale = int(state.get("stale", 0))
