"""Blockwise integer quantization of one weight matrix (numpy), shared by RTN, AWQ, GPTQ and mixed precision.

Convention (ONNX MatMul): a weight ``W`` has shape ``[K, N]`` (K = input features, N = output features) and
``y = x @ W``. Blocks run along K: block ``b`` of column ``n`` is ``W[b*bs:(b+1)*bs, n]`` and has one scale
(``scales[b, n]``), exactly as ONNX ``DequantizeLinear(axis=0, block_size=bs)`` reads them (opset 21).
Symmetric INT4 uses codes in [-8, 7] with zero point 0 (what TensorRT's INT4 dequantize needs); asymmetric uses
codes in [0, 15] with a per-block zero point.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime.errors import QuantizationError

#: Clip ratios tried by the MSE scale search (1.0 = plain absmax / range).
CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.55, 10), 3))


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer code range: signed ``[-2^(b-1), 2^(b-1)-1]`` when symmetric, unsigned ``[0, 2^b-1]`` otherwise."""
    if symmetric:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


@dataclass
class BlockwiseWeight:
    """Integer codes and scales of one ``[K, N]`` weight.

    codes: int16 array ``[K, N]`` (values fit ``bits``); scales: float32 ``[ceil(K/bs), N]``; zero_points: int16
    ``[ceil(K/bs), N]`` or None (symmetric); block_size: ``bs`` (``K`` for per-channel); bits: 4 or 8.
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    block_size: int
    bits: int

    def dequantize(self) -> np.ndarray:
        """float32 ``[K, N]`` = (codes - zero_point) * scale, broadcast per block."""
        return dequantize_blockwise(self.codes, self.scales, self.zero_points, self.block_size)

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None


def expand_blocks(a: np.ndarray, block_size: int, k: int) -> np.ndarray:
    """Repeat a per-block ``[B, N]`` array along K to ``[K, N]``."""
    return np.repeat(a, block_size, axis=0)[:k]


def dequantize_blockwise(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                         block_size: int) -> np.ndarray:
    """float32 ``[K, N]`` from codes ``[K, N]`` and per-block scales/zero points ``[ceil(K/bs), N]``."""
    k = codes.shape[0]
    c = codes.astype(np.float32)
    if zero_points is not None:
        c = c - expand_blocks(zero_points.astype(np.float32), block_size, k)
    return c * expand_blocks(scales.astype(np.float32), block_size, k)


def check_finite(w: np.ndarray, name: str) -> None:
    """Raise QuantizationError naming the layer when ``w`` holds NaN or Inf."""
    if not np.all(np.isfinite(w)):
        bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
        raise QuantizationError(f"weight of layer {name!r} holds {bad} NaN/Inf values",
                                "fix or retrain the model; NaN/Inf weights cannot be quantized")


def _blocks(w: np.ndarray, block_size: int) -> np.ndarray:
    """``[K, N]`` → ``[B, bs, N]``, zero-padding K up to a multiple of ``bs``."""
    k, n = w.shape
    nb = -(-k // block_size)
    pad = nb * block_size - k
    if pad:
        w = np.concatenate([w, np.zeros((pad, n), w.dtype)], axis=0)
    return w.reshape(nb, block_size, n)


def scales_for(wmin: np.ndarray, wmax: np.ndarray, bits: int, symmetric: bool,
               clip: float | np.ndarray = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
    """Scale (and zero point) of blocks with the given min/max, range shrunk by ``clip``.

    Symmetric: ``s = clip * absmax / qmax`` (qmax = 7 for INT4; -8 stays reachable for rounding).
    Asymmetric: ``s = clip * (max - min) / (2^b - 1)``, ``z = round(-clip*min / s)`` clamped to the code range.
    """
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        absmax = np.maximum(np.abs(wmin), np.abs(wmax)) * clip
        s = np.where(absmax > 0, absmax / qmax, 1.0).astype(np.float32)
        return s, None
    lo = np.minimum(wmin, 0) * clip
    hi = np.maximum(wmax, 0) * clip
    s = np.where(hi > lo, (hi - lo) / (qmax - qmin), 1.0).astype(np.float32)
    z = np.clip(np.round(-lo / s), qmin, qmax).astype(np.int16)
    return s, z


def quantize_with(w: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, block_size: int,
                  bits: int) -> np.ndarray:
    """int16 codes ``[K, N]`` of ``w`` for fixed per-block scales/zero points (round to nearest, clamp)."""
    symmetric = zero_points is None
    qmin, qmax = qrange(bits, symmetric)
    k = w.shape[0]
    q = np.round(w / expand_blocks(scales, block_size, k))
    if zero_points is not None:
        q = q + expand_blocks(zero_points.astype(np.float32), block_size, k)
    return np.clip(q, qmin, qmax).astype(np.int16)


def quantize_blockwise(w: np.ndarray, *, bits: int = 4, block_size: int = 32, symmetric: bool = True,
                       clip_search: bool = True, name: str = "weight",
                       importance: np.ndarray | None = None, hessian: np.ndarray | None = None,
                       clip_grid: tuple[float, ...] = CLIP_GRID) -> BlockwiseWeight:
    """Round-to-nearest blockwise quantization of a float ``[K, N]`` weight.

    With ``clip_search`` the clip ratio of each block is chosen from ``clip_grid`` (default ``CLIP_GRID``) to minimise the block's squared
    error, weighted per input channel by ``importance`` (float ``[K]``, e.g. mean x² of the calibration
    activations; None = plain weight MSE). This is the grid search of GPTQ's reference code / AWQ's clip search
    restricted to one block. With ``hessian`` (``[K, K]`` = X^T X of the calibration activations) the error is the
    block's exact output error ``d^T H_b d`` (H_b = the block's diagonal block of H), AWQ's output-aware clip.
    Raises QuantizationError on NaN/Inf or a block size < 1.
    """
    check_finite(w, name)
    if block_size < 1:
        raise QuantizationError(f"block size {block_size} for layer {name!r} is not positive",
                                "use 32, 64 or 128")
    w = np.asarray(w, np.float32)
    k, n = w.shape
    bs = min(block_size, k) if block_size >= k else block_size
    wb = _blocks(w, bs)                                   # [B, bs, N]
    wmin, wmax = wb.min(axis=1), wb.max(axis=1)           # [B, N]
    if not clip_search:
        s, z = scales_for(wmin, wmax, bits, symmetric)
        return BlockwiseWeight(quantize_with(w, s, z, bs, bits), s, z, bs, bits)
    imp = np.ones(k, np.float32) if importance is None else np.asarray(importance, np.float32)
    impb = _blocks(imp[:, None], bs)                      # [B, bs, 1]
    hb = None
    if hessian is not None:
        nb = wb.shape[0]
        hp = np.zeros((nb * bs, nb * bs), np.float32)
        hp[:k, :k] = hessian
        hb = np.stack([hp[b * bs:(b + 1) * bs, b * bs:(b + 1) * bs] for b in range(nb)])   # [B, bs, bs]
    best_err = np.full(wmin.shape, np.inf, np.float32)
    best_s = np.zeros_like(best_err)
    best_z = None if symmetric else np.zeros(wmin.shape, np.int16)
    qmin, qmax = qrange(bits, symmetric)
    for clip in clip_grid:
        s, z = scales_for(wmin, wmax, bits, symmetric, clip)
        q = np.round(wb / s[:, None, :])
        if z is not None:
            q = q + z[:, None, :]
        q = np.clip(q, qmin, qmax)
        deq = (q - (0 if z is None else z[:, None, :])) * s[:, None, :]
        d = deq - wb
        err = np.einsum("bin,bin->bn", d, hb @ d) if hb is not None else ((d ** 2) * impb).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        if z is not None:
            best_z = np.where(better, z, best_z)
    return BlockwiseWeight(quantize_with(w, best_s, best_z, bs, bits), best_s.astype(np.float32), best_z, bs, bits)
