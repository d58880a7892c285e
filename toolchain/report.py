"""The human summary of a build report: a table of variant, size, size vs fp32, accuracy, CPU latency p50/p99
(units and the timed input shape in the headers)."""
from __future__ import annotations

from typing import Any

from ..runtime.bundle import first_latency


def summary_table(report: dict[str, Any]) -> Any:
    """A rich Table for the report's variants (top-1: neighbour agreement for embeddings, argmax agreement else),
    captioned with :func:`token_caption` when a per-token output was judged on its real tokens."""
    from rich.table import Table

    t = Table(title=f"{report['bundle']}  (target {report['target']}, default {report['precision']})")
    shape = latency_shape(report)
    cols = ("variant", "size MB", "size ×fp32", "cos mean", "cos min", "top-1", f"{shape} p50 ms", f"{shape} p99 ms")
    t.caption = token_caption(report)
    for col in cols:
        t.add_column(col, justify="left" if col == "variant" else "right")
    for v in report["variants"]:
        acc = v["accuracy"]
        ref = "cosine_mean" not in acc

        def fmt(key: str, spec: str) -> str:
            return "ref" if ref else (format(acc[key], spec) if key in acc else "—")

        top1 = "top1_agreement" if "top1_agreement" in acc else "argmax_agreement"
        lat = first_latency(v["latency_ms"])
        t.add_row(v["name"], f"{v['size_bytes'] / 1e6:.1f}", f"{v['size_vs_fp32']:.3f}", fmt("cosine_mean", ".4f"),
                  fmt("cosine_min", ".4f"), fmt(top1, ".2f"),
                  f"{lat.get('p50', float('nan')):.2f}", f"{lat.get('p99', float('nan')):.2f}")
    return t


def token_caption(report: dict[str, Any]) -> str | None:
    """``"cos min: the worst sample's cosine over its real tokens of 'token_embeddings'; worst single token: int8
    0.9879"`` for the compressed variants whose accuracy record has ``token_cosine_min`` (a per-token output judged
    on its real tokens), else None: a sample's cosine averages its tokens and can hide one bad token."""
    worst = [(v["name"], v["accuracy"]) for v in report["variants"]
             if v["name"] != "fp32" and "token_cosine_min" in v["accuracy"]]
    if not worst:
        return None
    return (f"cos min: the worst sample's cosine over its real tokens of {worst[0][1].get('output', 'the output')!r}; "
            "worst single token: " + ", ".join(f"{name} {acc['token_cosine_min']:.4f}" for name, acc in worst))


def latency_shape(report: dict[str, Any]) -> str:
    """The shape the build timed, for table headers, from the first variant's ``latency_ms["1"]["shape"]``: every
    input's shape when they all share it (``b1×32``: batch 1, sequence 32; ``b1×3×224×224``), else the batch alone
    (a fraud scorer's dense [1, 29] and sparse ids [1, 4] are not a sequence of 29: ``b1``); ``b1`` when unknown."""
    for v in report.get("variants", []):
        shapes = [list(d) for d in (first_latency(v.get("latency_ms")).get("shape") or {}).values()]
        if shapes and shapes[0]:
            dims = shapes[0] if all(d == shapes[0] for d in shapes) else shapes[0][:1]
            return "b" + "×".join(str(d) for d in dims)
    return "b1"


def compensation_lines(report: dict[str, Any]) -> list[str]:
    """One line per fine-tune in ``report["compensation"]``: held-out accuracy before → after, steps, time."""
    comp = report.get("compensation") or {}
    lines = []
    for key, title in (("prune", "prune"), ("qat", "QAT")):
        rep = comp.get(key)
        if not rep:
            continue
        if key == "prune" and not rep.get("finetune"):
            lines.append(f"prune {rep.get('spec', '')}: ONNX graph pruned, no fine-tune")
            continue
        b, a = rep["heldout_before"], rep["heldout_after"]
        steps, secs = (rep["finetune"]["steps"], rep["finetune"]["time_s"]) if key == "prune" else \
            (rep["steps"], rep["time_s"])
        name = f"{title} {rep.get('spec', '')}".strip()
        top1 = "top1_agreement" if "top1_agreement" in b else "argmax_agreement"
        t1 = f", top-1 {b[top1]:.3f} → {a[top1]:.3f}" if top1 in b else ""
        lines.append(f"{name}: fine-tune {steps} steps ({secs:.0f} s); held-out vs fp32 teacher: cosine mean "
                     f"{b['cosine_mean']:.4f} → {a['cosine_mean']:.4f}, min {b['cosine_min']:.4f} → "
                     f"{a['cosine_min']:.4f}{t1}")
    return lines
