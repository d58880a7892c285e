"""Latency of a callable in milliseconds: a short form of ``runtime.bench`` for build-time and load-time figures."""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .bench import BenchSettings, latency_stats, measure


def time_calls(fn: Callable[[], Any], iterations: int = 50, warmup: int = 5) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times untimed, then ``iterations`` times; return min/mean/p50/p90/p95/p99/max/std in
    ms (nearest-rank percentiles, rounded to 0.001 ms) plus ``n``."""
    samples, _ = measure(fn, BenchSettings(warmup=warmup, iterations=iterations))
    return {**{k: round(v, 3) for k, v in latency_stats(samples).items()}, "n": iterations}


def time_interleaved(fns: Mapping[str, Callable[[], Any]], rounds: int = 30, warmup: int = 3) -> dict[str, list[float]]:
    """Time several callables side by side: ``warmup`` untimed calls of each, then ``rounds`` rounds that call every
    one once, the order rotated by one each round; returns each name's samples in ms. A host whose speed drifts
    during the run moves every path alike, so ratios of their medians are measured side by side."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n]()
            samples[n].append((time.perf_counter() - t0) * 1e3)
    return samples
