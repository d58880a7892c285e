"""The human summary of a build report: a table of variant, size, size vs fp32, accuracy, CPU latency p50/p99."""
from __future__ import annotations

from typing import Any


def summary_table(report: dict[str, Any]) -> Any:
    """A rich Table for the report's variants (top-1: neighbour agreement for embeddings, argmax agreement else)."""
    from rich.table import Table

    t = Table(title=f"{report['bundle']}  (target {report['target']}, default {report['precision']})")
    for col in ("variant", "size MB", "vs fp32", "cos mean", "cos min", "top-1", "b1 p50 ms", "b1 p99 ms"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for v in report["variants"]:
        acc = v["accuracy"]
        ref = "cosine_mean" not in acc

        def fmt(key: str, spec: str) -> str:
            return "ref" if ref else (format(acc[key], spec) if key in acc else "—")

        top1 = "top1_agreement" if "top1_agreement" in acc else "argmax_agreement"
        lat = v["latency_ms"].get("1", {})
        t.add_row(v["name"], f"{v['size_bytes'] / 1e6:.1f}", f"{v['size_vs_fp32']:.3f}", fmt("cosine_mean", ".4f"),
                  fmt("cosine_min", ".4f"), fmt(top1, ".2f"),
                  f"{lat.get('p50', float('nan')):.2f}", f"{lat.get('p99', float('nan')):.2f}")
    return t
