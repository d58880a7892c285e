"""Stage ``measure``: CPU latency of each variant at batch 1 (ONNX Runtime's CPU provider on this host, ms).

Timed with the intra-op threads of one instance of the runtime's default CPU layout here (``--threads`` to
choose; ``runtime/instances.py``: on 2 cores or more, ``dsedge.load`` serves a variant on 2 instances of
``cores // 2`` threads), so the figures, and ``--precision auto``'s choice between precisions, are those of serving:
on a 2-core AVX-512 VNNI host, MiniLM's dynamic INT8 was 1.08x faster than fp32 at batch 1 on 2 threads and
1.45x on 1 thread (7.40 vs 8.03 ms, 6.62 vs 9.58 ms). The record says the count (``"threads"``); ``dsedge.load``
scales the figures to the thread counts it opens.

Variants the measured ``auto`` choice already timed keep those timings (taken side by side with the other
candidates); the others are timed here, one after the other.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.bundle import IOSpec
from ...runtime.instances import serving_threads
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


def latency_threads(threads: int | None) -> int:
    """The intra-op threads build-time latency is measured with: ``threads`` (``--threads``), else one serving
    instance's here (``runtime.instances.serving_threads``)."""
    return int(threads) if threads else serving_threads()


def timed_batch(inputs: list[IOSpec]) -> int:
    """The batch size build-time latency is timed at: 1, or the static batch of a model without a dynamic batch
    axis (such a model runs at no other size)."""
    for spec in inputs:
        first = spec.shape[0] if spec.shape else None
        if isinstance(first, int) and not isinstance(first, bool) and first > 1:
            return first
    return 1


def measure_latency(onnx_path: Path, exported: Exported, iterations: int, threads: int | None,
                    vocab_size: int | None = None) -> dict[str, Any]:
    """ORT CPU latency at batch 1 (``timed_batch``: a static batch at its size; sequence 32 for text), ms, on ``latency_threads(threads)`` intra-op threads
    (recorded as ``"threads"``)."""
    from ...runtime.bench import synthetic_inputs
    from ..evaluate import host_backend

    threads = latency_threads(threads)
    backend = host_backend(onnx_path, threads=threads)
    batch = timed_batch(exported.inputs)
    feeds = synthetic_inputs(exported.inputs, batch=batch, seq_len=32, vocab_size=vocab_size)
    stats = time_calls(lambda: backend.run(feeds), iterations=iterations, warmup=5)
    return {str(batch): {**stats, "shape": {k: list(v.shape) for k, v in feeds.items()}, "provider": backend.providers[0],
                  "threads": threads}}


def measure_latency_side_by_side(paths: dict[str, Path], exported: Exported, iterations: int, threads: int | None,
                                 vocab_size: int | None = None) -> dict[str, dict[str, Any]]:
    """ORT CPU latency at batch 1 of several models, interleaved: each round calls every model once (rotating the
    order), so load from other processes falls on all candidates alike. Same record as ``measure_latency`` per
    precision, plus ``"side_by_side"``: the precisions timed together."""
    from ...runtime.bench import latency_stats, synthetic_inputs
    from ..evaluate import host_backend

    threads = latency_threads(threads)
    backends = {p: host_backend(path, threads=threads) for p, path in paths.items()}
    batch = timed_batch(exported.inputs)
    feeds = synthetic_inputs(exported.inputs, batch=batch, seq_len=32, vocab_size=vocab_size)
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
    return {p: {str(batch): {**{k: round(v, 3) for k, v in latency_stats(np.asarray(samples[p])).items()},
                      "n": len(samples[p]), "shape": shape, "provider": backends[p].providers[0],
                      "threads": threads, "side_by_side": names}} for p in names}
