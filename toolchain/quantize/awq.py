"""AWQ: activation-aware weight quantization (Lin et al., arXiv:2306.00978).

Salient input channels (large mean ``|x|``) are protected by scaling them up before quantization:
``y = (x / s) @ Q(diag(s) W)``, with ``s = mean|x|^alpha`` and ``alpha`` in [0, 1] chosen by grid search to
minimise the layer group's output error on calibration data (paper Sec. 3.2, Eq. 4-5). Layers that read the same
activation (e.g. attention Q, K, V) share one ``s`` as in the paper. Each scaled weight is then quantized with the
output-aware clip search (the paper's weight clipping), per block. In the ONNX graph ``x / s`` is a Mul by the
float32 ``[K]`` vector ``1/s`` in front of the group (what ModelOpt's awq_lite also emits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...runtime.errors import CalibrationError
from .blockwise import BlockwiseWeight, check_finite, quantize_blockwise

ALPHA_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))


@dataclass
class AWQResult:
    """AWQ outcome for one group of layers sharing an input ``[rows, K]``.

    scale: float32 ``[K]`` (``s``; the graph multiplies the input by ``1/s``); alpha: chosen exponent;
    weights: one BlockwiseWeight of ``diag(s) W_i`` per layer; error_rtn / error_awq: mean squared output error
    (per output element) of plain RTN and of AWQ on the calibration rows used for the search.
    """

    scale: np.ndarray
    alpha: float
    weights: list[BlockwiseWeight] = field(default_factory=list)
    error_rtn: float = 0.0
    error_awq: float = 0.0


def _output_error(x: np.ndarray, ref: list[np.ndarray], deq: list[np.ndarray]) -> float:
    tot, cnt = 0.0, 0
    for y, wq in zip(ref, deq):
        d = x @ wq - y
        tot += float(np.sum(d * d))
        cnt += d.size
    return tot / max(cnt, 1)


def awq_search(weights: list[np.ndarray], x: np.ndarray, *, bits: int = 4, block_size: int = 32,
               symmetric: bool = True, search_rows: int = 512, names: list[str] | None = None,
               clip_search: bool = True, seed: int = 0) -> AWQResult:
    """Search AWQ's per-input-channel scale for layers ``weights`` (each float32 ``[K, N_i]``) reading ``x``.

    Args:
        x: float32 calibration activations ``[rows, K]`` of the group's common input.
        search_rows: rows used for the alpha grid search (random subsample; all rows feed the final clip search).
    Returns:
        AWQResult; ``alpha = 0`` (``s = 1``) when scaling does not help, so AWQ is never worse than RTN on the
        search rows.
    Raises:
        CalibrationError on empty activations; QuantizationError on NaN/Inf weights.
    """
    names = names or [f"weight{i}" for i in range(len(weights))]
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise CalibrationError(f"no calibration activations for layer {names[0]!r}", "give a non-empty calibration set")
    for w, nm in zip(weights, names):
        check_finite(w, nm)
    rng = np.random.default_rng(seed)
    xs = x if x.shape[0] <= search_rows else x[rng.choice(x.shape[0], search_rows, replace=False)]
    ref = [xs @ w for w in weights]
    x_mag = np.abs(x).mean(axis=0).astype(np.float64)
    x_mag = np.maximum(x_mag, 1e-6 * max(float(x_mag.max()), 1e-12))
    best = (np.inf, 0.0, np.ones(x.shape[1], np.float32))
    err_rtn = None
    for alpha in ALPHA_GRID:
        s = x_mag ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)    # centre the scales around 1 (reference code)
        deq = [quantize_blockwise(w * s[:, None], bits=bits, block_size=block_size, symmetric=symmetric,
                                  clip_search=False).dequantize() / s[:, None] for w in weights]
        err = _output_error(xs, ref, deq)
        if alpha == 0.0:
            err_rtn = err
        if err < best[0]:
            best = (err, float(alpha), s)
    _, alpha, s = best
    h = (x / s).T.astype(np.float64) @ (x / s).astype(np.float64)     # Hessian of the scaled input
    qws = [quantize_blockwise(w * s[:, None], bits=bits, block_size=block_size, symmetric=symmetric,
                              clip_search=clip_search, hessian=h.astype(np.float32), name=nm)
           for w, nm in zip(weights, names)]
    err_awq = _output_error(xs, ref, [q.dequantize() / s[:, None] for q in qws])
    return AWQResult(s, alpha, qws, float(err_rtn), err_awq)
