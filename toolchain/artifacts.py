"""What the stages of ``dsedge build`` hand each other: small typed records, one per artifact.

``Prepared`` (the fp32 model ready to compress) → ``Compressed`` (one compressed ONNX file) → ``Choice`` (the
precision built, with any candidates the measured ``auto`` choice built) → ``VariantDraft`` (a variant validated and
timed) → ``Recipe`` (the engine recipe and extra bundle files).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.bundle import Variant
from .export import Exported
from .sources import Source


@dataclass
class Compressed:
    """A compressed model and what the compressor reported (layers, bytes, algorithm): ``path`` the ONNX file (None
    until saved), ``model`` the ``onnx.ModelProto`` when it is held in memory."""

    path: Path | None
    precision: str
    details: dict[str, Any] = field(default_factory=dict)
    model: Any = None


@dataclass(frozen=True)
class Prepared:
    """The fp32 model ready to compress.

    Attributes:
        source: the resolved source (after ``--prune``/``--qat-steps``, its ``module`` is the student).
        exported: the fp32 ONNX export (of the student when fine-tuned).
        reference: a copy of the untouched fp32 export: every variant's accuracy is measured against it.
        validation: name → array, the held-out inputs accuracy is measured on (batch axis 0).
        finetune: report.json's ``compensation`` section (None without ``--prune``/``--qat-steps``).
        notes: what the fine-tune stage decided (report.json ``notes``).
    """

    source: Source
    exported: Exported
    reference: Path
    validation: dict[str, np.ndarray]
    finetune: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


@dataclass
class Measured:
    """A candidate variant built, fitted, validated and timed during the measured ``auto`` choice."""

    compressed: Compressed
    opset: int
    accuracy: dict[str, Any]
    latency_ms: dict[str, Any]


@dataclass(frozen=True)
class Choice:
    """The compress stage's result: the precision built, its file, and what ``auto`` measured to choose it.

    ``record`` is report.json's ``precision_choice`` (None unless ``--precision auto``); ``notes`` say the decision.
    """

    precision: str
    compressed: Compressed
    measured: dict[str, Measured] = field(default_factory=dict)
    record: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()


@dataclass
class VariantDraft:
    """One variant to ship: ONNX file, accuracy vs the reference, CPU latency (ms, filled by the measure stage)."""

    name: str
    path: Path
    accuracy: dict[str, Any]
    latency_ms: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    batch_invariant: bool | None = None  # False: a row's output depends on its batch-mates (served at batch 1)

    @property
    def file(self) -> str:
        return f"models/{self.name}.onnx"

    @property
    def precision(self) -> str:
        return self.name

    def to_variant(self) -> Variant:
        """The manifest's record of this variant."""
        return Variant(name=self.name, precision=self.name, file=self.file, accuracy=self.accuracy,
                       latency_ms=self.latency_ms or {}, notes=list(self.notes),
                       batch_invariant=self.batch_invariant)


@dataclass(frozen=True)
class Recipe:
    """The engine recipe stage's result: shape ranges (symbol → min/opt/max), ``build/trtexec.sh``, the recipe's
    notes (report.json ``engine_recipe``), and extra bundle files (relative path → content, engines included)."""

    shape_ranges: dict[str, dict[str, int]]
    notes: Any
    files: dict[str, str | bytes]
    engines: tuple[str, ...] = ()
