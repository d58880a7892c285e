"""Stage ``assemble_report``: report.json, assembled from what the stages returned (``schema`` =
``REPORT_SCHEMA``)."""
from __future__ import annotations

import time
from typing import Any

from ...runtime.golden import count_rows
from ..artifacts import Choice, Prepared, Recipe, VariantDraft
from ..bundle_writer import bundle_path
from ..config import BuildPlan

REPORT_SCHEMA = "dsedge.build-report/1"


def assemble_report(plan: BuildPlan, model: Prepared, choice: Choice, opsets: dict[str, int],
                    variants: list[VariantDraft], recipe: Recipe, warnings: list[str],
                    timings: dict[str, float], started: float) -> dict[str, Any]:
    """The build report: target, precision and why, source, export, engine recipe, compression and layers,
    validation inputs, per-variant size / accuracy / latency (ms), stage timings and wall time (s)."""
    source, exported, target = model.source, model.exported, plan.target
    fp32_size = model.reference.stat().st_size
    compressed = choice.compressed
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA, "bundle": bundle_path(plan.config.out_dir, source.name, target.name).name,
        "target": target.name, "precision": choice.precision,
        "notes": list(choice.notes) + list(model.notes) + warnings + source.notes,
        "source": {"kind": source.kind, "ref": source.ref, "sha256": source.fingerprint,
                   **({"vocab_size": source.vocab_size} if source.vocab_size else {})},
        "export": {"exporter": exported.exporter, "opset": opsets[choice.precision],
                   "parity_max_abs_diff": exported.parity_max_abs_diff},
        "engine_recipe": recipe.notes,
        **({"precision_choice": choice.record} if choice.record else {}),
        **({"compensation": model.finetune} if model.finetune else {}),
        "compression": {k: v for k, v in compressed.details.items() if k != "layers"},
        "layers": compressed.details.get("layers", []),
        "validation": {"inputs": source.validation_kind,
                       "samples": count_rows(model.validation)},
        "variants": [{"name": v.name, "precision": v.precision, "size_bytes": int(v.path.stat().st_size),
                      "size_vs_fp32": round(v.path.stat().st_size / fp32_size, 4),
                      "accuracy": v.accuracy, "latency_ms": v.latency_ms} for v in variants],
        "fp32_size_bytes": fp32_size,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    if plan.config.engine:
        report["engines"] = list(recipe.engines)
    report["wall_time_s"] = round(time.perf_counter() - started, 2)
    return report
