"""Stage ``resolve``: ``--model`` to a ``Source``, refusing a fine-tune of an ONNX file before any work."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..student import refuse_for_onnx
from ..config import BuildPlan
from ...runtime.names import safe_model_name
from ..sources import Source, resolve_source


def resolve(plan: BuildPlan, log: Callable[[str], None]) -> Source:
    """The source named by ``plan.config.model`` (the reference model when None).

    Raises:
        SourceError: see ``resolve_source``; or ``--qat-steps`` / ``--finetune-steps`` asked of an ONNX file.
    """
    source = resolve_source(plan.config.model)
    source = dataclasses.replace(source, name=safe_model_name(source.name))  # the name becomes a path
    log(f"source {source.kind}: {source.name}")
    if plan.finetuning and source.module is None:
        refuse_for_onnx(plan.config)
    return source
