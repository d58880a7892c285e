"""Tiny models and data sets for the training tests (imported by in-process tests and torchrun workers)."""
from __future__ import annotations

import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    """embed -> N residual MLP blocks (LayerNorm, up, down) -> head; TP plan: up colwise, down rowwise."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, din: int = 8, d: int = 16, hidden: int = 32, classes: int = 3, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(din, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_tiny(**kw) -> nn.Module:
    return TinyNet(**kw)


def make_dropout_mlp(p: float = 0.1) -> nn.Module:
    """An MLP with dropout ``p``: torch raises ValueError for p outside [0, 1]."""
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 3))


def make_mlp(din: int = 8, hidden: int = 16, classes: int = 3) -> nn.Module:
    """A 4-child Sequential (pipeline tests split it by children)."""
    return nn.Sequential(nn.Linear(din, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, classes))


class TwoInputNet(nn.Module):
    def __init__(self, din: int = 4, vocab: int = 10, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.fc = nn.Linear(din + 4, classes)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([dense, self.emb(ids)], -1))


def make_two_input(**kw) -> nn.Module:
    return TwoInputNet(**kw)


def make_two_input_data(n: int = 32):
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(n, 4, generator=g)
    ids = torch.randint(0, 10, (n,), generator=g)
    y = (dense[:, 0] > 0).long()
    items = [((dense[i], ids[i]), y[i]) for i in range(n)]
    return items, None


class NaNBurst(nn.Module):
    """TinyNet whose forward returns NaN on calls number ``start`` .. ``start + count - 1`` (1-based), once."""

    def __init__(self, start: int = 5, count: int = 3, **kw) -> None:
        super().__init__()
        self.net = TinyNet(**kw)
        self.start, self.count, self.calls = start, count, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        out = self.net(x)
        if self.start <= self.calls < self.start + self.count:
            out = out * float("nan")
        return out


def make_nan_burst(**kw) -> nn.Module:
    return NaNBurst(**kw)


def make_data(n: int = 64, din: int = 8, classes: int = 3, seed: int = 1, val: int = 0, delay_s: float = 0.0):
    """(train, val | None): x ~ N(0, 1), y = argmax(x @ W) for a fixed W, so the task is learnable."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(din, classes, generator=g)
    x = torch.randn(n + val, din, generator=g)
    y = (x @ w).argmax(-1)
    train = Slow(x[:n], y[:n], delay_s) if delay_s else torch.utils.data.TensorDataset(x[:n], y[:n])
    return train, (torch.utils.data.TensorDataset(x[n:], y[n:]) if val else None)


class Slow(torch.utils.data.Dataset):
    """A TensorDataset that sleeps ``delay_s`` per item (gives a kill test time to act)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, delay_s: float) -> None:
        self.x, self.y, self.delay_s = x, y, delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class Sequences(torch.utils.data.Dataset):
    """Variable-length token sequences (lengths 2..max_len); target: sequence length is even."""

    def __init__(self, n: int = 40, max_len: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, max_len + 1, (n,), generator=g).tolist()
        self.seqs = [torch.randint(1, 20, (n_,), generator=g) for n_ in self.lengths]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i], torch.tensor(self.lengths[i] % 2)


class BagOfTokens(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def make_bag(**kw) -> nn.Module:
    return BagOfTokens(**kw)


def make_sequences(**kw):
    return Sequences(**kw), None


def make_fraud_data(csv: str, n_val: int = 2000):
    """The real ULB credit-card subsample: 30 standardized features, target Class (0/1), last n_val rows for val."""
    import numpy as np
    import pandas as pd

    df = pd.read_csv(csv)
    x = df.drop(columns=["Class"]).to_numpy(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = df["Class"].to_numpy(np.float32)
    g = np.random.default_rng(0)
    order = g.permutation(len(x))
    x, y = torch.from_numpy(x[order]), torch.from_numpy(y[order])
    ds = torch.utils.data.TensorDataset
    return ds(x[:-n_val], y[:-n_val]), ds(x[-n_val:], y[-n_val:])


def make_fraud_mlp(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(30, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def config(out, **over):
    """A small training config dict (tiny model, 6 steps) with sections of ``over`` merged in."""
    d = {"out_dir": str(out), "steps": 6, "seed": 0,
         "model": {"factory": "train_models:make_tiny", "input_names": ["features"]},
         "data": {"factory": "train_models:make_data", "kwargs": {"val": 16}, "batch_size": 8},
         "optim": {"lamb_threshold": 16}, "checkpoint": {"every": 3}, "health": {"progress": False}}
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def make_dropout(din: int = 8, hidden: int = 32, classes: int = 3, p: float = 0.3) -> nn.Module:
    """An MLP with dropout: its training steps draw from the global RNG (resume tests)."""
    return nn.Sequential(nn.Linear(din, hidden), nn.ReLU(), nn.Dropout(p), nn.Linear(hidden, classes))


class HalfUsed(nn.Module):
    """Two heads, of which forward() uses one: fine in one process, not under DDP."""

    def __init__(self, din: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.head = nn.Linear(din, classes)
        self.spare = nn.Linear(din, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def make_half_used(**kw) -> nn.Module:
    return HalfUsed(**kw)


def make_sequences_val(n: int = 40, val: int = 16):
    """Variable-length sequences with a validation set of them too."""
    return Sequences(n), Sequences(val, seed=1)
