"""Synthetic lesions inserted into real lung parenchyma, at known positions.

Neither sample volume has nodule annotations, so lesions are simulated: ellipsoids with a soft (sigmoid) edge, of
solid (≈ 0–60 HU) or ground-glass (≈ -650 to -350 HU) attenuation, 4–30 mm in diameter, placed only where the whole
ellipsoid lies inside the lung mask, and blended into the image with partial-volume averaging across the slice
thickness. This follows the lesion-insertion idea of Li et al., "Lung nodule simulation for CT" (Med. Phys. 2009)
in a simplified analytic form (no PSF model). Positions are in mm from voxel 0 (index × spacing), so they stay valid
after ``preprocess.resample``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .volume import SeriesError, Volume


@dataclass
class Lesion:
    """One synthetic lesion.

    Attributes:
        center_mm: (z, y, x) centre in mm from voxel 0.
        radii_mm: the three semi-axes in mm (before ``rotation``).
        rotation: 3×3 rotation matrix (row-major list) from lesion axes to (z, y, x).
        hu: mean attenuation in HU.
        kind: ``"solid"`` or ``"ground-glass"``.
        edge_mm: width of the sigmoid edge in mm.
        noise_hu: standard deviation of the added texture noise in HU.
    """

    center_mm: tuple[float, float, float]
    radii_mm: tuple[float, float, float]
    rotation: list[list[float]]
    hu: float
    kind: str
    edge_mm: float
    noise_hu: float

    @property
    def diameter_mm(self) -> float:
        """Equivalent-sphere diameter: 2·(a·b·c)^(1/3)."""
        return float(2.0 * np.prod(self.radii_mm) ** (1.0 / 3.0))

    @property
    def max_radius_mm(self) -> float:
        return float(max(self.radii_mm))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["diameter_mm"] = round(self.diameter_mm, 2)
        return d


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def sample_lesions(mask: np.ndarray, spacing_mm: tuple[float, float, float], n: int, rng: np.random.Generator,
                   diameter_mm: tuple[float, float] = (4.0, 30.0), ground_glass_fraction: float = 0.25,
                   min_gap_mm: float = 5.0) -> list[Lesion]:
    """Draw ``n`` non-overlapping lesions that lie wholly inside ``mask``.

    Diameters are log-uniform in ``diameter_mm``; axis ratios 0.7–1.0 (ellipsoids); a random orientation. A centre
    is eligible when its distance to the mask boundary or the volume's faces (Euclidean distance transform in mm) is at
    least the lesion's largest semi-axis; when no centre fits a drawn size, the size shrinks to the largest that fits (never below the
    lower bound). Centres are at least ``r1 + r2 + min_gap_mm`` apart.

    Args:
        mask: bool (z, y, x) lung mask on a grid of ``spacing_mm``.
    Returns:
        up to ``n`` lesions (fewer only when the lung is too small to hold more).
    Raises:
        SeriesError: the mask is empty (no lung in the volume).
    """
    from scipy.ndimage import distance_transform_edt

    if not mask.any():
        raise SeriesError("the lung mask is empty: no lesion can be placed", "check the volume covers the lungs")
    # pad with background so the volume's own faces count as boundary: a lesion must lie inside the image too
    dist = distance_transform_edt(np.pad(mask, 1), sampling=spacing_mm)[1:-1, 1:-1, 1:-1]
    sp = np.asarray(spacing_mm)
    lo, hi = diameter_mm
    out: list[Lesion] = []
    for _ in range(n):
        d = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        ratios = np.sort(rng.uniform(0.7, 1.0, size=3))[::-1]
        ratios = ratios / np.prod(ratios) ** (1 / 3)            # equivalent diameter stays d
        gap_ok = np.ones(mask.shape, dtype=bool)
        while True:
            radii = ratios * d / 2
            gap_ok[:] = True
            for les in out:
                zz, yy, xx = np.ogrid[tuple(slice(0, s) for s in mask.shape)]
                c = np.asarray(les.center_mm) / sp
                r2 = ((zz - c[0]) * sp[0]) ** 2 + ((yy - c[1]) * sp[1]) ** 2 + ((xx - c[2]) * sp[2]) ** 2
                gap_ok &= r2 >= (les.max_radius_mm + radii.max() + min_gap_mm) ** 2
            idx = np.flatnonzero(gap_ok & (dist >= radii.max()))
            if idx.size:
                break
            fit = float(dist[gap_ok].max()) if gap_ok.any() else 0.0
            d = min(d * 0.8, 2 * fit / ratios.max())
            if d < lo:
                return out
        pick = np.unravel_index(idx[rng.integers(idx.size)], mask.shape)
        center = tuple(float(i * s) for i, s in zip(pick, spacing_mm))
        kind = "ground-glass" if rng.random() < ground_glass_fraction else "solid"
        hu = float(rng.uniform(-650, -350) if kind == "ground-glass" else rng.uniform(0, 60))
        out.append(Lesion(center, tuple(float(r) for r in radii), _random_rotation(rng).tolist(), hu, kind,
                          float(rng.uniform(0.5, 1.5)), float(rng.uniform(15, 35))))
    return out


def lesion_alpha(shape: tuple[int, int, int], spacing_mm: tuple[float, float, float], lesion: Lesion,
                 slice_thickness_mm: float | None = None, z_step_mm: float = 1.0
                 ) -> tuple[tuple[slice, slice, slice], np.ndarray]:
    """Fractional lesion occupancy of each voxel near the lesion.

    ``alpha = sigmoid(r̄·(1 − ρ)/edge)`` with ρ the normalised ellipsoid radius and r̄ the mean semi-axis (≈ signed
    distance to the surface over the edge width), averaged over ``z_samples`` points across the slice thickness
    at points ``z_step_mm`` apart across the slice thickness (default: the z spacing), i.e. the partial-volume effect of
    the slice profile (a rectangular profile: each slice integrates its whole thickness).

    Returns:
        (bounding-box slices into the volume, float32 alpha in [0, 1] of the box's shape).
    """
    sp = np.asarray(spacing_mm, dtype=np.float64)
    c = np.asarray(lesion.center_mm, dtype=np.float64)
    thick = float(slice_thickness_mm or sp[0])
    reach = lesion.max_radius_mm + 4 * lesion.edge_mm + np.array([thick / 2, 0, 0])
    lo = np.maximum(np.floor((c - reach) / sp).astype(int), 0)
    hi = np.minimum(np.ceil((c + reach) / sp).astype(int) + 1, np.asarray(shape))
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    grids = np.meshgrid(*[np.arange(a, b) * s for a, b, s in zip(lo, hi, sp)], indexing="ij")
    rot = np.asarray(lesion.rotation)
    radii = np.asarray(lesion.radii_mm)
    rbar = float(radii.mean())
    n_z = max(3, int(np.ceil(thick / z_step_mm)) + 1)
    offsets = np.linspace(-thick / 2, thick / 2, n_z)
    alpha = np.zeros(grids[0].shape, dtype=np.float64)
    for dz in offsets:
        d = np.stack([grids[0] + dz - c[0], grids[1] - c[1], grids[2] - c[2]], axis=-1)
        local = d @ rot                                     # coordinates along the lesion axes
        rho = np.sqrt(((local / radii) ** 2).sum(-1))
        alpha += 1.0 / (1.0 + np.exp(-np.clip(rbar * (1.0 - rho) / lesion.edge_mm, -50, 50)))
    return box, (alpha / len(offsets)).astype(np.float32)


def insert_lesions(vol: Volume, lesions: list[Lesion], rng: np.random.Generator) -> Volume:
    """Blend lesions into a copy of ``vol``: ``hu' = hu·(1 − α) + α·(lesion.hu + noise)``.

    Works on any grid (native DICOM or resampled): positions are in mm; the slice thickness comes from
    ``vol.meta['slice_thickness_mm']`` (falling back to the z spacing).

    Returns:
        a new ``Volume``; ``meta['lesions']`` holds the lesion dicts.
    """
    hu = vol.hu.copy()
    thick = vol.meta.get("slice_thickness_mm")
    for les in lesions:
        box, a = lesion_alpha(vol.shape, vol.spacing_mm, les, thick)
        tex = les.hu + rng.normal(0.0, les.noise_hu, size=a.shape).astype(np.float32)
        hu[box] = hu[box] * (1.0 - a) + a * tex
    meta = dict(vol.meta)
    meta["lesions"] = [les.to_dict() for les in lesions]
    return Volume(hu, vol.spacing_mm, meta, vol.source)
