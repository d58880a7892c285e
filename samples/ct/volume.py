"""The in-memory CT volume shared by every step of the sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsedge import DsedgeError


class SeriesError(DsedgeError):
    """A CT series or volume file cannot be read as one consistent volume (the message names the file)."""


@dataclass
class Volume:
    """A CT volume in Hounsfield units.

    Attributes:
        hu: float32 array (z, y, x) in HU; z runs inferior → superior, y anterior → posterior, x right → left
            (DICOM LPS index order; NIfTI volumes are flipped to match).
        spacing_mm: voxel size (dz, dy, dx) in mm.
        meta: acquisition metadata: ``slice_thickness_mm`` and ``kvp`` (None when the file has no such tag, as for
            NIfTI), plus ``acquired_spacing_mm`` (the spacing before any resampling).
        source: where it was read from (directory or file).
    """

    hu: np.ndarray
    spacing_mm: tuple[float, float, float]
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.hu.shape)  # type: ignore[return-value]

    @property
    def extent_mm(self) -> tuple[float, float, float]:
        return tuple(float(n * s) for n, s in zip(self.hu.shape, self.spacing_mm))  # type: ignore[return-value]

    def crop(self, start: tuple[int, int, int], size: tuple[int, int, int]) -> "Volume":
        """A sub-volume (a view copied to its own array) starting at voxel ``start`` with ``size`` voxels."""
        sl = tuple(slice(a, a + n) for a, n in zip(start, size))
        return Volume(np.ascontiguousarray(self.hu[sl]), self.spacing_mm, dict(self.meta), self.source)
