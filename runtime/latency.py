"""Latency measurement of a backend: warm-up, timed runs, percentiles in milliseconds."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def percentiles_ms(samples_ms: list[float] | np.ndarray) -> dict[str, float]:
    """min/mean/p50/p90/p95/p99/max of latency samples (ms), rounded to 0.001 ms."""
    a = np.asarray(samples_ms, dtype=np.float64)
    q = np.percentile(a, [50, 90, 95, 99])
    vals = {"min": a.min(), "mean": a.mean(), "p50": q[0], "p90": q[1], "p95": q[2], "p99": q[3], "max": a.max()}
    return {k: round(float(v), 3) for k, v in vals.items()}


def time_calls(fn: Callable[[], Any], iterations: int = 50, warmup: int = 5) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times untimed, then ``iterations`` times; return ``percentiles_ms`` plus ``n``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return {**percentiles_ms(samples), "n": iterations}
