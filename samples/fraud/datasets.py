"""Dataset factory for ``dsedge train`` / ``dsedge distill`` (``[data] factory`` in teacher.toml / student.toml).

Each item is ``((dense float32 [29], sparse_ids int64 [4]), target int64 scalar)``; the model is called as
``model(dense, sparse_ids)``.
"""
from __future__ import annotations

import os

from .data import DEFAULT_CSV, TimeSplit, load_transactions, split_by_time
from .features import Preprocessor, SparseEncoder


def fit_preprocessor(csv: str | os.PathLike = DEFAULT_CSV, hash_buckets: int = 10_000, dim: int = 128,
                     combiner: str = "sum") -> tuple[Preprocessor, TimeSplit]:
    """Load, split by time (``data.split_by_time``) and fit the preprocessor on the train split.

    Returns:
        (the fitted ``Preprocessor``, the ``TimeSplit``).
    """
    split = split_by_time(load_transactions(csv))
    return Preprocessor(SparseEncoder(dim, hash_buckets, combiner)).fit(split["train"]), split


class TransactionDataset:
    """A map-style torch dataset over preprocessed arrays (``torch.utils.data.Dataset`` protocol)."""

    def __init__(self, inputs: dict, labels) -> None:
        import torch

        self.dense = torch.from_numpy(inputs["dense"])
        self.ids = torch.from_numpy(inputs["sparse_ids"])
        self.labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return (self.dense[i], self.ids[i]), self.labels[i]


def make_datasets(csv: str | os.PathLike = DEFAULT_CSV, hash_buckets: int = 10_000, max_rows: int | None = None):
    """``(train, val)`` datasets from the time split; ``max_rows`` keeps only the first rows of each (tests).

    Raises:
        TransactionsError: as ``data.load_transactions`` / ``data.split_by_time``.
    """
    pre, split = fit_preprocessor(csv, hash_buckets)
    out = []
    for name in ("train", "val"):
        frame = split[name] if max_rows is None else split[name].iloc[:max_rows]
        out.append(TransactionDataset(pre.transform(frame), frame["Class"].to_numpy()))
    return tuple(out)
