"""Multi-domain training data: named sources, a sampling mixture over them, and the rules that move the mixture.

Data: the ``[data] factory`` returns ``({name: train_dataset}, {name: val_dataset} | None)`` (or ``MultiDomain``
objects); the trainer concatenates them and keeps each domain's index range.

Sampling (``DomainBatchSampler``): global batch ``s`` draws each of its B slots' domain from the current weights
and then a sample of that domain uniformly (with replacement), all from one generator seeded by (seed, s). A batch
is therefore a pure function of (seed, step, weights): every data-parallel rank draws the same global batch and takes
its own contiguous slice of it (same schedule, different shards), and a resumed run that restores the weights
draws the same batches.

Rules (``DomainWeights.update``, once per evaluation, from the per-domain validation metric):
  * ``threshold`` (default): start uniform or from the given weights; each evaluation at which a domain's metric
    has reached ``threshold`` (loss ≤ threshold, or accuracy ≥ threshold) raises that domain's share by ``step``
    (capped at ``max_weight``) and scales the other shares down to keep the sum 1. It feeds the domains the model
    already handles, a curriculum that widens what it has learnt.
  * ``doremi``: ``w_d ∝ w_d · exp(η · (L_d − min_k L_k))``, then mixed with ``smoothing`` (1e-3) of the uniform
    mixture — DoReMi's multiplicative update (Xie et al., arXiv:2305.10429, Alg. 1) with the excess loss taken
    against the best domain instead of a reference model. It moves weight to the domains where the model is
    weakest; it needs no threshold and never stops moving while the losses differ.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Sequence

import torch

from ...runtime.errors import ConfigError


class MultiDomain(torch.utils.data.Dataset):
    """Named datasets concatenated: item ``i`` of domain ``d`` is index ``offsets[d] + i``.

    Attributes: ``names`` (list of str), ``sizes`` (list of int), ``offsets`` (list of int)."""

    def __init__(self, domains: Mapping[str, Any]) -> None:
        if not domains:
            raise ConfigError("the data factory returned no domains", "return {name: dataset, ...}")
        self.names = [str(n) for n in domains]
        self.datasets = list(domains.values())
        self.sizes = [len(d) for d in self.datasets]
        if min(self.sizes) == 0:
            empty = self.names[self.sizes.index(0)]
            raise ConfigError(f"domain {empty!r} has no samples", "drop it or give it data")
        self.offsets = [0]
        for n in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i: int):
        d = max(k for k, off in enumerate(self.offsets) if off <= i)
        return self.datasets[d][i - self.offsets[d]]

    def domain(self, name: str) -> Any:
        return self.datasets[self.names.index(name)]

    def set_augment_strength(self, strength: float) -> None:
        for d in self.datasets:
            if hasattr(d, "set_augment_strength"):
                d.set_augment_strength(strength)


class DomainWeights:
    """The sampling mixture and its update rule (see the module doc); ``state_dict()`` goes in the checkpoint.

    Args:
        names: domain names.
        rule: ``threshold`` or ``doremi``.
        initial: {name: weight} (normalised; default uniform).
        metric: ``val_loss`` (lower is better) or ``val_accuracy`` (higher is better); threshold rule only —
            DoReMi always uses losses.
        threshold / step / max_weight: threshold rule (no threshold: the mixture stays fixed).
        eta / smoothing: DoReMi step size and uniform mixing.
    """

    def __init__(self, names: Sequence[str], rule: str = "threshold", initial: Mapping[str, float] | None = None,
                 metric: str = "val_loss", threshold: float | None = None, step: float = 0.1,
                 max_weight: float = 0.5, eta: float = 1.0, smoothing: float = 1e-3) -> None:
        self.names = list(names)
        self.rule, self.metric, self.threshold = rule, metric, threshold
        self.step, self.max_weight, self.eta, self.smoothing = step, max_weight, eta, smoothing
        if initial:
            unknown = sorted(set(initial) - set(self.names))
            if unknown:
                raise ConfigError(f"[domains] weights names unknown domains {unknown}",
                                  f"the data has domains {self.names}")
            w = [float(initial.get(n, 0.0)) for n in self.names]
        else:
            w = [1.0] * len(self.names)
        if min(w) < 0 or sum(w) <= 0:
            raise ConfigError(f"[domains] weights must be ≥ 0 with a positive sum, got {w}", "e.g. { a = 1, b = 1 }")
        self.weights = [x / sum(w) for x in w]
        self.updates = 0

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights))

    def update(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """New weights from the per-domain metric {name: value} (losses for DoReMi); returns them as a dict."""
        if self.rule == "doremi":
            losses = [float(metrics[n]) for n in self.names]
            lo = min(losses)
            w = [wi * math.exp(self.eta * (li - lo)) for wi, li in zip(self.weights, losses)]
            total = sum(w)
            k = len(w)
            self.weights = [(1 - self.smoothing) * wi / total + self.smoothing / k for wi in w]
        elif self.threshold is not None:
            w = list(self.weights)
            for i, n in enumerate(self.names):
                v = float(metrics[n])
                reached = v <= self.threshold if self.metric == "val_loss" else v >= self.threshold
                if reached and w[i] < self.max_weight:
                    w = _set_share(w, i, min(w[i] + self.step, self.max_weight))
            self.weights = w
        self.updates += 1
        return self.as_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "weights": self.weights, "updates": self.updates, "rule": self.rule}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ConfigError(f"the checkpoint's domains {state['names']} are not this run's {self.names}",
                              "resume with the same data, or start a new out_dir")
        self.weights = [float(x) for x in state["weights"]]
        self.updates = int(state.get("updates", 0))


def _set_share(w: list[float], i: int, share: float) -> list[float]:
    """Weights with ``w[i] = share`` and the others scaled to fill ``1 - share``."""
    rest = sum(w) - w[i]
    out = [x * (1 - share) / rest if rest > 0 else (1 - share) / (len(w) - 1) for x in w]
    out[i] = share
    return out


class DomainBatchSampler:
    """This rank's slice of each global batch drawn from the domain mixture (see the module doc).

    ``weights`` is read each batch, so an update applies to the batches drawn after it; the trainer rebuilds its
    loader after an update so no prefetched batch carries the old mixture.
    """

    def __init__(self, data: MultiDomain, weights: DomainWeights, global_batch: int, dp_rank: int = 0, dp: int = 1,
                 seed: int = 0) -> None:
        if global_batch % dp:
            raise ConfigError(f"batch_size {global_batch} is not divisible by the data-parallel degree {dp}",
                              f"use a multiple of {dp}")
        self.data, self.weights = data, weights
        self.global_batch, self.dp_rank, self.dp, self.seed = global_batch, dp_rank, dp, seed
        self.local = global_batch // dp
        self.epoch, self.start = 0, 0

    def batches_per_epoch(self) -> int:
        """Nominal epoch: as many batches as one pass over the data would take."""
        return max(1, len(self.data) // self.global_batch)

    def locate(self, step: int) -> tuple[int, int]:
        return divmod(step, self.batches_per_epoch())

    def set_position(self, epoch: int, batch: int) -> None:
        self.epoch, self.start = epoch, batch

    def steps_for_epochs(self, epochs: int) -> int:
        return epochs * self.batches_per_epoch()

    def global_batch_at(self, step: int) -> tuple[list[int], list[int]]:
        """(domain index per slot, dataset index per slot) of global batch ``step`` under the current weights."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        w = torch.tensor(self.weights.weights, dtype=torch.float64)
        doms = torch.multinomial(w, self.global_batch, replacement=True, generator=g).tolist()
        u = torch.rand(self.global_batch, generator=g, dtype=torch.float64).tolist()
        idx = [self.data.offsets[d] + min(int(x * self.data.sizes[d]), self.data.sizes[d] - 1)
               for d, x in zip(doms, u)]
        return doms, idx

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.start, self.batches_per_epoch()):
            _, idx = self.global_batch_at(self.epoch * self.batches_per_epoch() + b)
            lo = self.dp_rank * self.local
            yield idx[lo:lo + self.local]

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start
