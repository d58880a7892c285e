"""From a merged ``ShardState`` to the report: statistics, graded checks and the figures' data (report schema 1).

The report is plain JSON data. ``checks`` lists each check with ``status`` pass/warn/fail/skip, its ``value``, the
``limits`` it was graded against and a one-line ``detail``; ``figures`` holds the data series the HTML plots draw;
``run`` (engine, timings) is the only part that differs between engines.
"""
from __future__ import annotations

from .config import DataCheckConfig
from .scan import ScanPlan, ShardState
from .sources import loc_str
from .tokens import zipf_fit

SCHEMA_VERSION = 1
STATUS_ORDER = ("pass", "skip", "warn", "fail")


def _locs(locs: list[int], files: list[str]) -> list[str]:
    return [loc_str(int(x), files) for x in locs]


def build_report(plan: ScanPlan, st: ShardState, cfg: DataCheckConfig) -> dict:
    files = list(plan.files)
    checks: list[dict] = []

    def grade(cid: str, value: float | None, detail: str = "", skip: str = "") -> None:
        c = cfg.checks[cid]
        if not c.enabled:
            checks.append({"id": cid, "status": "skip", "value": None, "limits": c.limits(), "detail": "disabled"})
        elif value is None:
            checks.append({"id": cid, "status": "skip", "value": None, "limits": c.limits(), "detail": skip})
        else:
            checks.append({"id": cid, "status": c.grade(value), "value": value, "limits": c.limits(),
                           "detail": detail})

    sch = st.schema
    fields = sch.field_summary()
    for f in fields.values():
        f["missing_examples"] = _locs(f["missing_examples"], files)
        f["mismatch_examples"] = _locs(f["mismatch_examples"], files)
    total = sch.rows + sch.unreadable
    unreadable = [{"loc": loc_str(loc, files), "reason": why} for loc, why in sch.unreadable_examples]
    if total:
        grade("format.unreadable", sch.unreadable / total, f"{sch.unreadable} of {total} rows" + (
            ": " + "; ".join(f"{u['loc']} {u['reason']}" for u in unreadable[:3]) if unreadable else ""))
    else:                                       # an empty data set is never a passing one
        checks.append({"id": "format.unreadable", "status": "fail", "value": None,
                       "limits": cfg.checks["format.unreadable"].limits(), "detail": "the data set has no rows"})

    miss = {n: (f["missing"] + f["empty"]) / sch.rows for n, f in fields.items()} if sch.rows else {}
    worst = max(miss, key=lambda n: (miss[n], n)) if miss else None
    grade("schema.missing", miss[worst] if worst else None,
          "no missing or empty values" if worst and not miss[worst] else
          f"{worst!r}: {fields[worst]['missing']} missing, {fields[worst]['empty']} empty"
          + (f" ({', '.join(fields[worst]['missing_examples'][:3])})" if fields[worst]["missing_examples"] else "")
          if worst else "", skip="no rows")

    mism = {n: f["type_mismatches"] / max(1, sch.rows - f["missing"] - f["empty"]) for n, f in fields.items()}
    worst_t = max(mism, key=lambda n: (mism[n], n)) if mism else None
    if worst_t:
        f = fields[worst_t]
        kinds = ", ".join(f"{v} {k}" for k, v in f["mismatch_kinds"].items())
        det = (f"{worst_t!r} is {f['type']}: {kinds}" + (f" ({', '.join(f['mismatch_examples'][:3])})"
                                                         if f["mismatch_examples"] else "")) if kinds else \
              "every field has one type"
    grade("schema.types", mism[worst_t] if worst_t else None, det if worst_t else "", skip="no fields")

    dd = st.dedup.result(plan.near_threshold)
    for e in dd["exact_examples"]:
        e["locs"] = _locs(e["locs"], files)
    for e in dd.get("near_examples", []):
        e["locs"] = _locs(e["locs"], files)
    n_docs = dd["docs"]
    ex = dd["exact_examples"]
    grade("dedup.exact", dd["exact_duplicates"] / n_docs if n_docs else None,
          f"{dd['exact_duplicates']} of {n_docs}" + (f"; e.g. {' = '.join(ex[0]['locs'])} ({ex[0]['copies']} copies)"
                                                       if ex else ""), skip="no documents")
    if "near_duplicates" in dd:
        nex = dd["near_examples"]
        grade("dedup.near", dd["near_duplicates"] / n_docs if n_docs else None,
              f"{dd['near_duplicates']} of {n_docs} at Jaccard >= {plan.near_threshold:g}"
              + (f"; e.g. {' ~ '.join(nex[0]['locs'])} (J={nex[0]['jaccard']:.2f})" if nex else ""),
              skip="no documents")
    else:
        grade("dedup.near", None, skip="text corpora only" if not plan.text_field else "disabled in [text] near")

    text: dict | None = None
    figures: dict = {"missing_per_field": {"field": list(fields), "missing": [f["missing"] for f in fields.values()],
                                           "empty": [f["empty"] for f in fields.values()], "rows": sch.rows}}
    if st.tokens is not None:
        tk = st.tokens
        lengths = tk.length_summary(plan.max_tokens)
        zipf = zipf_fit(tk.freq)
        text = {"field": plan.text_field, "docs": st.docs, "tokens": tk.tokens, "unit": tk.unit,
                "tokenizer": plan.tokenizer, "lengths": lengths,
                "unknown_tokens": tk.unknown if plan.tokenizer else None,
                "unknown_rate": tk.unknown / tk.tokens if plan.tokenizer and tk.tokens else None,
                "zipf": {k: zipf[k] for k in ("s", "r2", "fit_ranks", "types")}}
        grade("tokens.over_max", lengths["over_max"] / lengths["docs"] if lengths.get("docs") else None,
              f"{lengths.get('over_max', 0)} docs over {plan.max_tokens} {tk.unit}; p50 {lengths.get('p50')}, "
              f"p99 {lengths.get('p99')}, max {lengths.get('max')}", skip="no documents")
        grade("tokens.unknown", text["unknown_rate"],
              f"{tk.unknown} of {tk.tokens} tokens are the unknown token", skip="needs --tokenizer")
        grade("zipf", zipf["s"], f"s={zipf['s']:.3f} (R²={zipf['r2']:.3f}) over ranks 1..{zipf['fit_ranks'][1]} of "
              f"{zipf['types']} {tk.unit[:-1]} types" if zipf["s"] is not None else "", skip="fewer than 3 ranks")
        figures["length_histogram"] = tk.length_histogram()
        figures["rank_frequency"] = {"unit": tk.unit, **zipf["points"], "fit_line": zipf.get("fit_line"),
                                     "s": zipf["s"]}
    else:
        for cid in ("tokens.over_max", "tokens.unknown", "zipf"):
            grade(cid, None, skip="no text field")
    if st.entities is not None:
        en = st.entities.result()
        grade("entities.coverage", en["coverage"], f"{en['found']} of {en['entities']} found"
              + (f"; missing e.g. {', '.join(en['missing_examples'][:5])}" if en["missing_examples"] else ""))
        text = {**(text or {}), "entities": en}
    else:
        grade("entities.coverage", None, skip="needs --entities" if plan.text_field else "no text field")
    tab = _tabular(plan, st, fields, grade, figures)
    status = max((c["status"] for c in checks), key=STATUS_ORDER.index, default="pass")
    return {"schema_version": SCHEMA_VERSION, "data": plan.data, "format": plan.fmt, "files": len(files),
            "rows": sch.rows, "unreadable_rows": sch.unreadable, "blank_lines": sch.blank_lines,
            "unreadable_examples": unreadable, "fields": fields, "text": text, "tabular": tab,
            "duplicates": dd, "checks": checks, "status": "pass" if status == "skip" else status,
            "figures": figures}


def _tabular(plan: ScanPlan, st: ShardState, fields: dict, grade, figures: dict) -> dict | None:
    skip_cols = {plan.text_field, plan.label}
    numeric = [n for n, f in fields.items() if f["type"] == "number" and n not in skip_cols]
    other = [n for n, f in fields.items() if f["type"] in ("string", "bool") and n not in skip_cols]
    if not numeric and not other and plan.label is None:
        for cid in ("tabular.class_balance", "tabular.constant", "tabular.leakage", "tabular.ranges"):
            grade(cid, None, skip="no tabular columns")
        return None
    tab = st.tabular.result(numeric, other)
    classes = tab.get("classes")
    if classes and len(classes) >= 1:
        n = sum(classes.values())
        rare = min(classes, key=lambda c: (classes[c], c))
        grade("tabular.class_balance", classes[rare] / n if len(classes) > 1 else 0.0,
              f"{plan.label!r}: " + ", ".join(f"{c}: {v} ({v / n:.2%})" for c, v in list(classes.items())[:6]))
        figures["class_balance"] = {"label": plan.label, "class": list(classes), "count": list(classes.values())}
    else:
        grade("tabular.class_balance", None, skip=tab.get("label_note") or "no label column (set [tabular] label)")
    ncols = len(numeric) + len(other)
    const = tab["constant_columns"]
    grade("tabular.constant", len(const) / ncols if ncols else None,
          f"{len(const)} of {ncols} columns" + (f": {', '.join(const[:6])}" if const else ""), skip="no columns")
    auc = tab.get("auc")
    if auc:
        top = max(auc, key=lambda c: (auc[c]["auc"], c))
        grade("tabular.leakage", auc[top]["auc"], f"{top!r} alone: AUC {auc[top]['auc']:.4f} for class "
              f"{auc[top]['class']}" + ("" if auc[top]["grid_level"] == 0 else " (values coarsened)"))
        order = sorted(auc, key=lambda c: -auc[c]["auc"])
        figures["single_feature_auc"] = {"feature": order, "auc": [auc[c]["auc"] for c in order]}
    else:
        grade("tabular.leakage", None, skip="needs a class label and numeric features")
    cols = tab["columns"]
    if cols:
        bad = {c: v["nonfinite"] + v.get("out_of_range", 0) for c, v in cols.items()}
        n_vals = sum(v["finite"] + v["nonfinite"] for v in cols.values())
        worst = max(bad, key=lambda c: (bad[c], c))
        det = (f"{sum(bad.values())} of {n_vals} values; {worst!r}: {cols[worst]['nonfinite']} non-finite"
               + (f", {cols[worst]['out_of_range']} outside {cols[worst]['range']}" if "range" in cols[worst] else "")
               if bad[worst] else f"{len(plan.ranges)} ranges checked, all values finite")
        grade("tabular.ranges", sum(bad.values()) / n_vals if n_vals else None, det)
    else:
        grade("tabular.ranges", None, skip="no numeric columns")
    return tab
