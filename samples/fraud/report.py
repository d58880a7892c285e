"""The fraud report: printed table, ``report.json`` and ``report.png`` (precision-recall curves + latency CDF)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from dsedge.runtime.files import atomic_path, write_text_atomic

from .data import ATTRIBUTION
from .metrics import base_rate_weights

SCHEMA_VERSION = 1
GOALS = {"auc_drop_max": 0.003, "single_stream_p99_ms_max": 1.0, "batched_transactions_per_s_min": 50_000}
P99_RULE = ("p99 over every request sent (scorer.latency_summary); a request the session refused (budget, overload, "
            "deadline) counts as never answered, i.e. slower than any budget: with more than 1 % refused the p99 is a "
            "refused request, value is null and the goal is not met. answered_p99_ms: the answered requests alone")


def check_goals(models: Mapping[str, Mapping[str, Any]], latency: Mapping[str, Any],
                throughput: Mapping[str, Any]) -> dict[str, Any]:
    """Each goal of issue 8 with its measured value and ``met`` (None when the value was not measured).

    ``latency`` maps a series ("model", "session_run") to ``scorer.latency_summary``'s dict: the p99 goals read its
    ``p99_ms``, which counts refused requests as never answered (``P99_RULE``), and report ``refused`` beside it."""
    out: dict[str, Any] = {}
    if "teacher" in models and "student_compressed" in models:
        drop = models["teacher"]["roc_auc"] - models["student_compressed"]["roc_auc"]
        out["auc_drop"] = {"value": drop, "max": GOALS["auc_drop_max"], "met": drop <= GOALS["auc_drop_max"]}
    for key, series in (("single_stream_p99_ms", "model"), ("single_stream_p99_ms_session_run", "session_run")):
        lat = latency.get(series, {})
        p99, refused = lat.get("p99_ms"), int(lat.get("refused", 0))
        measured = p99 is not None or refused > 0   # a p99 that falls on a refused request is measured: unmet
        if measured or series == "model":
            out[key] = {"value": p99, "max": GOALS["single_stream_p99_ms_max"],
                        "met": (p99 is not None and p99 <= GOALS["single_stream_p99_ms_max"]) if measured else None,
                        "requests": lat.get("requests", lat.get("count")), "refused": refused,
                        "answered_p99_ms": lat.get("answered_p99_ms"), "rule": P99_RULE}
    tps = throughput.get("transactions_per_s")
    out["batched_transactions_per_s"] = {"value": tps, "min": GOALS["batched_transactions_per_s_min"],
                                         "met": None if tps is None else tps >= GOALS["batched_transactions_per_s_min"]}
    return out


def write_json(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``report`` (plus ``schema_version``) as indented JSON, via a temp file renamed into place."""
    return write_text_atomic(path, json.dumps({"schema_version": SCHEMA_VERSION, **report}, indent=2,
                                              default=float) + "\n")


def plot(path: str | os.PathLike, y: np.ndarray, scores: Mapping[str, np.ndarray],
         latencies_ms: Mapping[str, Sequence[float]], budget_ms: float | None = None) -> Path:
    """PNG: left, precision-recall on the test split at the real base rate per model; right, latency CDFs (ms);
    below, the data's attribution (``data.ATTRIBUTION``: ODbL).
    Written to a temporary file, then renamed into place: never a half-written PNG.

    Args:
        y: int [n] test labels; scores: model name → float [n] scores; latencies_ms: series name → latencies.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import precision_recall_curve

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    w = base_rate_weights(y)
    for name, s in scores.items():
        p, r, _ = precision_recall_curve(y, s, sample_weight=w)
        ax1.plot(r, p, label=name, lw=1.4)
    ax1.set_xlabel("recall")
    ax1.set_ylabel("precision at the real 0.172 % base rate")
    ax1.set_title("Precision-recall, test split (time-ordered, reweighted)")
    ax1.set_xlim(0, 1)
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower left", fontsize=8)
    for name, lat in latencies_ms.items():
        a = np.sort(np.asarray(lat, np.float64))
        if a.size:
            ax2.plot(a, np.arange(1, a.size + 1) / a.size, label=f"{name} (p99 {np.percentile(a, 99):.3f} ms)")
    if budget_ms:
        ax2.axvline(budget_ms, color="red", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    ax2.set_xscale("log")
    ax2.set_xlabel("latency per transaction (ms, log)")
    ax2.set_ylabel("fraction of transactions")
    ax2.set_title("Single-stream latency CDF (stream replay)")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(loc="lower right", fontsize=8)
    fig.text(0.01, 0.01, ATTRIBUTION, fontsize=7, color="0.35")  # the data's licence asks for it (data.ATTRIBUTION)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    try:  # an open file with an explicit format: the temporary name has no .png for savefig to go by
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            fig.savefig(f, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


def format_table(models: Mapping[str, Mapping[str, Any]]) -> str:
    """Plain-text table of the per-model metrics (fixed column names, diffable)."""
    cols = ["roc_auc", "pr_auc", "pr_auc_at_base_rate", "recall_at_0.1pct_fpr", "recall_at_1pct_fpr", "size_bytes"]
    lines = ["model".ljust(20) + "".join(c.rjust(22) for c in cols)]
    for name, m in models.items():
        cells = []
        for c in cols:
            v = m.get(c)
            cells.append(("-" if v is None else f"{v:,}" if c == "size_bytes" else f"{v:.4f}").rjust(22))
        lines.append(name.ljust(20) + "".join(cells))
    return "\n".join(lines)
