"""Stage ``write``: publish the bundle atomically (manifest, models/, build/trtexec.sh, report.json)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifacts import Prepared, Recipe, VariantDraft
from ..bundle_writer import bundle_path, write_bundle
from ..config import BuildPlan
from ..golden import attach_golden, unbatched_inputs


def write(plan: BuildPlan, model: Prepared, variants: list[VariantDraft], recipe: Recipe,
          report: dict[str, Any]) -> Path:
    """``OUT/NAME-TARGET.dse``; nothing exists there unless every file and the manifest were written.

    Golden I/O (held-out rows, fp32 reference outputs, per-variant tolerances: ``golden/``) is attached here.

    Raises:
        BundleError: the destination exists and is not a bundle.
    """
    source, exported, target = model.source, model.exported, plan.target
    dest = bundle_path(plan.config.out_dir, source.name, target.name)
    models = {v.file: v.path for v in variants}
    shipped = [v.to_variant() for v in variants]
    # a rank-0 input (a scalar flag) beside batched ones is stored as one value and fed with every chunk of rows;
    # a model whose inputs are all rank-0 has no rows to cut (a user's pass: it crashed with an IndexError here)
    unbatched = unbatched_inputs(model.validation, exported.inputs)
    if unbatched:
        golden = {}
        report.setdefault("notes", []).append(
            f"no golden I/O: input(s) {', '.join(map(repr, unbatched))} have no batch axis to cut golden rows from"
            + (" and no other input has one" if len(unbatched) == len(exported.inputs) else "")
            + " (`dsedge verify` cannot check this bundle; `dsedge bench` and the runtime serve it)")
    else:
        golden = attach_golden(model.reference, models, shipped, model.validation, exported.inputs,
                               recipe.shape_ranges, source.validation_kind)
    return write_bundle(dest, name=source.name, target=target.to_dict(), inputs=exported.inputs,
                        outputs=exported.outputs, models=models, variants=shipped,
                        default_variant=report["precision"], shape_ranges=recipe.shape_ranges,
                        latency_budget_ms=plan.config.budget_ms or target.default_budget_ms,
                        source=report["source"], report=report,
                        extra_files={**dict(recipe.files), **golden})
