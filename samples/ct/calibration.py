"""Real-CT inputs for ``dsedge build --calib DIR --heldout DIR``: calibration patches from the training volume, held-out
patches from the evaluation volume, written as ``.npz`` files (arrays ``patch`` float32 (N, 1, 32, 32, 32) and
``meta`` float32 (N, 6), the student's inputs).

- calibration: the fixed (non-augmented) patch draw of ``data.LesionPatches`` on the training chest series (half the
  patches centred near a lesion, half anywhere in the lung), lesion draw ``seed`` — what the model was trained on.
- held-out: the sliding-window patches (``infer.window_origins``, 32³ at stride 16 over the lung) of the held-out
  NIfTI volume with lesion draws ``seed``… that neither training nor ``python -m samples.ct evaluate`` (seeds 100…)
  uses. A different patient and scanner from the calibration set: nothing is shared with it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .data import LesionPatches, crop_patch
from .infer import window_origins
from .scans import Scan, make_scans

CHEST = "../shared/data/ct-chest-lung-pet-ct-dx-a0002"
HELD_OUT = "../shared/data/ct-totalsegmentator-example/example_ct.nii.gz"


def calibration_patches(scans: list[Scan], n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` fixed patches from ``scans`` (``LesionPatches(augment=False)``):
    {"patch": float32 (n, 1, 32, 32, 32), "meta": float32 (n, 6)}."""
    ds = LesionPatches(scans, n, positive_fraction=0.5, augment=False, seed=seed)
    items = [ds[k][0] for k in range(len(ds))]
    return {"patch": np.stack([p.numpy() for p, _ in items]).astype(np.float32),
            "meta": np.stack([m.numpy() for _, m in items]).astype(np.float32)}


def window_patches(scans: list[Scan], limit: int | None = None) -> dict[str, np.ndarray]:
    """Every sliding-window patch over the lung of each scan (as inference sees them), at most ``limit`` in all."""
    patches, metas = [], []
    for scan in scans:
        origins, _ = window_origins(scan.image.shape, scan.mask)
        for o in origins:
            patches.append(crop_patch(scan, tuple(int(v) for v in o))[0][None])
            metas.append(scan.meta)
    if limit is not None:
        patches, metas = patches[:limit], metas[:limit]
    return {"patch": np.stack(patches).astype(np.float32), "meta": np.stack(metas).astype(np.float32)}


def write_npz_dir(out: str | Path, arrays: dict[str, np.ndarray], per_file: int = 16) -> Path:
    """Write ``arrays`` (batch axis 0) as ``out/000.npz``, ``001.npz`` … of at most ``per_file`` samples each."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.npz"):
        old.unlink()
    n = len(next(iter(arrays.values())))
    for k, i in enumerate(range(0, n, per_file)):
        np.savez(out / f"{k:03d}.npz", **{name: a[i:i + per_file] for name, a in arrays.items()})
    return out


def write_build_inputs(out: str | Path, n_calib: int = 64, heldout_scans: int = 2, lesions: int = 6,
                       calib_volume: str = CHEST, heldout_volume: str = HELD_OUT) -> tuple[Path, Path, dict]:
    """``out/calib`` (``n_calib`` chest patches, lesion draw 0 as in training) and ``out/heldout`` (all lung windows
    of ``heldout_scans`` lesion draws, seeds 200…, of the held-out volume).

    Returns:
        (calibration dir, held-out dir, counts and sources for the report)."""
    out = Path(out)
    calib = calibration_patches(make_scans(calib_volume, 1, 12, seed=0), n_calib, seed=0)
    held = window_patches(make_scans(heldout_volume, heldout_scans, lesions, seed=200))
    c = write_npz_dir(out / "calib", calib)
    h = write_npz_dir(out / "heldout", held)
    return c, h, {"calibration": {"volume": calib_volume, "patches": len(calib["patch"]), "lesion_draw_seed": 0},
                  "heldout": {"volume": heldout_volume, "patches": len(held["patch"]), "lesion_draw_seeds":
                              list(range(200, 200 + heldout_scans))}}
