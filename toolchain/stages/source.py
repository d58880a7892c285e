"""Stage ``resolve``: ``--model`` to a ``Source``, refusing a fine-tune of an ONNX file before any work."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..bundle_writer import bundle_path, check_replaceable
from ..student import refuse_for_onnx
from ..config import BuildPlan
from ...runtime.names import safe_model_name
from ..sources import Source, resolve_source


def resolve(plan: BuildPlan, log: Callable[[str], None]) -> Source:
    """The source named by ``plan.config.model`` (the reference model when None).

    Raises:
        SourceError: see ``resolve_source``; or ``--qat-steps`` / ``--finetune-steps`` asked of an ONNX file.
        BundleError: ``OUT/NAME-TARGET.dse`` exists and is not a bundle (checked again when it is written).
    """
    source = resolve_source(plan.config.model)
    source = dataclasses.replace(source, name=safe_model_name(source.name))  # the name becomes a path
    log(f"source {source.kind}: {source.name}")
    check_replaceable(bundle_path(plan.config.out_dir, source.name, plan.target.name))  # before any work
    if plan.finetuning and source.module is None:
        refuse_for_onnx(plan.config)
    return source
