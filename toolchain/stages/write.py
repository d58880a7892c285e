"""Stage ``write``: publish the bundle atomically (manifest, models/, build/trtexec.sh, report.json)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import Prepared, Recipe, VariantDraft
from ..bundle_writer import bundle_path, write_bundle
from ..config import BuildPlan


def write(plan: BuildPlan, model: Prepared, variants: list[VariantDraft], recipe: Recipe,
          report: dict[str, Any]) -> Path:
    """``OUT/NAME-TARGET.dse``; nothing exists there unless every file and the manifest were written.

    Raises:
        BundleError: the destination exists and is not a bundle.
    """
    source, exported, target = model.source, model.exported, plan.target
    dest = bundle_path(plan.config.out_dir, source.name, target.name)
    return write_bundle(dest, name=source.name, target=target.to_dict(), inputs=exported.inputs,
                        outputs=exported.outputs, models={v.file: v.path for v in variants},
                        variants=[v.to_variant() for v in variants], default_variant=report["precision"],
                        shape_ranges=recipe.shape_ranges, latency_budget_ms=target.default_budget_ms,
                        source=report["source"], report=report, extra_files=dict(recipe.files))
