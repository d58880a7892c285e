"""The streaming scorer: replay transactions as a live stream and score each one within a latency budget.

Uses only dsedge's public API: ``dsedge.load(bundle)`` and ``session.submit(inputs, budget_ms=…)`` (a Future that
resolves to a ``Result`` or an explicit ``Rejected``); with a dsedge that has no ``submit`` yet, ``session.run`` is
timed instead. A malformed row (missing column, non-numeric, NaN/inf, negative Amount/Time) is rejected with a one-line
``dsedge.InputError`` message and counted; it never stops the stream.
"""
from __future__ import annotations

import csv
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from dsedge import InputError

from .data import FEATURE_COLUMNS
from .features import Preprocessor

DEFAULT_BUDGET_MS = 3.0


def parse_row(row: Mapping[str, Any], index: int | None = None) -> np.ndarray:
    """One transaction (column name → number or string, e.g. a ``csv.DictReader`` row) → float64 [30]
    in ``FEATURE_COLUMNS`` order (Time, V1..V28, Amount). Extra columns (``Class``) are ignored.

    Raises:
        InputError: a missing column, a value that is not a number, NaN/inf, or a negative ``Time``/``Amount``.
    """
    if isinstance(row, Mapping):  # fast path for a well-formed row; the checks below only name what is wrong
        try:
            fast = np.array([row[c] for c in FEATURE_COLUMNS], np.float64)
            if np.isfinite(fast).all() and fast[0] >= 0 and fast[-1] >= 0:
                return fast
        except (KeyError, TypeError, ValueError):
            pass
    where = f"row {index}" if index is not None else "row"
    if not isinstance(row, Mapping):
        raise InputError(f"{where}: expected a mapping of column → value, got {type(row).__name__}",
                         f"send dicts with keys {FEATURE_COLUMNS[0]}, V1..V28, Amount")
    out = np.empty(len(FEATURE_COLUMNS), np.float64)
    for j, col in enumerate(FEATURE_COLUMNS):
        if col not in row or row[col] is None or (isinstance(row[col], str) and not row[col].strip()):
            raise InputError(f"{where}: missing column {col!r}", "every transaction needs Time, V1..V28 and Amount")
        try:
            x = float(row[col])
        except (TypeError, ValueError):
            raise InputError(f"{where}: column {col!r} is not a number: {str(row[col])[:40]!r}",
                             "send plain decimal numbers") from None
        if not math.isfinite(x):
            raise InputError(f"{where}: column {col!r} is {x} (NaN/inf)", "send finite numbers")
        out[j] = x
    if out[0] < 0 or out[-1] < 0:
        raise InputError(f"{where}: negative {'Time' if out[0] < 0 else 'Amount'} ({min(out[0], out[-1])})",
                         "Time (s since the stream start) and Amount must be >= 0")
    return out


def read_rows(path: str | os.PathLike) -> Iterator[dict[str, str]]:
    """Rows of a CSV file as dicts of strings (no parsing: the scorer validates each one)."""
    with open(path, newline="", encoding="utf-8") as f:
        yield from csv.DictReader(f)


@dataclass
class Scored:
    """One scored transaction: ``score`` = logit difference (higher = more likely fraud), latencies in ms."""

    index: int
    time_s: float
    score: float
    flagged: bool
    latency_ms: float        # parse + preprocess + model, wall clock
    model_ms: float          # the session's own measured latency (``Result.latency_ms`` or the timed run)
    variant: str
    label: int | None = None
    late: bool = False       # the session rejected it (budget/overload/deadline) and it was scored by session.run


@dataclass
class StreamStats:
    """Counts over a replay: scored, flagged, malformed rows by reason, budget rejections by reason."""

    scored: int = 0
    flagged: int = 0
    served_late: int = 0     # rejected by the session, then scored outside the budget (``on_reject="run"``)
    malformed: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)   # the first malformed/rejected messages, for the report
    first_by_reason: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"scored": self.scored, "flagged": self.flagged, "served_late": self.served_late, "malformed": dict(self.malformed),
                "malformed_total": sum(self.malformed.values()), "rejected": dict(self.rejected),
                "rejected_total": sum(self.rejected.values()), "first_messages": self.messages[:10],
                "first_by_reason": dict(self.first_by_reason)}


def _malformed_reason(message: str) -> str:
    for key in ("missing column", "not a number", "NaN/inf", "negative", "expected a mapping"):
        if key in message:
            return key.replace(" ", "_").replace("/", "_")
    return "other"


class StreamScorer:
    """Score transactions one at a time on a loaded bundle.

    Args:
        session: ``dsedge.load(bundle)`` (inputs ``dense`` float32 [batch, 29], ``sparse_ids`` int64 [batch, 4];
            first output: the logits, float32 [batch, 2]).
        preprocessor: the ``features.Preprocessor`` fitted at training time (``preprocess.json``).
        threshold: flag when the score is >= this (chosen on validation data, ``metrics.choose_threshold``).
        budget_ms: per-transaction latency budget passed to ``session.submit``.
        on_reject: what to do with a transaction the session rejects (budget, overload, deadline): ``"count"``
            leaves it unscored; ``"run"`` also scores it with ``session.run`` and marks it ``late``. Either way the
            rejection is counted by reason in ``stats.rejected``.
    """

    def __init__(self, session: Any, preprocessor: Preprocessor, threshold: float,
                 budget_ms: float = DEFAULT_BUDGET_MS, on_reject: str = "count") -> None:
        if on_reject not in ("count", "run"):
            raise ValueError(f"on_reject must be 'count' or 'run', got {on_reject!r}")
        self.on_reject = on_reject
        self.session = session
        self.pre = preprocessor
        self.threshold = float(threshold)
        self.budget_ms = float(budget_ms)
        self.stats = StreamStats()
        self._variant = getattr(getattr(session, "variant", None), "name", "?")
        self._output = session.outputs[0].name  # the logits, whatever the exporter named them

    def _note(self, counter: Counter, reason: str, message: str) -> None:
        counter[reason] += 1
        self.stats.first_by_reason.setdefault(reason, message)
        if len(self.stats.messages) < 50:
            self.stats.messages.append(message)

    def _infer(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray | None, float, str, str | None]:
        """→ (logits or None, model ms, variant, rejection message or None)."""
        submit = getattr(self.session, "submit", None)
        if submit is None:  # a dsedge without streaming: time the synchronous run
            t0 = time.perf_counter()
            out = self.session.run(inputs)
            return out[self._output], (time.perf_counter() - t0) * 1e3, self._variant, None
        res = submit(inputs, budget_ms=self.budget_ms).result()
        if not getattr(res, "ok", False):
            reason = getattr(res, "reason", None) or "error"
            detail = getattr(res, "detail", None) or getattr(res, "error", "") or ""
            return None, float(getattr(res, "latency_ms", 0.0)), reason, f"{reason}: {detail}"
        return res.outputs[self._output], float(res.latency_ms), str(res.variant), None

    def score(self, row: Mapping[str, Any], index: int) -> Scored | None:
        """Score one row; None (and counted in ``stats``) when it is malformed or the session rejected it."""
        t0 = time.perf_counter()
        try:
            x = parse_row(row, index)
        except InputError as e:
            self._note(self.stats.malformed, _malformed_reason(e.message), str(e))
            return None
        inputs = self.pre.transform_row(x)
        logits, model_ms, variant, rejection = self._infer(inputs)
        late = False
        if logits is None:
            self._note(self.stats.rejected, variant, f"row {index}: {rejection}")
            if self.on_reject != "run":
                return None
            # every card transaction needs a decision: score it outside the budget, and say so
            t1 = time.perf_counter()
            logits = self.session.run(inputs)[self._output]
            model_ms, variant, late = (time.perf_counter() - t1) * 1e3, f"{self._variant} (run, over budget)", True
            self.stats.served_late += 1
        s = float(logits[0, 1] - logits[0, 0])
        flagged = s >= self.threshold
        self.stats.scored += 1
        self.stats.flagged += int(flagged)
        label = row.get("Class") if isinstance(row, Mapping) else None
        try:
            label = int(float(label)) if label is not None else None
        except (TypeError, ValueError):
            label = None
        return Scored(index, float(x[0]), s, flagged, (time.perf_counter() - t0) * 1e3, model_ms, variant, label, late)

    def warm_up(self, row: Mapping[str, Any], n: int = 100) -> None:
        """Run ``n`` untimed requests for ``row`` with a generous budget, so ORT's first-run allocations and the
        session's latency profile are settled before the stream starts (not counted in ``stats``)."""
        x = parse_row(row)
        inputs = self.pre.transform_row(x)
        for _ in range(n):
            if hasattr(self.session, "submit"):
                self.session.submit(inputs, budget_ms=1000.0).result()
            else:
                self.session.run(inputs)

    def replay(self, rows: Iterable[Mapping[str, Any]], speed: float | None = None,
               limit: int | None = None) -> list[Scored]:
        """Score ``rows`` in order, paced at real time x ``speed`` by their ``Time`` column (None: as fast as possible).

        Returns the scored transactions; malformed and rejected rows are in ``self.stats``.
        """
        out: list[Scored] = []
        start_wall = time.perf_counter()
        start_t: float | None = None
        for i, row in enumerate(rows):
            if limit is not None and i >= limit:
                break
            if speed:
                try:
                    t = float(row["Time"])
                    start_t = t if start_t is None else start_t
                    wait = (t - start_t) / speed - (time.perf_counter() - start_wall)
                    if wait > 0:
                        time.sleep(wait)
                except (KeyError, TypeError, ValueError):
                    pass  # a malformed Time is reported by score()
            r = self.score(row, i)
            if r is not None:
                out.append(r)
        return out


def latency_summary(ms: Iterable[float], refused: int = 0) -> dict[str, Any]:
    """p50/p90/p99/max/mean of latencies in ms (perf_analyzer-style field names), counting refused requests.

    Args:
        ms: latencies in ms of the answered requests.
        refused: requests refused (budget, overload, deadline) and so never answered within the budget. Each counts
            in the percentiles as a request that never got its answer (latency +inf), as a latency SLO counts an
            error: with more than 1 % refused the p99 is a refused request and ``p99_ms`` is None.
    Returns:
        ``count`` (answered), ``refused``, ``requests`` (both), ``p50_ms``/``p90_ms``/``p99_ms`` over all requests
        (linear interpolation; None where the percentile reaches a refused request), ``answered_p99_ms`` (the
        answered ones alone, for comparison), ``max_ms``/``mean_ms`` of the answered ones. ``{"count": 0, ...}``
        without ``*_ms`` keys when nothing was answered.
    """
    a = np.sort(np.asarray(list(ms), np.float64))
    refused = int(refused)
    if refused < 0:
        raise ValueError(f"refused must be >= 0, got {refused}")
    out: dict[str, Any] = {"count": int(a.size), "refused": refused, "requests": int(a.size) + refused}
    if a.size == 0:
        return out
    every = np.concatenate([a, np.full(refused, np.inf)])
    with np.errstate(invalid="ignore"):  # interpolating towards +inf gives inf or nan: both mean "a refused one"
        for q in (50, 90, 99):
            v = float(np.percentile(every, q))
            out[f"p{q}_ms"] = v if math.isfinite(v) else None
    out.update(answered_p99_ms=float(np.percentile(a, 99)), max_ms=float(a.max()), mean_ms=float(a.mean()))
    return out


def batched_throughput(session: Any, inputs: dict[str, np.ndarray], batch: int = 1024, repeats: int = 3) -> dict[str, float]:
    """Transactions per second through ``session.run`` in batches of ``batch`` rows (best of ``repeats`` passes)."""
    n = len(inputs["dense"])
    batch_max = getattr(getattr(session, "manifest", None), "shape_ranges", {}).get("batch", {}).get("max")
    batch = min(batch, int(batch_max)) if batch_max else batch
    session.run({k: v[:batch] for k, v in inputs.items()})  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            session.run({k: v[i:i + batch] for k, v in inputs.items()})
        best = min(best, time.perf_counter() - t0)
    return {"batch": batch, "rows": n, "seconds": best, "transactions_per_s": n / best}


def stream_burst(session: Any, inputs: dict[str, np.ndarray], budget_ms: float = DEFAULT_BUDGET_MS,
                 window: int = 16) -> dict[str, Any]:
    """Every row at once, one request per transaction, through ``session.stream`` (the budget scheduler forms the
    batches): transactions/s, the fraction answered within budget, rejections by reason, the mean batch size.

    ``window`` caps the requests in flight. Each request costs ~0.1–0.2 ms of Python on this CPU before it reaches
    a batch, so with ``stream``'s default window (two full batches, 128 here) the queue alone outlasts a 3 ms budget
    and nearly every request is rejected; 16 in flight keeps every answer within budget here."""
    n = len(inputs["dense"])
    rows = ({k: v[i:i + 1] for k, v in inputs.items()} for i in range(n))
    # warm-up with a generous budget: the scheduler starts and profiles the batch sizes before the clock runs
    list(session.stream(({k: v[i % n:i % n + 1] for k, v in inputs.items()} for i in range(256)), budget_ms=1000.0))
    t0 = time.perf_counter()
    answers = list(session.stream(rows, budget_ms=budget_ms, window=window))
    wall = time.perf_counter() - t0
    rejected = Counter(a.reason for a in answers if not getattr(a, "ok", False) and hasattr(a, "reason"))
    m = session.metrics() if hasattr(session, "metrics") else {}  # (counts include the warm-up)
    return {"rows": n, "seconds": wall, "transactions_per_s": n / wall, "budget_ms": budget_ms, "window": window,
            "within_budget": sum(bool(a.within_budget) for a in answers) / n, "rejected": dict(rejected),
            "mean_batch_size": m.get("mean_batch_size"),
            "latency": latency_summary((a.latency_ms for a in answers if getattr(a, "ok", False)),
                                       refused=sum(not getattr(a, "ok", False) for a in answers))}
