"""Read a NIfTI CT volume (nibabel) into a ``Volume`` in the same index order as the DICOM reader."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .volume import SeriesError, Volume

AIR_HU = -1024.0  # what NaN or infinite voxels become


def read_nifti(path: str | os.PathLike) -> Volume:
    """Read a 3-D NIfTI-1/2 CT volume in HU.

    The image is reoriented to RAS+ (``nibabel.as_closest_canonical``), transposed to (z, y, x) and flipped in y and x
    so that its index order matches DICOM's LPS order (z inferior → superior, y anterior → posterior, x right → left).
    Voxel values are taken as HU after the header's scl_slope/scl_inter (NIfTI-1 §``scl_slope``; a NaN/zero slope
    means no scaling). NaN or infinite voxels (some pipelines write NaN outside the field of view) are set to air,
    ``AIR_HU`` (-1024 HU), and counted in ``meta["nonfinite_voxels"]``: left as they are, they would turn every
    window they touch into NaN scores.

    Returns:
        ``Volume`` with ``hu`` float32 (z, y, x), ``spacing_mm`` (dz, dy, dx), ``meta`` with slice_thickness_mm and
        kvp set to None (NIfTI carries no acquisition tags: they are imputed as missing downstream).
    Raises:
        SeriesError: the file is missing, unreadable, not a 3-D volume, or has no finite voxel.
    """
    import nibabel as nib

    p = Path(path)
    if not p.is_file():
        raise SeriesError(f"NIfTI file not found: {p}", "pass the path of a .nii or .nii.gz file")
    try:
        img = nib.as_closest_canonical(nib.load(str(p)))
        data = np.asarray(img.dataobj, dtype=np.float32)
    except Exception as e:
        raise SeriesError(f"{p}: not a readable NIfTI file ({e})", "check the file is complete (.nii/.nii.gz)") from e
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise SeriesError(f"{p}: NIfTI image has shape {data.shape}, expected a 3-D volume",
                          "split a 4-D series into volumes first" if data.ndim > 3 else
                          "a single slice is not a volume: pass the whole series (a 3-D .nii or a DICOM folder)")
    zooms = [float(z) for z in img.header.get_zooms()[:3]]
    hu = np.ascontiguousarray(data.transpose(2, 1, 0)[:, ::-1, ::-1])
    bad = ~np.isfinite(hu)
    if bad.all():
        raise SeriesError(f"{p}: every voxel is NaN or infinite", "check the file holds a CT volume in HU")
    hu[bad] = AIR_HU
    spacing = (zooms[2], zooms[1], zooms[0])
    meta = {"slice_thickness_mm": None, "kvp": None, "acquired_spacing_mm": spacing, "format": "nifti",
            "nonfinite_voxels": int(bad.sum())}
    return Volume(hu, spacing, meta, str(p))
