"""Device side: sliding-window inference over a whole volume through a dsedge bundle, patches batched under a
latency budget. Imports numpy and dsedge only (no torch), as on a Jetson image.

    >>> import dsedge
    >>> from samples.ct.infer import session_runner, plan_batch, sliding_window
    >>> s = dsedge.load("out/ct-student-cpu.dse", threads=2)
    >>> run = session_runner(s)
    >>> plan = plan_batch(run, budget_ms=250)
    >>> prob, stats = sliding_window(run, scan.image, scan.mask, scan.meta, plan.batch_size)

The window scheme follows nnU-Net's (Isensee et al., Nature Methods 2021): overlapping windows, each window's output
weighted by a Gaussian centred on the window so that border cells (less context) count less.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

PATCH = 32
CELL = 2
RunBatch = Callable[[np.ndarray, np.ndarray], np.ndarray]   # (B,1,32,32,32) f32, (B,M) f32 → (B, 4096, 2) f32


def session_runner(session) -> RunBatch:
    """Wrap a ``dsedge.Session`` (inputs ``patch``, ``meta``; output ``cell_logits``) as a batch function."""
    out_name = session.outputs[0].name

    def run(patches: np.ndarray, meta: np.ndarray) -> np.ndarray:
        return session.run({"patch": patches, "meta": meta})[out_name]

    return run


@dataclass
class BatchPlan:
    """The batch size chosen for a latency budget and the profile it was chosen from.

    Attributes:
        batch_size: the largest measured batch whose latency is within ``budget_ms`` (1 when none is).
        budget_ms: the per-batch latency budget in ms.
        latency_ms: batch size → measured latency in ms (the slower of ``repeats`` runs after a warm-up run).
        within_budget: whether ``batch_size`` met the budget (False when even batch 1 is slower).
    """

    batch_size: int
    budget_ms: float
    latency_ms: dict[int, float] = field(default_factory=dict)
    within_budget: bool = True


def plan_batch(run: RunBatch, budget_ms: float, meta_dim: int = 6, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
               repeats: int = 2) -> BatchPlan:
    """Measure latency per batch size and pick the largest batch that meets ``budget_ms``.

    Stops at the first batch size over budget (latency grows with batch). Times are wall-clock ms of ``run``.
    """
    prof: dict[int, float] = {}
    best, ok = candidates[0], False
    for b in candidates:
        x = np.zeros((b, 1, PATCH, PATCH, PATCH), np.float32)
        m = np.zeros((b, meta_dim), np.float32)
        run(x, m)                                         # warm-up (allocations, kernel choice)
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            run(x, m)
            ts.append((time.perf_counter() - t) * 1e3)
        prof[b] = round(max(ts), 3)
        if prof[b] <= budget_ms:
            best, ok = b, True
        else:
            break
    return BatchPlan(best, float(budget_ms), prof, ok)


def window_origins(shape: tuple[int, ...], mask: np.ndarray | None = None, patch: int = PATCH,
                   stride: int = PATCH // 2) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Window origins (K, 3) on a grid of ``stride`` covering ``shape`` (padded at the far end), keeping only windows
    whose central ``stride``³ region touches the lung ``mask`` (when given).

    Returns:
        (origins int (K, 3), padded shape).
    """
    if stride % CELL or patch % CELL:
        raise ValueError("patch and stride must be multiples of the cell size")
    padded = tuple(max(patch, int(np.ceil((n - patch) / stride)) * stride + patch) for n in shape)
    axes = [np.arange(0, p - patch + 1, stride) for p in padded]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    if mask is not None:
        m = np.zeros(padded, dtype=bool)
        m[tuple(slice(0, n) for n in shape)] = mask
        q = (patch - stride) // 2
        keep = [bool(m[o[0] + q:o[0] + q + stride, o[1] + q:o[1] + q + stride, o[2] + q:o[2] + q + stride].any())
                for o in grid]
        grid = grid[np.asarray(keep, dtype=bool)]
    return grid.astype(int), padded  # type: ignore[return-value]


def gaussian_weights(cells: int = PATCH // CELL, sigma_frac: float = 0.25) -> np.ndarray:
    """float32 (cells, cells, cells) Gaussian importance map, sigma = ``sigma_frac`` × window size, max 1."""
    c = (np.arange(cells) - (cells - 1) / 2) / (sigma_frac * cells)
    g = np.exp(-0.5 * c ** 2)
    w = g[:, None, None] * g[None, :, None] * g[None, None, :]
    return (w / w.max()).astype(np.float32)


def lesion_probability(logits: np.ndarray) -> np.ndarray:
    """Two-class logits (..., 2) → P(lesion) (...), numerically stable sigmoid of the logit difference."""
    d = (logits[..., 1] - logits[..., 0]).astype(np.float64)
    return (0.5 * (1.0 + np.tanh(0.5 * d))).astype(np.float32)


class _Accumulator:
    """Gaussian-weighted average of window outputs on the padded cell grid."""

    def __init__(self, image: np.ndarray, mask: np.ndarray | None, stride: int) -> None:
        self.shape = image.shape
        self.origins, padded = window_origins(image.shape, mask, PATCH, stride)
        self.n_total = int(np.prod([(p - PATCH) // stride + 1 for p in padded]))
        self.vol = np.zeros(padded, dtype=np.float32)
        self.vol[tuple(slice(0, n) for n in image.shape)] = image
        cshape = tuple(p // CELL for p in padded)
        self.acc = np.zeros(cshape, dtype=np.float32)
        self.wsum = np.zeros(cshape, dtype=np.float32)
        self.w = gaussian_weights()

    def patch(self, k: int) -> np.ndarray:
        o = self.origins[k]
        return self.vol[o[0]:o[0] + PATCH, o[1]:o[1] + PATCH, o[2]:o[2] + PATCH]

    def add(self, k: int, logits: np.ndarray) -> None:
        cells = PATCH // CELL
        p = lesion_probability(np.asarray(logits)).reshape(cells, cells, cells)
        c = self.origins[k] // CELL
        sl = (slice(c[0], c[0] + cells), slice(c[1], c[1] + cells), slice(c[2], c[2] + cells))
        self.acc[sl] += self.w * p
        self.wsum[sl] += self.w

    def result(self) -> np.ndarray:
        prob = np.divide(self.acc, self.wsum, out=np.zeros_like(self.acc), where=self.wsum > 0)
        return prob[tuple(slice(0, -(-n // CELL)) for n in self.shape)]


def sliding_window(run: RunBatch, image: np.ndarray, mask: np.ndarray | None, meta: np.ndarray, batch_size: int,
                   stride: int = PATCH // 2) -> tuple[np.ndarray, dict]:
    """Lesion probability per cell for a whole volume, windows run in batches of ``batch_size`` (``Session.run``).

    Args:
        run: batch function (``session_runner`` or the torch baseline's).
        image: float32 (z, y, x) lung-windowed volume at the model's spacing.
        mask: bool lung mask (z, y, x) to skip windows without lung, or None for all windows.
        meta: float32 (M,) metadata vector of the volume.
        batch_size: windows per ``run`` call (from ``plan_batch``).
        stride: window step in voxels (default half a window: 50 % overlap).
    Returns:
        (prob float32 (ceil(z/2), ceil(y/2), ceil(x/2)) in [0, 1], 0 where no window ran;
         stats: windows, windows_total, batches, batch_size, seconds (wall, whole loop incl. gather/scatter),
         patches_per_s, max_batch_ms).
    """
    acc = _Accumulator(image, mask, stride)
    meta = np.asarray(meta, dtype=np.float32)
    t0 = time.perf_counter()
    max_ms, n_batches = 0.0, 0
    n = len(acc.origins)
    for b0 in range(0, n, batch_size):
        ks = range(b0, min(b0 + batch_size, n))
        x = np.stack([acc.patch(k) for k in ks])[:, None]
        m = np.broadcast_to(meta, (len(ks), meta.shape[0])).copy()
        tb = time.perf_counter()
        logits = np.asarray(run(np.ascontiguousarray(x), m))
        max_ms = max(max_ms, (time.perf_counter() - tb) * 1e3)
        n_batches += 1
        for k, lg in zip(ks, logits):
            acc.add(k, lg)
    seconds = time.perf_counter() - t0
    stats = {"mode": "run", "windows": n, "windows_total": acc.n_total, "batches": n_batches,
             "batch_size": int(batch_size), "seconds": round(seconds, 4),
             "patches_per_s": round(n / seconds, 2) if seconds > 0 else None, "max_batch_ms": round(max_ms, 2)}
    return acc.result(), stats


def sliding_window_stream(session, image: np.ndarray, mask: np.ndarray | None, meta: np.ndarray, budget_ms: float,
                          stride: int = PATCH // 2, window: int | None = None) -> tuple[np.ndarray, dict]:
    """As ``sliding_window``, but each window is one request to ``session.stream(..., budget_ms=)``: the session's
    budget scheduler forms the batches. Windows the scheduler rejects (budget it cannot meet) are counted in
    ``stats['rejected']`` and then run with ``session.run`` so the volume is still covered (a scan must not lose
    windows silently). ``window``: requests in flight (``Session.stream``'s; default two full batches).

    Returns:
        (prob, stats with mode, windows, rejected, seconds, patches_per_s, latency_ms_p50/p99, within_budget,
         mean_batch).
    """
    acc = _Accumulator(image, mask, stride)
    out_name = session.outputs[0].name
    meta1 = np.asarray(meta, dtype=np.float32)[None]
    n = len(acc.origins)
    t0 = time.perf_counter()
    lat, batches, rejected, within = [], [], [], 0
    items = ({"patch": acc.patch(k)[None, None].copy(), "meta": meta1} for k in range(n))
    # ordered=True: answers in window order, so the stitching sums in the same order as sliding_window
    for ans in session.stream(items, budget_ms=budget_ms, ordered=True, window=window):
        if getattr(ans, "ok", False):
            acc.add(ans.id, ans.outputs[out_name][0])
            lat.append(ans.latency_ms)
            batches.append(ans.batch_size)
            within += int(ans.latency_ms <= budget_ms)
        else:
            rejected.append(ans.id)
    for k in rejected:
        acc.add(k, session.run({"patch": acc.patch(k)[None, None].copy(), "meta": meta1})[out_name][0])
    seconds = time.perf_counter() - t0
    stats = {"mode": "stream", "windows": n, "windows_total": acc.n_total, "rejected": len(rejected),
             "budget_ms": float(budget_ms), "seconds": round(seconds, 4),
             "patches_per_s": round(n / seconds, 2) if seconds > 0 else None,
             "latency_ms_p50": round(float(np.percentile(lat, 50)), 2) if lat else None,
             "latency_ms_p99": round(float(np.percentile(lat, 99)), 2) if lat else None,
             "within_budget": round(within / max(len(lat), 1), 4),
             "mean_batch": round(float(np.mean(batches)), 2) if batches else None}
    return acc.result(), stats
