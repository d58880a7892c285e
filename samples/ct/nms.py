"""Device side (numpy only): lesion candidates from a cell probability map, and greedy 3-D non-maximum suppression.

Candidates are local maxima of the probability (3×3×3 cells) inside the lung; each is refined to the
probability-weighted centroid of its 3×3×3 neighbourhood and given a box from the extent of the cells above half its
peak. Overlapping boxes are merged by greedy NMS on 3-D IoU (Neubeck & Van Gool, ICPR 2006; the standard detector
post-processing, here on axis-aligned boxes in mm).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CELL = 2


@dataclass
class Detection:
    """center_mm (z, y, x) from voxel 0; radius_mm estimated size; score = peak P(lesion) in [0, 1]."""

    center_mm: tuple[float, float, float]
    radius_mm: float
    score: float

    def box(self) -> np.ndarray:
        c = np.asarray(self.center_mm)
        return np.concatenate([c - self.radius_mm, c + self.radius_mm])

    def to_dict(self) -> dict:
        return {"center_mm": [round(v, 2) for v in self.center_mm], "radius_mm": round(self.radius_mm, 2),
                "score": round(self.score, 5)}


def _max_filter3(a: np.ndarray) -> np.ndarray:
    """3×3×3 maximum filter (edges padded with -inf), numpy only."""
    p = np.pad(a, 1, mode="constant", constant_values=-np.inf)
    out = np.full_like(a, -np.inf)
    Z, Y, X = a.shape
    for dz in range(3):
        for dy in range(3):
            for dx in range(3):
                np.maximum(out, p[dz:dz + Z, dy:dy + Y, dx:dx + X], out=out)
    return out


def cell_mask(mask: np.ndarray) -> np.ndarray:
    """Voxel lung mask (z, y, x) → cell mask (ceil(z/2), ceil(y/2), ceil(x/2)): a cell is lung when any voxel is."""
    pad = [(0, (-n) % CELL) for n in mask.shape]
    m = np.pad(mask, pad)
    z, y, x = (n // CELL for n in m.shape)
    return m.reshape(z, CELL, y, CELL, x, CELL).any(axis=(1, 3, 5))


def find_candidates(prob: np.ndarray, spacing_mm: tuple[float, float, float], lung_cells: np.ndarray | None = None,
                    threshold: float = 0.05, max_candidates: int = 200, size_reach: int = 4) -> list[Detection]:
    """Local maxima of ``prob`` (cells) ≥ ``threshold`` inside ``lung_cells``, best first, at most ``max_candidates``.

    Args:
        prob: float32 (cz, cy, cx) P(lesion) per cell of 2³ voxels.
        spacing_mm: voxel spacing (dz, dy, dx).
        size_reach: half-width in cells of the neighbourhood used to estimate the radius.
    """
    p = prob if lung_cells is None else np.where(lung_cells, prob, 0.0)
    peaks = np.argwhere((p >= threshold) & (p == _max_filter3(p)))
    if len(peaks) == 0:
        return []
    scores = p[tuple(peaks.T)]
    order = np.argsort(-scores, kind="stable")[:max_candidates]
    cell_mm = np.asarray(spacing_mm) * CELL
    out = []
    for i in order:
        c = peaks[i]
        lo = np.maximum(c - 1, 0)
        hi = np.minimum(c + 2, p.shape)
        nb = p[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
        idx = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"), -1)
        centroid = (idx * nb[..., None]).reshape(-1, 3).sum(0) / max(float(nb.sum()), 1e-12)
        center = (centroid * CELL + (CELL - 1) / 2) * np.asarray(spacing_mm)
        lo = np.maximum(c - size_reach, 0)
        hi = np.minimum(c + size_reach + 1, p.shape)
        n_cells = int((p[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] >= scores[i] / 2).sum())
        radius = max(float(cell_mm.mean()) / 2, (3 * n_cells * float(np.prod(cell_mm)) / (4 * np.pi)) ** (1 / 3))
        out.append(Detection(tuple(float(v) for v in center), radius, float(scores[i])))
    return out


def iou_3d(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one box (6,) with boxes (N, 6); boxes are (z0, y0, x0, z1, y1, x1) in mm."""
    lo = np.maximum(box[:3], boxes[:, :3])
    hi = np.minimum(box[3:], boxes[:, 3:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    vol = lambda b: np.prod(b[..., 3:] - b[..., :3], axis=-1)  # noqa: E731
    return inter / (vol(box) + vol(boxes) - inter + 1e-12)


def nms_3d(detections: list[Detection], iou_threshold: float = 0.1, max_detections: int = 100) -> list[Detection]:
    """Greedy NMS: keep the best-scoring box, drop boxes with IoU > ``iou_threshold`` with it, repeat.

    Returns:
        kept detections, best first, at most ``max_detections``.
    """
    if not detections:
        return []
    dets = sorted(detections, key=lambda d: -d.score)
    boxes = np.stack([d.box() for d in dets])
    alive = np.ones(len(dets), dtype=bool)
    keep = []
    for i in range(len(dets)):
        if not alive[i]:
            continue
        keep.append(dets[i])
        if len(keep) >= max_detections:
            break
        alive[i + 1:] &= iou_3d(boxes[i], boxes[i + 1:]) <= iou_threshold
    return keep


def detect(prob: np.ndarray, spacing_mm: tuple[float, float, float], mask: np.ndarray | None = None,
           threshold: float = 0.05, iou_threshold: float = 0.1, max_detections: int = 100) -> list[Detection]:
    """Candidates (``find_candidates``) then ``nms_3d``. ``mask`` is the voxel lung mask (z, y, x) or None."""
    cells = None if mask is None else cell_mask(mask)[tuple(slice(0, n) for n in prob.shape)]
    return nms_3d(find_candidates(prob, spacing_mm, cells, threshold), iou_threshold, max_detections)
