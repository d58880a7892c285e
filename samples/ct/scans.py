"""A "scan": one real volume with a drawn set of synthetic lesions, resampled, windowed, with its lung mask, the
per-cell lesion labels and the metadata vector the detector fuses. Shared by training data and evaluation."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import data_path
from .dicom import _is_dicom, read_dicom_series
from .nifti import read_nifti
from .lesions import Lesion, insert_lesions, sample_lesions
from .preprocess import lung_mask, lung_window, resample
from .volume import SeriesError, Volume

REPO = Path(__file__).resolve().parents[2]
SPACING_MM = 2.0     # common isotropic spacing of every step after reading
CELL = 2             # voxels per output cell of the detector (model.CELL)


@dataclass
class Scan:
    """Attributes:
        image: float32 (z, y, x) lung-windowed [0, 1] at ``spacing_mm``.
        mask: bool (z, y, x) lung mask.
        lesions: the inserted lesions (positions in mm from voxel 0).
        cell_labels: int64 (ceil(z/2), ceil(y/2), ceil(x/2)): 1 where a cell centre lies inside a lesion or holds
            its centre, else 0.
        meta: float32 (META_DIM,) from ``meta_vector``.
        spacing_mm: (dz, dy, dx).
        name: a label for reports.
    """

    image: np.ndarray
    mask: np.ndarray
    lesions: list[Lesion]
    cell_labels: np.ndarray
    meta: np.ndarray
    spacing_mm: tuple[float, float, float]
    name: str = ""


def resolve_data_path(p: str | os.PathLike) -> Path:
    """``p`` as given (relative to the cwd), else relative to the repository root (configs use ../shared/data); a
    path under ../shared/data is looked for under ``$DSEDGE_DATA`` when that is set (``samples.data_path``)."""
    q = data_path(p)
    if q.exists() or q.is_absolute():
        return q
    return REPO / q


def read_volume(p: str | os.PathLike) -> Volume:
    """A DICOM series directory or a NIfTI file (``SeriesError`` when unreadable)."""
    q = resolve_data_path(p)
    if not q.exists():  # name the path as given (and where else it was looked for), not only the fallback
        where = f" (nor {q})" if Path(p) != q else ""
        raise SeriesError(f"no such CT volume: {p}{where}",
                          "pass a DICOM series folder or a .nii/.nii.gz file (relative paths count from where you "
                          "run, or the repository root)")
    if q.is_dir():
        if not any(_is_dicom(f) for f in q.iterdir() if f.is_file()):
            nii = sorted(f.name for f in q.iterdir() if f.name.lower().endswith((".nii", ".nii.gz")))
            if nii:  # a folder holding a NIfTI file: the reader wants the file itself
                raise SeriesError(f"{p}: a folder with no DICOM files but NIfTI file(s): {', '.join(nii[:3])}",
                                  f"pass the NIfTI file itself, e.g. {Path(p) / nii[0]}")
        return read_dicom_series(q)
    if _is_dicom(q) or q.suffix.lower() == ".dcm":  # one slice of a series: the reader wants the folder
        raise SeriesError(f"{p}: one DICOM file (a single slice), not a volume",
                          f"pass the folder holding the whole series: {Path(p).parent}")
    return read_nifti(q)


def meta_vector(meta: dict) -> np.ndarray:
    """The acquisition metadata the detector fuses, float32 (6,):
    [acquired dz / 5 mm, acquired in-plane spacing / 5 mm, slice thickness / 5 mm (0 if missing), thickness-missing
    flag, kVp / 120 (0 if missing), kVp-missing flag]. Missing tags (NIfTI has none) are imputed as 0 with the flag
    set (the missing-indicator method)."""
    dz, dy, _ = meta.get("acquired_spacing_mm") or (SPACING_MM,) * 3
    thick, kvp = meta.get("slice_thickness_mm"), meta.get("kvp")
    return np.array([dz / 5.0, dy / 5.0, (thick or 0.0) / 5.0, float(thick is None), (kvp or 0.0) / 120.0,
                     float(kvp is None)], dtype=np.float32)


def cell_labels(shape: tuple[int, int, int], spacing_mm: tuple[float, float, float], lesions: list[Lesion],
                cell: int = CELL) -> np.ndarray:
    """Per-cell lesion labels (see ``Scan.cell_labels``) for a volume of ``shape`` voxels."""
    cshape = tuple(-(-n // cell) for n in shape)
    out = np.zeros(cshape, dtype=np.int64)
    sp = np.asarray(spacing_mm) * cell
    for les in lesions:
        c = np.asarray(les.center_mm)
        r = les.max_radius_mm
        lo = np.maximum(np.floor((c - r) / sp - 1).astype(int), 0)
        hi = np.minimum(np.ceil((c + r) / sp + 1).astype(int), cshape)
        g = np.meshgrid(*[(np.arange(a, b) + 0.5) * s for a, b, s in zip(lo, hi, sp)], indexing="ij")
        d = np.stack([g[0] - c[0], g[1] - c[1], g[2] - c[2]], -1) @ np.asarray(les.rotation)
        inside = (((d / np.asarray(les.radii_mm)) ** 2).sum(-1) <= 1.0)
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        out[box] |= inside.astype(np.int64)
        ci = tuple(min(int(v), n - 1) for v, n in zip(c // sp, cshape))
        out[ci] = 1
    return out


def base_and_mask(native: Volume, spacing_mm: float = SPACING_MM) -> tuple[Volume, np.ndarray]:
    """The volume resampled to ``spacing_mm`` and its lung mask (reusable across lesion draws)."""
    base = resample(native, spacing_mm)
    return base, lung_mask(base)


def make_scan(native: Volume, n_lesions: int, seed: int, spacing_mm: float = SPACING_MM, name: str = "",
              diameter_mm: tuple[float, float] = (4.0, 30.0),
              base_mask: tuple[Volume, np.ndarray] | None = None) -> Scan:
    """Draw lesions inside the lung of ``native`` and build the scan.

    Steps: resample to ``spacing_mm`` → lung mask → draw lesion positions/sizes in mm → insert them on the *native*
    grid (so thick slices blur them as they blur real anatomy) → resample again → lung window.

    Args:
        native: the volume as read (DICOM or NIfTI).
        seed: seeds the lesion draw and texture noise (``numpy.random.default_rng``).
        base_mask: ``base_and_mask(native, spacing_mm)`` when already computed.
    """
    rng = np.random.default_rng(seed)
    base, mask = base_mask or base_and_mask(native, spacing_mm)
    lesions = sample_lesions(mask, base.spacing_mm, n_lesions, rng, diameter_mm=diameter_mm)
    with_lesions = resample(insert_lesions(native, lesions, rng), spacing_mm)
    image = lung_window(with_lesions.hu)
    return Scan(image, mask, lesions, cell_labels(image.shape, base.spacing_mm, lesions), meta_vector(native.meta),
                base.spacing_mm, name or f"{native.meta.get('format', 'ct')}-seed{seed}")


def make_scans(volume: str, n_scans: int, lesions_per_scan: int, seed: int, spacing_mm: float = 2.0,
               crop: list[list[int]] | None = None) -> list[Scan]:
    """``n_scans`` lesion draws (seeds ``seed``, ``seed+1``, …) on one real volume, optionally cropped first to
    ``crop = [[z0, y0, x0], [dz, dy, dx]]`` voxels of the native grid."""
    native = read_volume(volume)
    if crop is not None:
        native = native.crop(tuple(crop[0]), tuple(crop[1]))
    bm = base_and_mask(native, spacing_mm)
    return [make_scan(native, lesions_per_scan, seed + i, spacing_mm, base_mask=bm) for i in range(n_scans)]
