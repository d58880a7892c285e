"""Stage ``measure``: CPU latency of each variant at batch 1 (ONNX Runtime's CPU provider on this host, ms).

Variants the measured ``auto`` choice already timed keep those timings (taken side by side with the other
candidates); the others are timed here, one after the other.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.latency import time_calls
from ..artifacts import Choice, Prepared, VariantDraft
from ..config import BuildPlan
from ..export import Exported


def measure(plan: BuildPlan, model: Prepared, choice: Choice, variants: list[VariantDraft]) -> list[VariantDraft]:
    """Fill ``latency_ms`` of every variant: ``{"1": {p50, p99, mean, …, "shape", "provider"}}`` (ms)."""
    cfg = plan.config
    for v in variants:
        if v.name in choice.measured:
            v.latency_ms = choice.measured[v.name].latency_ms
        else:
            v.latency_ms = measure_latency(v.path, model.exported, cfg.latency_iterations, cfg.threads,
                                           model.source.vocab_size)
    return variants


def measure_latency(onnx_path: Path, exported: Exported, iterations: int, threads: int | None,
                    vocab_size: int | None = None) -> dict[str, Any]:
    """ORT CPU latency at batch 1 (sequence 32 for text), ms."""
    from ...runtime.backends.ort import OrtBackend
    from ...runtime.bench import synthetic_inputs

    backend = OrtBackend(onnx_path, providers=["CPUExecutionProvider"], threads=threads)
    feeds = synthetic_inputs(exported.inputs, batch=1, seq_len=32, vocab_size=vocab_size)
    stats = time_calls(lambda: backend.run(feeds), iterations=iterations, warmup=5)
    return {"1": {**stats, "shape": {k: list(v.shape) for k, v in feeds.items()}, "provider": backend.providers[0]}}


def measure_latency_side_by_side(paths: dict[str, Path], exported: Exported, iterations: int, threads: int | None,
                                 vocab_size: int | None = None) -> dict[str, dict[str, Any]]:
    """ORT CPU latency at batch 1 of several models, interleaved: each round calls every model once (rotating the
    order), so load from other processes falls on all candidates alike. Same record as ``measure_latency`` per
    precision, plus ``"side_by_side"``: the precisions timed together."""
    from ...runtime.backends.ort import OrtBackend
    from ...runtime.bench import latency_stats, synthetic_inputs

    backends = {p: OrtBackend(path, providers=["CPUExecutionProvider"], threads=threads) for p, path in paths.items()}
    feeds = synthetic_inputs(exported.inputs, batch=1, seq_len=32, vocab_size=vocab_size)
    for b in backends.values():
        for _ in range(5):
            b.run(feeds)
    names = list(backends)
    samples: dict[str, list[float]] = {p: [] for p in names}
    for r in range(max(iterations, 1)):
        for p in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter_ns()
            backends[p].run(feeds)
            samples[p].append((time.perf_counter_ns() - t0) / 1e6)
    shape = {k: list(v.shape) for k, v in feeds.items()}
    return {p: {"1": {**{k: round(v, 3) for k, v in latency_stats(np.asarray(samples[p])).items()},
                      "n": len(samples[p]), "shape": shape, "provider": backends[p].providers[0],
                      "side_by_side": names}} for p in names}
