"""Read a NIfTI CT volume (nibabel) into a ``Volume`` in the same index order as the DICOM reader."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .volume import SeriesError, Volume

AIR_HU = -1024.0  # what NaN or infinite voxels become
# Largest angle (degrees) between a voxel axis and its nearest patient axis that is still read as axis-aligned: float32
# noise in a written sform, and tilts whose displacement across a 500 mm field (0.9 mm) stays under half a 2 mm voxel
# of the working grid. Beyond it the volume is refused: the pipeline (reorientation by axis flips and transposes,
# resampling by spacing alone, the model trained on axis-aligned anatomy) has no rotation to apply.
OBLIQUE_TOL_DEG = 0.1


def read_nifti(path: str | os.PathLike) -> Volume:
    """Read a 3-D NIfTI-1/2 CT volume in HU.

    The image is reoriented to RAS+ (``nibabel.as_closest_canonical``), transposed to (z, y, x) and flipped in y and x
    so that its index order matches DICOM's LPS order (z inferior → superior, y anterior → posterior, x right → left).
    Voxel values are taken as HU after the header's scl_slope/scl_inter (NIfTI-1 §``scl_slope``; a NaN/zero slope
    means no scaling). NaN or infinite voxels (some pipelines write NaN outside the field of view) are set to air,
    ``AIR_HU`` (-1024 HU), and counted in ``meta["nonfinite_voxels"]``: left as they are, they would turn every
    window they touch into NaN scores.

    The voxel size is taken from the image affine (sform, else qform: the mapping nibabel reorients by), as the
    lengths of its columns, not from the header's pixdim, which writers do not always keep in step with the sform.

    Returns:
        ``Volume`` with ``hu`` float32 (z, y, x), ``spacing_mm`` (dz, dy, dx) in mm, ``meta`` with
        slice_thickness_mm and kvp set to None (NIfTI carries no acquisition tags: they are imputed as missing
        downstream).
    Raises:
        SeriesError: the file is missing, unreadable, not a 3-D volume, holds complex or non-scalar (e.g. RGB) voxels,
            has an affine whose voxel size is zero or not finite, has an oblique affine (a voxel axis more than
            ``OBLIQUE_TOL_DEG`` off every patient axis, or two voxel axes nearest the same one), or has no finite
            voxel.
    """
    import nibabel as nib

    p = Path(path)
    if not p.is_file():
        raise SeriesError(f"NIfTI file not found: {p}", "pass the path of a .nii or .nii.gz file")
    try:
        img = nib.load(str(p))
        dtype = img.get_data_dtype()
    except Exception as e:
        raise SeriesError(f"{p}: not a readable NIfTI file ({e})", "check the file is complete (.nii/.nii.gz)") from e
    if dtype.kind not in "biuf":  # complex: casting would drop the imaginary part; RGB: a record per voxel
        raise SeriesError(f"{p}: NIfTI voxels are {dtype} ({'complex' if dtype.kind == 'c' else 'not scalar'}), "
                          "expected real HU values", "pass a CT volume stored as integers or floats")
    _check_affine_zooms(p, img.affine)
    _check_axis_aligned(p, img.affine)
    try:
        img = nib.as_closest_canonical(img)
        data = np.asarray(img.dataobj, dtype=np.float32)
    except Exception as e:
        raise SeriesError(f"{p}: not a readable NIfTI file ({e})", "check the file is complete (.nii/.nii.gz)") from e
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise SeriesError(f"{p}: NIfTI image has shape {data.shape}, expected a 3-D volume",
                          "split a 4-D series into volumes first" if data.ndim > 3 else
                          "a single slice is not a volume: pass the whole series (a 3-D .nii or a DICOM folder)")
    # canonical (R, A, S) order; rounded to nm, below the float32 noise of an oblique sform
    zooms = [round(float(z), 6) for z in np.linalg.norm(img.affine[:3, :3], axis=0)]
    hu = np.ascontiguousarray(data.transpose(2, 1, 0)[:, ::-1, ::-1])
    bad = ~np.isfinite(hu)
    if bad.all():
        raise SeriesError(f"{p}: every voxel is NaN or infinite", "check the file holds a CT volume in HU")
    hu[bad] = AIR_HU
    spacing = (zooms[2], zooms[1], zooms[0])
    meta = {"slice_thickness_mm": None, "kvp": None, "acquired_spacing_mm": spacing, "format": "nifti",
            "nonfinite_voxels": int(bad.sum())}
    return Volume(hu, spacing, meta, str(p))


def _check_affine_zooms(path: Path, affine: np.ndarray) -> np.ndarray:
    """Voxel size in mm along each array axis (the affine's column lengths); SeriesError if any is 0 or not finite."""
    zooms = np.linalg.norm(np.asarray(affine, dtype=np.float64)[:3, :3], axis=0)
    if not np.isfinite(zooms).all() or (zooms < 1e-6).any():
        raise SeriesError(f"{path}: the NIfTI affine (sform/qform) gives voxel size {zooms.round(6).tolist()} mm",
                          "set a valid sform or qform (with non-zero pixdim), e.g. with nibabel's set_sform")
    return zooms


def axis_angles(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each column of ``columns`` (3 × n, patient x, y, z rows; any non-zero length): the angle in degrees to
    its nearest patient axis, and that axis (0, 1, 2). Shared with the DICOM reader's orientation check."""
    a = np.asarray(columns, dtype=np.float64)
    cosines = np.abs(a / np.linalg.norm(a, axis=0))           # |direction cosine| of each column with x, y, z
    return np.degrees(np.arccos(np.clip(cosines.max(axis=0), 0.0, 1.0))), cosines.argmax(axis=0)


def _check_axis_aligned(path: Path, affine: np.ndarray, tol_deg: float = OBLIQUE_TOL_DEG) -> float:
    """The largest angle in degrees between a voxel axis (an affine column) and its nearest patient axis.

    Raises:
        SeriesError: the angle exceeds ``tol_deg`` (a rotated or sheared grid, which ``nibabel.as_closest_canonical``
            would only relabel, never resample), or two voxel axes share their nearest patient axis."""
    a = np.asarray(affine, dtype=np.float64)[:3, :3]
    angles, nearest = axis_angles(a)
    angle = float(angles.max())
    if len(set(nearest.tolist())) < 3:
        raise SeriesError(f"{path}: the NIfTI affine points two voxel axes along the same patient axis "
                          f"(columns {np.round(a, 4).T.tolist()})", "set a valid sform or qform, e.g. with nibabel's "
                          "set_sform")
    if angle > tol_deg:
        raise SeriesError(f"{path}: the NIfTI affine is oblique (a voxel axis is {angle:.2f}° off the patient axes, "
                          f"more than {tol_deg:g}°); this sample reads axis-aligned volumes only",
                          "resample it onto an axis-aligned grid first, e.g. nibabel.processing.resample_to_output"
                          "(img) or 3dWarp -deoblique (AFNI)")
    return angle
