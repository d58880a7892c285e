"""Batch samplers that shard one global batch over the data-parallel ranks and can start mid-epoch (for resume).

``ShardedBatchSampler``: fixed global batch B; epoch e is ``randperm(n)`` seeded by (seed, e); batch b is
``perm[b*B:(b+1)*B]`` and dp rank r takes its r-th contiguous slice of B/dp samples, so dp ranks together see exactly
the batch a single process would (gradients averaged by DDP/FSDP equal the single-process mean).

``TokenBudgetBatchSampler``: variable-length sequences packed by length (sorted within shuffled pools of
``100 * max_batch_size`` samples, as fairseq's ``batch_by_size``): a batch holds at most ``max_batch_size``
sequences and ``len(batch) * longest <= max_tokens`` padded tokens; ``memory_limit_mb / bytes_per_token`` lowers
the token budget further. Batches are dealt round-robin to dp ranks, the tail dropped so every rank has as many.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from ...runtime.errors import ConfigError


class ShardedBatchSampler:
    """Indices (list of int) of this rank's share of each global batch; ``set_position(epoch, batch)`` before
    iterating resumes exactly. Drops the last incomplete global batch."""

    def __init__(self, n: int, global_batch: int, dp_rank: int = 0, dp: int = 1, seed: int = 0,
                 shuffle: bool = True) -> None:
        if n < global_batch:
            raise ConfigError(f"the training set has {n} samples, fewer than one batch ({global_batch})",
                              "lower [data] batch_size")
        self.n, self.global_batch, self.dp_rank, self.dp = n, global_batch, dp_rank, dp
        self.local = global_batch // dp
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start = 0, 0

    def batches_per_epoch(self) -> int:
        return self.n // self.global_batch

    def set_position(self, epoch: int, batch: int) -> None:
        self.epoch, self.start = epoch, batch

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch) of global step ``step`` (0-based count of batches consumed)."""
        return divmod(step, self.batches_per_epoch())

    def steps_for_epochs(self, epochs: int) -> int:
        return epochs * self.batches_per_epoch()

    def _perm(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        perm = self._perm()
        for b in range(self.start, self.batches_per_epoch()):
            lo = b * self.global_batch + self.dp_rank * self.local
            yield perm[lo:lo + self.local].tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start


class TokenBudgetBatchSampler:
    """Length-packed batches under a token budget (see module doc). ``lengths[i]`` = tokens in sample i."""

    def __init__(self, lengths: Sequence[int], max_tokens: int | None = None, max_batch_size: int | None = None,
                 memory_limit_mb: float | None = None, bytes_per_token: float | None = None, dp_rank: int = 0,
                 dp: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        budget = max_tokens
        if memory_limit_mb is not None:
            if not bytes_per_token:
                raise ConfigError("[data] memory_limit_mb needs bytes_per_token (activation bytes per token)",
                                  "measure it once (peak memory / tokens) and set bytes_per_token")
            mem_tokens = int(memory_limit_mb * 2 ** 20 / bytes_per_token)
            budget = mem_tokens if budget is None else min(budget, mem_tokens)
        if budget is None and max_batch_size is None:
            raise ConfigError("token-budget sampler needs max_tokens, memory_limit_mb or max_batch_size",
                              "set [data] max_tokens")
        self.lengths = [int(x) for x in lengths]
        if budget is not None and max(self.lengths) > budget:
            raise ConfigError(f"a sequence of {max(self.lengths)} tokens exceeds the budget of {budget} tokens",
                              "raise max_tokens / memory_limit_mb or truncate the sequences")
        self.max_tokens, self.max_batch_size = budget, max_batch_size
        self.dp_rank, self.dp, self.seed, self.shuffle = dp_rank, dp, seed, shuffle
        self.epoch, self.start = 0, 0

    def _batches(self, epoch: int) -> list[list[int]]:
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        pool = 100 * (self.max_batch_size or 64)
        batches: list[list[int]] = []
        for p in range(0, n, pool):
            chunk = sorted(order[p:p + pool], key=lambda i: self.lengths[i])
            cur: list[int] = []
            longest = 0
            for i in chunk:
                new_longest = max(longest, self.lengths[i])
                full = (self.max_batch_size is not None and len(cur) + 1 > self.max_batch_size) or (
                    self.max_tokens is not None and (len(cur) + 1) * new_longest > self.max_tokens)
                if cur and full:
                    batches.append(cur)
                    cur, new_longest = [], self.lengths[i]
                cur.append(i)
                longest = new_longest
            if cur:
                batches.append(cur)
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in perm]
        per_rank = len(batches) // self.dp
        return batches[self.dp_rank:per_rank * self.dp:self.dp]

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Batches this rank gets in ``epoch`` (packing depends on the epoch's shuffle, so counts vary a little)."""
        return len(self._batches(epoch))

    def set_position(self, epoch: int, batch: int) -> None:
        self.epoch, self.start = epoch, batch

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch) of global step ``step``, walking the per-epoch batch counts."""
        epoch = 0
        while step >= (n := self.batches_per_epoch(epoch)):
            if n == 0:
                raise ConfigError("the token-budget sampler gives no batch", "lower max_tokens or dp degree")
            step -= n
            epoch += 1
        return epoch, step

    def steps_for_epochs(self, epochs: int) -> int:
        return sum(self.batches_per_epoch(e) for e in range(epochs))

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches(self.epoch)[self.start:]

    def __len__(self) -> int:
        return len(self._batches(self.epoch)) - self.start


def token_budget(data) -> bool:
    """``[data]`` asks for token-budget batches (``max_tokens``, ``memory_limit_mb`` or ``max_batch_size``): samples
    of different lengths, padded per batch (``pad_collate``)."""
    return data.max_tokens is not None or data.memory_limit_mb is not None or data.max_batch_size is not None


def pad_collate(items: list) -> tuple:
    """Collate ``(inputs, target)`` items whose tensors differ in their first axis: right-pad with 0 to the longest.

    Returns (inputs, target) with a leading batch axis; inputs stay a tuple when the items' inputs were tuples."""
    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        if ts[0].ndim == 0:
            return torch.stack(ts)
        return torch.nn.utils.rnn.pad_sequence(ts, batch_first=True, padding_value=0)

    inputs = [it[0] for it in items]
    targets = [it[1] for it in items]
    if isinstance(inputs[0], (tuple, list)):
        x = tuple(stack([inp[k] for inp in inputs]) for k in range(len(inputs[0])))
    else:
        x = stack(inputs)
    return x, stack(targets)
