"""The report as a terminal table, as JSON and as an HTML page with matplotlib figures (PNG, inlined).

The HTML page draws exactly the series in ``report["figures"]``: token-length histogram, rank-frequency curve on
log-log axes with the fitted Zipf line, missing/empty values per field, class balance and single-feature AUC.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
import tempfile
from pathlib import Path

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def print_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"dsedge data check: {report['data']} ({report['format']}, {report['rows']} rows)",
              title_justify="left")
    for col in ("check", "value", "limits", "status", "detail"):
        t.add_column(col, overflow="fold")
    for c in report["checks"]:
        style = STATUS_STYLE[c["status"]]
        t.add_row(c["id"], _fmt(c["value"]), c["limits"], f"[{style}]{c['status']}[/{style}]", c["detail"])
    console.print(t)
    console.print(f"overall: [{STATUS_STYLE[report['status']]}]{report['status']}[/]")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1, sort_keys=False, default=float)


def write_json(report: dict, path: str | os.PathLike) -> None:
    _atomic_write(Path(path), to_json(report).encode())


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_figures(figures: dict) -> dict[str, str]:
    """{figure name: base64 PNG} for every figure with data."""
    from .engine import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    h = figures.get("length_histogram")
    if h and h.get("counts"):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        e = h["edges"]
        ax.bar(e[:-1], h["counts"], width=[b - a for a, b in zip(e, e[1:])], align="edge", edgecolor="black", lw=0.3)
        ax.set_xlabel(f"length ({h['unit']})")
        ax.set_ylabel("documents")
        ax.set_title("length distribution")
        out["length_histogram"] = _png(fig)
    rf = figures.get("rank_frequency")
    if rf and rf.get("rank"):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.loglog(rf["rank"], rf["freq"], ".", ms=3, label="observed")
        if rf.get("fit_line"):
            ax.loglog(rf["fit_line"]["rank"], rf["fit_line"]["freq"], "-", label=f"fit, s = {rf['s']:.3f}")
        ax.set_xlabel("rank")
        ax.set_ylabel(f"frequency ({rf['unit']})")
        ax.set_title("rank-frequency (log-log)")
        ax.legend()
        out["rank_frequency"] = _png(fig)
    m = figures.get("missing_per_field")
    if m and m.get("field"):
        fields = m["field"][:60]
        fig, ax = plt.subplots(figsize=(6, max(2.0, 0.18 * len(fields) + 1)))
        rows = max(1, m["rows"])
        ax.barh(fields, [x / rows for x in m["missing"][:60]], label="missing")
        ax.barh(fields, [x / rows for x in m["empty"][:60]], left=[x / rows for x in m["missing"][:60]], label="empty")
        ax.set_xlabel("share of rows")
        ax.set_xlim(0, 1)
        ax.invert_yaxis()
        ax.legend()
        ax.set_title("missing values per field")
        out["missing_per_field"] = _png(fig)
    cb = figures.get("class_balance")
    if cb:
        fig, ax = plt.subplots(figsize=(6, 2.8))
        ax.bar([str(c) for c in cb["class"]], cb["count"])
        ax.set_yscale("log")
        ax.set_xlabel(cb["label"])
        ax.set_ylabel("rows")
        ax.set_title("class balance")
        out["class_balance"] = _png(fig)
    auc = figures.get("single_feature_auc")
    if auc:
        feats = auc["feature"][:40]
        fig, ax = plt.subplots(figsize=(6, max(2.0, 0.18 * len(feats) + 1)))
        ax.barh(feats, auc["auc"][:40])
        ax.set_xlim(0.5, 1.0)
        ax.invert_yaxis()
        ax.set_xlabel("ROC AUC of the feature alone")
        ax.set_title("leakage suspects")
        out["single_feature_auc"] = _png(fig)
    return out


def write_html(report: dict, path: str | os.PathLike) -> None:
    """``path`` (HTML with the check table and figures) and ``path`` with suffix .json (the report, figures' data
    included)."""
    p = Path(path)
    if p.suffix.lower() == ".json":
        from ...runtime.errors import DsedgeError
        raise DsedgeError(f"{p}: an HTML report path ending in .json would be overwritten by the JSON beside it",
                          "give the page an .html name (e.g. report.html)")
    pngs = render_figures(report["figures"])
    rows = "".join(
        f"<tr class='{c['status']}'><td>{html.escape(c['id'])}</td><td>{html.escape(_fmt(c['value']))}</td>"
        f"<td>{html.escape(c['limits'])}</td><td>{c['status']}</td><td>{html.escape(c['detail'])}</td></tr>"
        for c in report["checks"])
    imgs = "".join(f"<figure><img alt='{k}' src='data:image/png;base64,{v}'><figcaption>{k}</figcaption></figure>"
                   for k, v in pngs.items())
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>dsedge data check</title><style>
body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}
tr.pass td:nth-child(4){{color:#080}} tr.warn td:nth-child(4){{color:#b80}} tr.fail td:nth-child(4){{color:#c00;
font-weight:bold}} tr.skip{{color:#888}} figure{{display:inline-block;margin:1em}}</style></head><body>
<h1>dsedge data check</h1><p>{html.escape(report['data'])}: {report['format']}, {report['rows']} rows,
overall <b>{report['status']}</b></p>
<table><tr><th>check</th><th>value</th><th>limits</th><th>status</th><th>detail</th></tr>{rows}</table>
{imgs}<p>Figures' data: {html.escape(p.with_suffix('.json').name)}</p></body></html>"""
    _atomic_write(p, doc.encode())
    write_json(report, p.with_suffix(".json"))
