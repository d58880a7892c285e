"""GPTQ: second-order weight quantization with error feedback (Frantar et al., arXiv:2210.17323, Algorithm 1).

For ``y = x @ W`` with ``W`` ``[K, N]`` and calibration activations ``X`` ``[rows, K]``, GPTQ quantizes the K input
rows of ``W`` one at a time and spreads each row's rounding error over the not-yet-quantized rows through the
inverse Hessian ``H^-1`` of the layer's squared output error (``H = 2 X^T X``), using the Cholesky form of
``H^-1`` and lazy batched updates (paper Sec. 4, "Step 2/3"). Unlike re-quantizing GPTQ's float result, the codes
returned are exactly the ones the algorithm chose, with the scales it used.

Scales are fixed per block *before* the sweep ("static groups", computed by the activation-weighted clip search
on the original weight), so the optional activation order (``act_order``: columns by decreasing ``diag(H)``)
still yields contiguous K-blocks that ONNX ``DequantizeLinear(block_size)`` can express.
"""
from __future__ import annotations

import numpy as np

from ...runtime.errors import CalibrationError
from .blockwise import BlockwiseWeight, expand_blocks, qrange, quantize_blockwise


def hessian(x: np.ndarray) -> np.ndarray:
    """``2/rows * X^T X`` as float64 ``[K, K]`` from activations ``[rows, K]``."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    if x.shape[0] == 0:
        raise CalibrationError("no calibration activations for GPTQ", "give a non-empty calibration set")
    return 2.0 / x.shape[0] * (x.T @ x)


def gptq_quantize(w: np.ndarray, x: np.ndarray | None = None, *, h: np.ndarray | None = None, bits: int = 4,
                  block_size: int = 32, symmetric: bool = True, damp: float = 0.01, act_order: bool = True,
                  lazy_batch: int = 128, name: str = "weight") -> BlockwiseWeight:
    """GPTQ codes and scales for a float ``[K, N]`` weight.

    Args:
        w: float32 ``[K, N]``.
        x: calibration activations ``[rows, K]`` (or give ``h``, the ``[K, K]`` Hessian from :func:`hessian`).
        damp: dampening added to ``diag(H)``, as a fraction of its mean (paper: 1 %).
        act_order: quantize input channels by decreasing ``diag(H)`` (the reference code's ``--act-order``).
        lazy_batch: columns per lazy update batch (paper: 128).
    Returns:
        BlockwiseWeight (codes ``[K, N]``, scales ``[ceil(K/bs), N]``) such that ``x @ dequantize()`` approximates
        ``x @ w`` in the least-squares sense.
    Raises:
        QuantizationError on NaN/Inf weights; CalibrationError on empty activations.
    """
    import torch

    if h is None:
        if x is None:
            raise CalibrationError(f"GPTQ needs calibration activations for layer {name!r}",
                                   "pass calibration data")
        h = hessian(x)
    k, n = w.shape
    hd = np.diag(h).copy()
    # Static groups: per-block scales from the original weight, weighted by the activation energy diag(H).
    base = quantize_blockwise(w, bits=bits, block_size=block_size, symmetric=symmetric, clip_search=True,
                              name=name, importance=np.maximum(hd, 0) + 1e-8)
    bs = base.block_size
    scale_k = torch.from_numpy(expand_blocks(base.scales, bs, k)).double()          # [K, N]
    zp_k = None if base.zero_points is None else \
        torch.from_numpy(expand_blocks(base.zero_points.astype(np.float64), bs, k))
    qmin, qmax = qrange(bits, symmetric)

    W = torch.from_numpy(np.asarray(w, np.float64)).clone()                        # rows = input channels
    H = torch.from_numpy(np.asarray(h, np.float64)).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[dead, :] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    inv = torch.argsort(perm)
    W, H = W[perm], H[perm][:, perm]
    scale_k, zp_k = scale_k[perm], None if zp_k is None else zp_k[perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    for extra in (0.0, 0.1, 1.0, 10.0):               # raise the dampening if H is not positive definite
        L, info = torch.linalg.cholesky_ex(H + extra * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype))
        if int(info) == 0:
            break
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)             # upper Cholesky of H^-1
    Q = torch.zeros_like(W)
    for i1 in range(0, k, lazy_batch):
        i2 = min(i1 + lazy_batch, k)
        W1 = W[i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        E1 = torch.zeros_like(W1)
        Hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            row, d = W1[i], Hinv1[i, i]
            s = scale_k[i1 + i]
            q = torch.round(row / s)
            if zp_k is not None:
                q = q + zp_k[i1 + i]
            q = torch.clamp(q, qmin, qmax)
            Q1[i] = q
            deq = (q - (0 if zp_k is None else zp_k[i1 + i])) * s
            err = (row - deq) / d
            W1[i:] -= torch.outer(Hinv1[i, i:], err)
            E1[i] = err
        Q[i1:i2] = Q1
        W[i2:] -= hinv[i1:i2, i2:].T @ E1
    codes = Q[inv].numpy().astype(np.int16)           # dead channels stay 0 (their rows get no updates)
    return BlockwiseWeight(codes, base.scales, base.zero_points, bs, bits)
