"""Patch datasets for ``dsedge train`` / ``dsedge distill`` (the ``[data] factory`` of teacher.toml/student.toml).

Each item is ``((patch, meta), target)``: patch float32 (1, 32, 32, 32) lung-windowed, meta float32 (6,) (see
``scans.meta_vector``), target int64 (4096,) per-cell labels (16³ cells of 2³ voxels). Training items are drawn
online: half are centred near a lesion (the lesion centre anywhere in the patch's middle 16³), half at a random lung
position, then augmented (flips on all three axes, 90° rotations in the axial plane, intensity scale/shift, and
dropping the slice-thickness/kVp tags with probability 0.2 so the model also sees them missing, as for NIfTI).
Random erasing (Zhong et al., arXiv:1708.04896, in 3-D) is off until the trainer's plateau monitor raises its
probability (``set_augment_strength``; ``[augment]`` in the training config): with probability p one cuboid of
4–16 voxels a side that holds no lesion cell is filled with uniform noise in [0, 1].
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .model import CELL, PATCH
from .scans import Scan, make_scans, read_volume, resolve_data_path  # noqa: F401


def crop_patch(scan: Scan, origin: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The 32³ image patch at voxel ``origin`` (multiples of 2; padded with 0 = air beyond the volume) and its 16³
    cell labels (padded with 0)."""
    img = np.zeros((PATCH,) * 3, dtype=np.float32)
    lab = np.zeros((PATCH // CELL,) * 3, dtype=np.int64)
    src = tuple(slice(max(o, 0), min(o + PATCH, n)) for o, n in zip(origin, scan.image.shape))
    dst = tuple(slice(s.start - o, s.stop - o) for s, o in zip(src, origin))
    img[dst] = scan.image[src]
    corigin = tuple(o // CELL for o in origin)
    csrc = tuple(slice(max(o, 0), min(o + PATCH // CELL, n)) for o, n in zip(corigin, scan.cell_labels.shape))
    cdst = tuple(slice(s.start - o, s.stop - o) for s, o in zip(csrc, corigin))
    lab[cdst] = scan.cell_labels[csrc]
    return img, lab


class LesionPatches(Dataset):
    """Patches from scans; ``augment=True`` draws positions and augmentations online from torch's RNG (so
    ``dsedge train``'s seed and DataLoader worker seeding govern them); ``augment=False`` is a fixed set.

    Args:
        scans: the scans to draw from.
        length: items per epoch.
        positive_fraction: share of items centred near a lesion.
        seed: fixes the item list of the non-augmented set.
    """

    def __init__(self, scans: list[Scan], length: int, positive_fraction: float = 0.5, augment: bool = True,
                 seed: int = 0) -> None:
        self.scans = scans
        self.length = int(length)
        self.positive_fraction = positive_fraction
        self.augment = augment
        self.erase_p = 0.0
        self._lesions = [(i, les) for i, s in enumerate(scans) for les in s.lesions]
        self._lung = [np.argwhere(s.mask[::CELL, ::CELL, ::CELL]) * CELL for s in scans]
        self._fixed = None if augment else [self._draw(np.random.default_rng([seed, k])) for k in range(self.length)]

    def __len__(self) -> int:
        return self.length

    def set_augment_strength(self, strength: float) -> None:
        """Random-erasing probability per training patch (0 = off; the default)."""
        self.erase_p = float(strength)

    def _draw(self, rng: np.random.Generator) -> tuple[int, tuple[int, int, int]]:
        if self._lesions and rng.random() < self.positive_fraction:
            si, les = self._lesions[rng.integers(len(self._lesions))]
            c = np.asarray(les.center_mm) / np.asarray(self.scans[si].spacing_mm)
            origin = c - PATCH // 2 + rng.uniform(-PATCH // 4, PATCH // 4, size=3)
        else:
            si = int(rng.integers(len(self.scans)))
            pts = self._lung[si]
            origin = pts[rng.integers(len(pts))] - PATCH // 2 + rng.integers(-2, 3, size=3)
        origin = (np.floor(np.asarray(origin) / CELL) * CELL).astype(int)
        return si, tuple(int(o) for o in origin)

    def __getitem__(self, k: int):
        if self.augment:
            rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
            si, origin = self._draw(rng)
        else:
            si, origin = self._fixed[k]
        scan = self.scans[si]
        img, lab = crop_patch(scan, origin)
        meta = scan.meta.copy()
        if self.augment:
            img, lab = _augment_geometry(img, lab, rng)
            if self.erase_p > 0 and rng.random() < self.erase_p:  # no draw while off: same stream as before
                img = _erase(img, lab, rng)
            img = np.clip(img * rng.uniform(0.9, 1.1) + rng.uniform(-0.05, 0.05), 0.0, 1.0)
            if rng.random() < 0.2:
                meta[2:6] = [0.0, 1.0, 0.0, 1.0]        # thickness and kVp missing
        patch = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32))[None]
        return (patch, torch.from_numpy(meta)), torch.from_numpy(np.ascontiguousarray(lab).reshape(-1))


def _augment_geometry(img: np.ndarray, lab: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same random flips (z, y, x) and axial 90° rotation applied to the patch and its cell labels."""
    for ax in range(3):
        if rng.random() < 0.5:
            img, lab = np.flip(img, ax), np.flip(lab, ax)
    k = int(rng.integers(4))
    return np.rot90(img, k, axes=(1, 2)), np.rot90(lab, k, axes=(1, 2))


def _erase(img: np.ndarray, lab: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Fill one random cuboid (4–16 voxels a side, cell aligned) with noise, unless it would cover a lesion cell."""
    size = rng.integers(2, 9, size=3) * CELL
    start = np.array([rng.integers(0, PATCH - s + 1) for s in size]) // CELL * CELL
    cells = tuple(slice(a // CELL, (a + s) // CELL) for a, s in zip(start, size))
    if lab[cells].any():
        return img
    img = img.copy()
    box = tuple(slice(a, a + s) for a, s in zip(start, size))
    img[box] = rng.random(tuple(size)).astype(np.float32)
    return img


def make_datasets(volume: str = "../shared/data/ct-chest-lung-pet-ct-dx-a0002", train_scans: int = 3,
                  val_scans: int = 1, lesions_per_scan: int = 12, train_items: int = 2048, val_items: int = 256,
                  positive_fraction: float = 0.5, seed: int = 0, spacing_mm: float = 2.0,
                  crop: list[list[int]] | None = None) -> tuple[LesionPatches, LesionPatches]:
    """``[data] factory``: (train, val) patch datasets from lesion draws on one volume.

    Train and val use different lesion draws (seeds ``seed…`` and ``seed + 1000…``) on the same real volume; the
    other volume stays held out for the sample's evaluation (``python -m samples.ct evaluate``).

    Args:
        volume: a DICOM series directory or NIfTI file (relative to the cwd or the repository root).
        crop: optional native-grid crop (tests use it to stay fast).
    Returns:
        (train ``LesionPatches`` with online augmentation, fixed val ``LesionPatches``).
    """
    train = make_scans(volume, train_scans, lesions_per_scan, seed, spacing_mm, crop)
    val = make_scans(volume, val_scans, lesions_per_scan, seed + 1000, spacing_mm, crop)
    return (LesionPatches(train, train_items, positive_fraction, augment=True),
            LesionPatches(val, val_items, positive_fraction, augment=False, seed=seed))
