"""Teacher and student fraud models (torch): dense features + a hashed-id embedding bag → MLP → 2 logits.

Inputs: ``dense`` float32 [batch, 29] and ``sparse_ids`` int64 [batch, 4] (``features.Preprocessor``).
Output: ``logits`` float32 [batch, 2] (class 1 = fraud; the fraud score is ``logits[:, 1] - logits[:, 0]``).
The embedding bag is an ``Embedding`` gather followed by a sum (or mean) over the field axis, which exports to plain
ONNX Gather + ReduceSum (no EmbeddingBag op), as in DLRM-style recommenders (Naumov et al., 2019).
"""
from __future__ import annotations

import torch
from torch import nn

from .features import DENSE_DIM, SPARSE_FIELDS

INPUT_NAMES = ["dense", "sparse_ids"]
OUTPUT_NAMES = ["logits"]


class HashedEmbeddingBag(nn.Module):
    """int64 ids [batch, fields] in [0, hash_buckets) → float32 [batch, dim], combined by "sum" or "mean"."""

    def __init__(self, hash_buckets: int = 10_000, dim: int = 128, combiner: str = "sum") -> None:
        super().__init__()
        if combiner not in ("sum", "mean"):
            raise ValueError(f"combiner must be 'sum' or 'mean', got {combiner!r}")
        self.table = nn.Embedding(hash_buckets, dim)
        nn.init.normal_(self.table.weight, std=0.05)
        self.combiner = combiner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.table(ids)
        return e.sum(dim=1) if self.combiner == "sum" else e.mean(dim=1)


class FraudNet(nn.Module):
    """``concat(dense, embedding_bag(sparse_ids))`` → ``hidden`` ReLU layers → 2 logits."""

    def __init__(self, hidden: tuple[int, ...] | list[int] = (256, 256), embed_dim: int = 128,
                 hash_buckets: int = 10_000, combiner: str = "sum", dropout: float = 0.1,
                 dense_dim: int = DENSE_DIM) -> None:
        super().__init__()
        self.embed = HashedEmbeddingBag(hash_buckets, embed_dim, combiner)
        layers: list[nn.Module] = []
        width = dense_dim + embed_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, 2))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, sparse_ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([dense, self.embed(sparse_ids)], dim=1))


def make_teacher(hidden: list[int] = (256, 256), embed_dim: int = 128, hash_buckets: int = 10_000,
                 combiner: str = "sum", dropout: float = 0.1) -> FraudNet:
    """The teacher: 10,000 x 128 hashed embedding (as the seeds' SparseEncoder) and a 256-256 MLP (~1.4 M params)."""
    return FraudNet(tuple(hidden), embed_dim, hash_buckets, combiner, dropout)


def make_student(hidden: list[int] = (32,), embed_dim: int = 16, hash_buckets: int = 10_000,
                 combiner: str = "sum", dropout: float = 0.0) -> FraudNet:
    """The student: 10,000 x 16 embedding and one 32-wide layer (~0.16 M params, mostly the table)."""
    return FraudNet(tuple(hidden), embed_dim, hash_buckets, combiner, dropout)


def example_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    """Example inputs keyed by input name (batch axis 0 is dynamic when exported)."""
    return {"dense": torch.zeros(batch, DENSE_DIM), "sparse_ids": torch.zeros(batch, len(SPARSE_FIELDS), dtype=torch.int64)}


def tiny_student_source() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``dsedge build --model samples.fraud.model:tiny_student_source``: an untrained, seeded student (tests)."""
    torch.manual_seed(0)
    return make_student(hidden=[8], embed_dim=4, hash_buckets=1000).eval(), example_inputs()
