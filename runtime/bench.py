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

import json
import os
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .bundle import IOSpec
from .errors import BenchError, InputError
from .schema import validate

REPORT_SCHEMA = "dsedge.bench-report/1"
LEGACY_SCHEMAS = ("dsedge.bench",)  # the same format, version 1, under its former name
REPORT_SCHEMA_VERSION = 1
PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}
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
    exactly the spec's dtype.

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
        out[spec.name] = np.ascontiguousarray(arr)
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
        if self.warmup < 0:
            raise InputError(f"warmup {self.warmup} is negative", "pass --warmup 0 or more")
        if self.iterations is not None and self.iterations < 1:
            raise InputError(f"iterations {self.iterations} is not positive", "pass --iterations 100")
        if self.duration_s is not None and self.duration_s <= 0:
            raise InputError(f"duration {self.duration_s} s is not positive", "pass --duration 3")
        self.percentile = normalize_percentile(self.percentile)


def normalize_percentile(p: str | int | float) -> str:
    """``"p99"``, ``"99"`` or ``99`` → ``"p99"``; one of p50/p90/p95/p99. Raises InputError."""
    key = str(p).strip().lower()
    key = key if key.startswith("p") else f"p{key}"
    key = key[:-2] if key.endswith(".0") else key
    if key not in PERCENTILES:
        raise InputError(f"unknown percentile {p!r}", f"choose one of {', '.join(PERCENTILES)}")
    return key


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
) -> list[BatchResult]:
    """Measure ``session.run`` per batch size on synthetic inputs (the SDK path a user calls, checks included).

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
    feeds = {b: synthetic_inputs(session.inputs, manifest.shape_ranges, b, seq_len, vocab) for b in batches}
    variant = getattr(getattr(session, "variant", None), "name", "?")
    results = []
    for b, feed in feeds.items():
        _trial_run(session, feed, b)
        samples, wall = measure(lambda: session.run(feed), settings)
        stats = latency_stats(samples)
        passed = None if budget_ms is None else bool(stats[settings.percentile] <= budget_ms)
        results.append(BatchResult(
            variant=variant, batch=b, shapes={k: list(v.shape) for k, v in feed.items()}, latency_ms=stats,
            iterations=int(samples.size), wall_s=wall, budget_ms=budget_ms, percentile=settings.percentile,
            passed=passed, samples_ms=samples.tolist(),
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


def resolve_budget(cli_budget_ms: float | None, manifest: Any, target_default_ms: float | None = None) -> tuple[float | None, str]:
    """The budget to judge against and where it came from: the option, else the manifest, else the target's default.

    Returns:
        (budget in ms or None, ``"option"`` | ``"manifest"`` | ``"target"`` | ``"none"``).
    Raises:
        InputError: a budget ≤ 0.
    """
    if cli_budget_ms is not None:
        if cli_budget_ms <= 0:
            raise InputError(f"latency budget {cli_budget_ms} ms is not positive", "pass --budget-ms 20")
        return float(cli_budget_ms), "option"
    if getattr(manifest, "latency_budget_ms", None):
        return float(manifest.latency_budget_ms), "manifest"
    if target_default_ms:
        return float(target_default_ms), "target"
    return None, "none"


# ------------------------------------------------------------------------------------------------ device info
def uses_gpu(session: Any) -> bool:
    """True when the session runs on a GPU: the TensorRT backend, or ORT's TensorRT/CUDA execution provider."""
    providers = list(getattr(session, "providers", []))
    return getattr(session, "backend_name", "") == "tensorrt" or any(
        p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") or p.startswith("TensorRT") for p in providers)


def device_info(session: Any) -> dict[str, Any]:
    """Where the numbers come from: host, CPU, GPU (name and compute capability, from ``gpu_info.detect_gpu``),
    ONNX Runtime and TensorRT versions, backend and the providers really in use (ORT falls back to CPU silently, so
    these are read from the session)."""
    import onnxruntime as ort

    from .gpu_info import detect_gpu

    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
        "python": platform.python_version(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "backend": getattr(session, "backend_name", "?"), "providers": list(getattr(session, "providers", [])),
        "onnxruntime": ort.__version__, "tensorrt": tensorrt_version(), "gpu": None,
    }
    if uses_gpu(session):
        gpu = detect_gpu()
        info["gpu"] = f"{gpu.name} (sm{gpu.compute_capability.replace('.', '')})" if gpu else "unknown GPU"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tensorrt_version() -> str | None:
    """The installed TensorRT's version, or None. JetPack's system package may lack pip metadata: then it is imported."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    for name in ("tensorrt", "tensorrt-cu12", "tensorrt-cu11"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    if importlib.util.find_spec("tensorrt") is None:
        return None
    try:
        import tensorrt

        return str(getattr(tensorrt, "__version__", "installed"))
    except Exception:  # a broken install: report it as present, the backend says why it cannot run
        return "installed"


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
    """The JSON-able bench report (schema ``dsedge.bench`` version 1).

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


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read a report written by ``dsedge bench --json``. Raises BenchError for a missing, malformed or foreign file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"baseline report {str(p)!r} does not exist", "write one with `dsedge bench BUNDLE --json > base.json`") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BenchError(f"baseline report {str(p)!r} is not valid JSON ({e})", "pass a file written by `dsedge bench --json`") from None
    if not isinstance(data, dict) or data.get("schema") not in (REPORT_SCHEMA, *LEGACY_SCHEMAS):
        raise BenchError(f"{str(p)!r} is not a dsedge bench report", "pass a file written by `dsedge bench --json`")
    if data.get("schema_version") != REPORT_SCHEMA_VERSION:
        raise BenchError(f"bench report {str(p)!r} has schema version {data.get('schema_version')!r}; this dsedge "
                         f"reads {REPORT_SCHEMA_VERSION}", "measure the baseline again with this dsedge")
    if not isinstance(data.get("results"), list):
        raise BenchError(f"bench report {str(p)!r} has no results list", "pass a file written by `dsedge bench --json`")
    validate("bench-report", data, BenchError, f"bench report {p.name}")
    return data


@dataclass
class Comparison:
    """One batch size compared with the baseline: ``ratio`` = current / baseline at ``percentile``."""

    variant: str
    batch: int
    percentile: str
    baseline_ms: float | None
    current_ms: float
    tolerance: float

    @property
    def ratio(self) -> float | None:
        return self.current_ms / self.baseline_ms if self.baseline_ms else None

    @property
    def regressed(self) -> bool:
        return self.ratio is not None and self.ratio > 1.0 + self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "batch": self.batch, "percentile": self.percentile,
                "baseline_ms": self.baseline_ms, "current_ms": round(self.current_ms, 6),
                "ratio": None if self.ratio is None else round(self.ratio, 4), "tolerance": self.tolerance,
                "regressed": self.regressed}


def compare_reports(current: Mapping[str, Any], baseline: Mapping[str, Any], tolerance: float = 0.10,
                    percentile: str = "p99") -> list[Comparison]:
    """Pair results by (variant, batch, input shapes) and flag those slower than ``baseline × (1 + tolerance)``.

    A result without a baseline counterpart gets ``baseline_ms=None`` and is never a regression.
    Raises:
        InputError: a negative tolerance or unknown percentile.
    """
    if tolerance < 0:
        raise InputError(f"tolerance {tolerance} is negative", "pass --tolerance 0.10 for 10 %")
    percentile = normalize_percentile(percentile)

    def key(r: Mapping[str, Any]) -> tuple:
        return (r.get("variant"), r.get("batch"), json.dumps(r.get("shapes"), sort_keys=True))

    base = {key(r): r for r in baseline.get("results", [])}
    out = []
    for r in current.get("results", []):
        b = base.get(key(r))
        base_ms = float(b["latency_ms"][percentile]) if b and percentile in b.get("latency_ms", {}) else None
        out.append(Comparison(str(r["variant"]), int(r["batch"]), percentile, base_ms,
                              float(r["latency_ms"][percentile]), tolerance))
    return out
