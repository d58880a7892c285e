"""Latency of a callable in milliseconds: a short form of ``runtime.bench`` for build-time and load-time figures."""
from __future__ import annotations

from typing import Any, Callable

from .bench import BenchSettings, latency_stats, measure


def time_calls(fn: Callable[[], Any], iterations: int = 50, warmup: int = 5) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times untimed, then ``iterations`` times; return min/mean/p50/p90/p95/p99/max/std in
    ms (nearest-rank percentiles, rounded to 0.001 ms) plus ``n``."""
    samples, _ = measure(fn, BenchSettings(warmup=warmup, iterations=iterations))
    return {**{k: round(v, 3) for k, v in latency_stats(samples).items()}, "n": iterations}
