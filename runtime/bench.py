"""Latency measurement for a loaded bundle: synthetic inputs, timed runs, percentiles, a diffable JSON report.

The report follows trtexec / perf_analyzer habits: the device and versions first, stable field names with units
(``latency_ms.p99``, ``throughput.inferences_per_s``), and a versioned schema (``schema``/``schema_version``) so
two reports can be compared by a script. Percentiles use the nearest-rank definition (numpy ``inverted_cdf``,
Hyndman & Fan 1996 definition 1): p99 is the smallest measured latency that at least 99 % of runs did not exceed,
always a value that was really observed.

Nothing here imports torch or the SDK; a ``session`` is anything with ``.inputs`` (IOSpec list), ``.run(dict)``,
``.providers``, ``.backend_name`` and ``.manifest``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .bench_compare import (PERCENTILES, REPORT_SCHEMA, REPORT_SCHEMA_VERSION, Comparison,  # noqa: F401
                            compare_reports, load_report, normalize_percentile)
from .bench_load import input_windows, measure_concurrent
from .budget import resolve_budget  # noqa: F401  (bench.resolve_budget: the one rule, runtime/budget.py)
from .bundle import IOSpec
from .device_facts import device_info, tensorrt_version, uses_gpu  # noqa: F401
from .errors import BenchError, InputError
from .io import is_integer, is_real
DEFAULT_ID_RANGE = 100  # token ids below 100 exist in every vocabulary; id values do not change a dense model's latency
_SEQUENCE_WORDS = ("seq", "sequence", "token", "length", "len")


# ----------------------------------------------------------------------------------------------------- inputs
def is_sequence_dim(symbol: str) -> bool:
    """True for symbolic dims that name a token axis (``sequence``, ``seq_len``, ``num_tokens`` …)."""
    s = symbol.lower()
    return any(w in s for w in _SEQUENCE_WORDS)


def resolve_dims(
    specs: Sequence[IOSpec],
    shape_ranges: Mapping[str, Mapping[str, int]] | None,
    batch: int,
    seq_len: int | None = None,
) -> dict[str, int]:
    """Choose a value for every symbolic dim of ``specs``.

    The batch axis is axis 0 of the inputs. A symbolic axis 0 takes ``batch`` and must lie in its ``shape_ranges``
    entry; a static axis 0 accepts only its own size. Other symbols take ``seq_len`` when they name a token axis
    (``is_sequence_dim``) or are the only other symbol, else the range's ``opt`` (then ``min``), else 1 (128 for a
    token axis).

    Returns:
        symbol → size.
    Raises:
        InputError: ``batch``/``seq_len`` below 1, outside the bundle's shape range, or a batch size other than the
            static one on a model without a dynamic batch axis.
    """
    ranges = shape_ranges or {}
    if batch < 1:
        raise InputError(f"batch size {batch} is not positive", "pass --batch 1,8,32")
    if seq_len is not None and seq_len < 1:
        raise InputError(f"sequence length {seq_len} is not positive", "pass --seq-len 128")
    dims: dict[str, int] = {}
    for spec in specs:
        if not spec.shape:
            continue
        first = spec.shape[0]
        if isinstance(first, str):
            dims[first] = batch
        elif isinstance(first, int) and first >= 0 and first != batch:
            raise InputError(
                f"input {spec.name!r} has a static batch axis of {first} (shape {list(spec.shape)}); "
                f"batch {batch} cannot run", f"bench this bundle with --batch {first}, or rebuild it with a dynamic batch axis")
    others = sorted({d for s in specs for d in s.shape[1:] if isinstance(d, str)} - set(dims))
    for sym in others:
        rng = ranges.get(sym, {})
        if seq_len is not None and (is_sequence_dim(sym) or len(others) == 1):
            dims[sym] = seq_len
        elif "opt" in rng or "min" in rng:
            dims[sym] = int(rng.get("opt", rng.get("min")))
        else:
            dims[sym] = 128 if is_sequence_dim(sym) else 1
    batch_symbols = {s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], str)}
    for sym, size in dims.items():
        rng = ranges.get(sym)
        if rng and not (rng.get("min", 1) <= size <= rng.get("max", size)):
            what, flag = ("batch size", "--batch") if sym in batch_symbols else (f"{sym} length", "--seq-len")
            lo, hi = rng.get("min", 1), rng.get("max", "∞")
            raise InputError(f"{what} {size} is outside the bundle's range for {sym!r} [{lo}, {hi}]",
                             f"pass {flag} within [{lo}, {hi}], or rebuild the bundle with a wider shape range")
    return dims


def synthetic_inputs(
    specs: Sequence[IOSpec],
    shape_ranges: Mapping[str, Mapping[str, int]] | None = None,
    batch: int = 1,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs that a bundle accepts, made up from its IO specs (shapes per ``resolve_dims``).

    Integer inputs named like an attention mask are ones (no padding: the full sequence is computed), token-type
    ids are zeros, position ids count 0..n-1, other integers (token ids) are uniform in ``[0, vocab_size)``
    (default ``DEFAULT_ID_RANGE``). Floats are standard normal, bools are True. Arrays are C-contiguous with
    exactly the spec's dtype and rank (a rank-0 input, e.g. ``temperature`` ``[]``, is one 0-d value).

    Returns:
        input name → numpy array.
    Raises:
        InputError: see ``resolve_dims``.
    """
    dims = resolve_dims(specs, shape_ranges, batch, seq_len)
    rng = np.random.default_rng(seed)
    high = int(vocab_size or DEFAULT_ID_RANGE)
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = tuple(dims[d] if isinstance(d, str) else (int(d) if int(d) >= 0 else 1) for d in spec.shape)
        dtype = np.dtype(spec.dtype) if spec.dtype != "bfloat16" else np.dtype("float32")
        name = spec.name.lower()
        if dtype == np.bool_:
            arr = np.ones(shape, dtype=bool)
        elif np.issubdtype(dtype, np.integer):
            if "mask" in name:
                arr = np.ones(shape, dtype=dtype)
            elif "type" in name or "segment" in name:
                arr = np.zeros(shape, dtype=dtype)
            elif "position" in name and shape:
                arr = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            else:
                arr = rng.integers(0, high, size=shape, dtype=dtype)
        else:
            arr = rng.standard_normal(size=shape).astype(dtype)
        out[spec.name] = np.asarray(arr, order="C")  # not ascontiguousarray: it makes a rank-0 input [1]
    return out


# ------------------------------------------------------------------------------------------------ measurement
@dataclass
class BenchSettings:
    """How long to measure. ``iterations`` (exact count) wins over ``duration_s``; neither: 3 s per batch size.

    ``warmup`` runs are made first and not recorded (first runs allocate memory and tune kernels).
    ``min_iterations`` bounds a ``duration_s`` run from below so p99 rests on enough samples.
    """

    warmup: int = 10
    iterations: int | None = None
    duration_s: float | None = None
    min_iterations: int = 10
    percentile: str = "p99"

    def __post_init__(self) -> None:
        """Raises InputError for a count that is not an integer in range or a duration that is not finite > 0."""
        for name, low, flag in (("warmup", 0, " (dsedge bench --warmup 10)"),
                                ("iterations", 1, " (dsedge bench --iterations 10)"), ("min_iterations", 1, "")):
            value = getattr(self, name)
            if value is None and name == "iterations":  # None: run for duration_s instead
                continue
            if not is_integer(value) or value < low:
                raise InputError(f"BenchSettings {name} must be an integer >= {low}, got {value!r}",
                                 f"e.g. BenchSettings({name}=10){flag}")
        d = self.duration_s
        if d is not None and not (is_real(d) and math.isfinite(d) and d > 0):
            raise InputError(f"BenchSettings duration_s must be a finite number of seconds > 0, got {d!r}",
                             "e.g. BenchSettings(duration_s=3.0) (dsedge bench --duration 3)")
        self.percentile = normalize_percentile(self.percentile)


def measure(fn: Callable[[], Any], settings: BenchSettings) -> tuple[np.ndarray, float]:
    """Call ``fn`` ``settings.warmup`` times untimed, then time each call with ``time.perf_counter_ns``.

    Returns:
        (latencies in ms as a float64 array, wall time of the timed loop in s).
    """
    for _ in range(settings.warmup):
        fn()
    clock = time.perf_counter_ns
    samples: list[int] = []
    if settings.iterations is not None:
        n, deadline = settings.iterations, None
    else:
        n, deadline = None, clock() + int((settings.duration_s or 3.0) * 1e9)
    start = clock()
    while True:
        t0 = clock()
        fn()
        t1 = clock()
        samples.append(t1 - t0)
        if n is not None:
            if len(samples) >= n:
                break
        elif t1 >= deadline and len(samples) >= settings.min_iterations:
            break
    wall_s = (clock() - start) / 1e9
    return np.asarray(samples, dtype=np.float64) / 1e6, wall_s


def latency_stats(samples_ms: np.ndarray) -> dict[str, float]:
    """min, mean, p50, p90, p95, p99, max and std of latencies in ms (nearest-rank percentiles)."""
    a = np.asarray(samples_ms, dtype=np.float64)
    if a.size == 0:
        raise BenchError("no latency samples were recorded", "run at least one iteration")
    pct = np.percentile(a, list(PERCENTILES.values()), method="inverted_cdf")
    stats = {"min": float(a.min()), "mean": float(a.mean())}
    stats.update({k: float(v) for k, v in zip(PERCENTILES, pct)})
    stats.update({"max": float(a.max()), "std": float(a.std())})
    return stats


@dataclass
class BatchResult:
    """Measured latency of one (variant, batch size, input shapes) point.

    ``latency_ms`` holds ``latency_stats``; ``passed`` is None when no budget applies.
    """

    variant: str
    batch: int
    shapes: dict[str, list[int]]
    latency_ms: dict[str, float]
    iterations: int
    wall_s: float
    budget_ms: float | None = None
    percentile: str = "p99"
    passed: bool | None = None
    samples_ms: list[float] = field(default_factory=list, repr=False)
    concurrency: int = 1
    inputs: str = "synthetic"

    @property
    def inferences_per_s(self) -> float:
        return self.iterations / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = {
            "variant": self.variant, "batch": self.batch, "shapes": self.shapes, "iterations": self.iterations,
            "wall_s": round(self.wall_s, 6),
            "latency_ms": {k: round(v, 6) for k, v in self.latency_ms.items()},
            "throughput": {"inferences_per_s": round(self.inferences_per_s, 3),
                           "samples_per_s": round(self.inferences_per_s * self.batch, 3)},
            "budget_ms": self.budget_ms, "percentile": self.percentile, "passed": self.passed,
            "concurrency": self.concurrency, "inputs": self.inputs,
        }
        if with_samples:
            d["samples_ms"] = [round(x, 6) for x in self.samples_ms]
        return d


def bench_session(
    session: Any,
    batches: Sequence[int] = (1,),
    seq_len: int | None = None,
    settings: BenchSettings | None = None,
    budget_ms: float | None = None,
    vocab_size: int | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    inputs_label: str = "synthetic",
    concurrency: int = 1,
) -> list[BatchResult]:
    """Measure ``session.run`` per batch size on synthetic inputs (the SDK path a user calls, checks included).

    ``inputs``: real rows (name → array, batch axis 0; ``bench_load.read_inputs_dir``) used instead, in windows of
    ``batch`` rows taken in turn. ``concurrency`` > 1: that many closed-loop clients call ``session.run`` at once
    (each sends its next request when its previous answer is back); latencies are per request, throughput is all
    requests over the wall time.

    Every batch size is checked against the bundle's shapes before anything is timed, so a bad ``--batch 8`` fails
    at once. ``passed`` is ``latency_ms[percentile] <= budget_ms`` (one budget for every batch size: each request in
    a batch waits for the whole batch).

    Raises:
        InputError: a batch size or sequence length the bundle cannot take (see ``resolve_dims``).
        BenchError: the backend fails on the synthetic inputs (a manifest that does not match its model).
    """
    settings = settings or BenchSettings()
    manifest = session.manifest
    vocab = vocab_size or manifest_vocab_size(manifest)
    if concurrency < 1:
        raise InputError(f"concurrency {concurrency} is not positive", "pass --concurrency 1 or more")
    if inputs is not None:
        windows = {b: input_windows(inputs, b) for b in batches}
    else:
        windows = {b: [synthetic_inputs(session.inputs, manifest.shape_ranges, b, seq_len, vocab)] for b in batches}
    variant = getattr(getattr(session, "variant", None), "name", "?")
    results = []
    for b, feeds in windows.items():
        feed = feeds[0]
        _trial_run(session, feed, b)
        if concurrency == 1 and len(feeds) == 1:
            samples, wall = measure(lambda: session.run(feed), settings)
        else:
            samples, wall = measure_concurrent(session.run, feeds, settings, concurrency)
        stats = latency_stats(samples)
        passed = None if budget_ms is None else bool(stats[settings.percentile] <= budget_ms)
        results.append(BatchResult(
            variant=variant, batch=b, shapes={k: list(v.shape) for k, v in feed.items()}, latency_ms=stats,
            iterations=int(samples.size), wall_s=wall, budget_ms=budget_ms, percentile=settings.percentile,
            passed=passed, samples_ms=samples.tolist(), concurrency=concurrency, inputs=inputs_label,
        ))
    return results


def _trial_run(session: Any, feed: Mapping[str, np.ndarray], batch: int) -> None:
    """One untimed run, so a model that rejects the inputs fails with one line instead of a backend traceback."""
    from .errors import DsedgeError

    try:
        session.run(feed)
    except DsedgeError:
        raise
    except Exception as e:  # ORT raises its own types (InvalidArgument, Fail, …)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in feed.items())
        raise BenchError(f"the model failed at batch {batch} ({shapes}): {first[:300]}",
                         "check the manifest's inputs and shape ranges match the model; rebuild the bundle") from None


def manifest_vocab_size(manifest: Any) -> int | None:
    """``source.vocab_size`` (or ``source.config.vocab_size``) of a manifest, if the build recorded it."""
    src = getattr(manifest, "source", {}) or {}
    v = src.get("vocab_size") or (src.get("config") or {}).get("vocab_size")
    return int(v) if v else None


# ------------------------------------------------------------------------------------------------ the report
def build_report(
    session: Any,
    results: Sequence[BatchResult],
    settings: BenchSettings,
    *,
    seq_len: int | None = None,
    threads: int | None = None,
    budget_source: str = "none",
    dsedge_version: str = "",
    with_samples: bool = False,
) -> dict[str, Any]:
    """The JSON-able bench report (schema ``dsedge.bench-report/1``).

    Top-level fields: ``schema``, ``schema_version``, ``dsedge_version``, ``created_utc``, ``device`` (see
    ``device_info``), ``bundle`` (path, name, target, variant, precision), ``settings``, ``results`` (one
    ``BatchResult.to_dict`` per batch size), ``passed`` (False if any result failed its budget; None when no
    budget applied) and ``notes`` (lines a reader must not miss, e.g. a GPU bundle measured on a CPU).
    """
    manifest = session.manifest
    verdicts = [r.passed for r in results if r.passed is not None]
    variant = getattr(session, "variant", None)
    return {
        "schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION, "dsedge_version": dsedge_version,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_info(session),
        "bundle": {"path": str(getattr(session, "path", "")), "name": manifest.name,
                   "target": str(manifest.target.get("name", "?")),
                   "variant": getattr(variant, "name", None), "precision": getattr(variant, "precision", None)},
        "settings": {"warmup": settings.warmup, "iterations": settings.iterations, "duration_s": settings.duration_s,
                     "threads": threads, "seq_len": seq_len, "percentile": settings.percentile,
                     "budget_ms": results[0].budget_ms if results else None, "budget_source": budget_source,
                     "percentile_method": "nearest-rank"},
        "results": [r.to_dict(with_samples) for r in results],
        "passed": (all(verdicts) if verdicts else None),
        "notes": [],
    }


