"""Feature preprocessing in numpy: dense features and hashed sparse ids (the model takes integer ids).

Dense (29 float32): V1..V28 as given (PCA components) and ``log1p(Amount)`` standardised with training statistics.
Sparse (4 int64 ids per row), derived from ``Time`` and ``Amount`` only:
``hour`` = hour of day ``(Time // 3600) % 24``, ``amount_bucket`` (log-spaced edges), ``cents`` = ``Amount``'s cents
(fraudsters favour round and .99 amounts), and the cross ``hour x amount_bucket``.

``SparseEncoder(dim, hash_buckets, combiner)`` mirrors the seeds' encoder: the hashing (the "hashing trick",
Weinberger et al., ICML 2009, with the splitmix64 finaliser as hash) runs here, in preprocessing; ``dim`` and
``combiner`` configure the embedding bag inside the torch model (``model.HashedEmbeddingBag``).
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from .data import V_COLUMNS

AMOUNT_EDGES = (0.005, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
SPARSE_FIELDS = ("hour", "amount_bucket", "cents", "hour_x_amount_bucket")
DENSE_DIM = len(V_COLUMNS) + 1
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele et al., OOPSLA 2014) on uint64 arrays; wraps modulo 2**64."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _splitmix64_int(z: int) -> int:
    """``splitmix64`` on one Python int (the single-transaction path; same values as the numpy one)."""
    m = 0xFFFFFFFFFFFFFFFF
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def categorical_fields(time_s: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """The raw categorical values, int64 [n, 4] in ``SPARSE_FIELDS`` order (also the baseline's features)."""
    hour = (np.floor_divide(time_s, 3600.0) % 24).astype(np.int64)
    bucket = np.searchsorted(AMOUNT_EDGES, amount, side="right").astype(np.int64)
    cents = (np.rint(amount * 100.0).astype(np.int64) % 100)
    return np.stack([hour, bucket, cents, hour * (len(AMOUNT_EDGES) + 1) + bucket], axis=1)


@dataclass(frozen=True)
class SparseEncoder:
    """Hash categorical values into ``hash_buckets`` ids, one per field.

    ``id = splitmix64(field_index << 32 | value) % hash_buckets``: deterministic across processes and machines
    (unlike Python's ``hash``), so the scorer on a device reproduces training's ids. Collisions are expected and
    learned around (hashing trick). ``dim`` and ``combiner`` ("sum" | "mean") are carried to the model.
    """

    dim: int = 128
    hash_buckets: int = 10_000
    combiner: str = "sum"

    def __post_init__(self) -> None:
        if self.combiner not in ("sum", "mean"):
            raise ValueError(f"combiner must be 'sum' or 'mean', got {self.combiner!r}")
        if self.hash_buckets < 2 or self.dim < 1:
            raise ValueError("hash_buckets must be >= 2 and dim >= 1")

    def transform(self, values: np.ndarray) -> np.ndarray:
        """int64 [n, fields] categorical values (non-negative, < 2**32) → int64 [n, fields] ids in [0, hash_buckets)."""
        values = np.asarray(values, dtype=np.int64)
        salt = np.arange(values.shape[1], dtype=np.uint64) << np.uint64(32)
        h = splitmix64(values.astype(np.uint64) | salt)
        return (h % np.uint64(self.hash_buckets)).astype(np.int64)


@dataclass
class Preprocessor:
    """Rows → model inputs ``{"dense": float32 [n, 29], "sparse_ids": int64 [n, 4]}``.

    ``fit`` learns the mean and std of ``log1p(Amount)`` on the training split; everything else is fixed.
    Saved as JSON (``to_json``/``from_json``) next to the bundle, so serving needs no pickle.
    """

    encoder: SparseEncoder = field(default_factory=SparseEncoder)
    amount_mean: float = 0.0
    amount_std: float = 1.0

    def fit(self, frame: pd.DataFrame) -> "Preprocessor":
        a = np.log1p(frame["Amount"].to_numpy(np.float64))
        self.amount_mean, self.amount_std = float(a.mean()), float(a.std() or 1.0)
        return self

    def transform_arrays(self, time_s: np.ndarray, v: np.ndarray, amount: np.ndarray) -> dict[str, np.ndarray]:
        """``time_s`` float [n] (s), ``v`` float [n, 28], ``amount`` float [n] → the model inputs."""
        amount = np.asarray(amount, np.float64)
        dense = np.empty((len(amount), DENSE_DIM), np.float32)
        dense[:, :-1] = v
        dense[:, -1] = (np.log1p(amount) - self.amount_mean) / self.amount_std
        ids = self.encoder.transform(categorical_fields(np.asarray(time_s, np.float64), amount))
        return {"dense": dense, "sparse_ids": ids}

    def transform_row(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """One parsed transaction, float64 [30] (Time, V1..V28, Amount) → batch-1 model inputs, equal to
        ``transform_arrays`` on it but ~10x faster (Python scalars instead of numpy calls on 1-element arrays)."""
        t, amount = float(x[0]), float(x[-1])
        dense = np.empty((1, DENSE_DIM), np.float32)
        dense[0, :-1] = x[1:-1]
        dense[0, -1] = (math.log1p(amount) - self.amount_mean) / self.amount_std
        hour = int((t // 3600.0) % 24)
        bucket = bisect.bisect_right(AMOUNT_EDGES, amount)
        values = (hour, bucket, round(amount * 100.0) % 100, hour * (len(AMOUNT_EDGES) + 1) + bucket)
        b = self.encoder.hash_buckets
        ids = np.array([[_splitmix64_int((i << 32) | v) % b for i, v in enumerate(values)]], np.int64)
        return {"dense": dense, "sparse_ids": ids}

    def transform(self, frame: pd.DataFrame) -> dict[str, np.ndarray]:
        """A DataFrame with ``Time, V1..V28, Amount`` → the model inputs."""
        return self.transform_arrays(frame["Time"].to_numpy(np.float64), frame[V_COLUMNS].to_numpy(np.float64),
                                     frame["Amount"].to_numpy(np.float64))

    def to_dict(self) -> dict[str, Any]:
        return {"encoder": asdict(self.encoder), "amount_mean": self.amount_mean, "amount_std": self.amount_std,
                "dense": [*V_COLUMNS, "log1p_amount_z"], "sparse_fields": list(SPARSE_FIELDS),
                "amount_edges": list(AMOUNT_EDGES)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Preprocessor":
        if list(d.get("sparse_fields", SPARSE_FIELDS)) != list(SPARSE_FIELDS):
            raise ValueError(f"preprocessor fields {d.get('sparse_fields')} differ from this code's {SPARSE_FIELDS}")
        std = float(d["amount_std"])
        if not math.isfinite(std) or std <= 0:
            raise ValueError(f"amount_std must be a positive number, got {std}")
        return cls(SparseEncoder(**d["encoder"]), float(d["amount_mean"]), std)

    def to_json(self, path) -> None:
        """Write the preprocessor as JSON, to a temporary file renamed into place (never a half-written file)."""
        from dsedge.runtime.files import write_text_atomic

        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path) -> "Preprocessor":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
