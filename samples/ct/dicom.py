"""Read one CT series of DICOM files into a ``Volume`` (pydicom), refusing malformed series with errors that name
the file.

Geometry follows DICOM PS3.3 C.7.6.2 (Image Plane Module): slices are ordered by the projection of
ImagePositionPatient on the slice normal (the cross product of the two ImageOrientationPatient direction cosines);
the slice spacing is taken from those positions, not from SliceThickness. The (slice, row, column) axes are then
transposed and flipped to the closest patient axes, so the volume is in LPS index order whatever the patient
position; a series that is oblique or gantry-tilted by more than ``OBLIQUE_TOL_DEG`` (0.1°) is refused, not
snapped to those axes. HU = stored value × RescaleSlope + RescaleIntercept (PS3.3 C.11.1.1.2).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .nifti import OBLIQUE_TOL_DEG, axis_angles
from .volume import SeriesError, Volume

DEOBLIQUE_HINT = ("convert it to NIfTI (dcm2niix) and resample that onto an axis-aligned grid, e.g. "
                  "nibabel.processing.resample_to_output(img) or 3dWarp -deoblique (AFNI)")
TILT_HINT = ("convert it with dcm2niix, which also writes a copy resampled onto a rectangular grid (the file with "
             "'_Tilt' in its name), and read that copy")
DECODER_HINT = ("install a pixel-data decoder for pydicom, e.g. pip install pylibjpeg pylibjpeg-libjpeg "
                "pylibjpeg-openjpeg (or python-gdcm), or decompress the series with `gdcmconv --raw`")


def _is_dicom(path: Path) -> bool:
    """A Part 10 file: 128-byte preamble then b"DICM" (PS3.10 7.1)."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:] == b"DICM"


def list_series_files(source: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """The DICOM Part 10 files in a directory (non-DICOM files such as notes are skipped), or the given files.

    Raises:
        SeriesError: the directory does not exist, holds no DICOM file, or holds a ``.dcm`` file that is not a
            Part 10 file (damaged, or without its preamble).
    """
    if isinstance(source, (str, os.PathLike)):
        d = Path(source)
        if not d.is_dir():
            raise SeriesError(f"DICOM series directory not found: {d}", "pass the folder holding the .dcm files")
        candidates = sorted(p for p in d.iterdir() if p.is_file())
        files = [p for p in candidates if _is_dicom(p)]
        # a file named .dcm that is not Part 10 is a damaged slice, not a note: said, not skipped (it was reported
        # as a missing slice, and a series without the preamble as "no DICOM files")
        broken = [p.name for p in candidates if p.suffix.lower() == ".dcm" and p not in files]
        if broken:
            raise SeriesError(f"{len(broken)} file(s) named .dcm in {d} are not DICOM Part 10 files (no 'DICM' at "
                              f"byte 128), e.g. {broken[0]}",
                              "restore them from the archive, or re-export the series as DICOM Part 10 files")
        if not files:
            raise SeriesError(f"no DICOM files in {d}", "a DICOM file has 'DICM' at byte 128; check the folder")
        return files
    return [Path(p) for p in source]


CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_SOP_CLASSES = {"1.2.840.10008.5.1.4.1.1.2.1": "Enhanced CT Image Storage",
                           "1.2.840.10008.5.1.4.1.1.2.2": "Legacy Converted Enhanced CT Image Storage"}


def read_dicom_series(source: str | os.PathLike | Iterable[str | os.PathLike], *,
                      spacing_rtol: float = 0.01) -> Volume:
    """Read a single-series CT into HU.

    Slices are sorted by their position along the slice normal, then the axes are transposed and flipped to the
    patient axis each lies closest to (as ``nibabel.as_closest_canonical`` does for NIfTI), so that whatever the
    patient position (head or feet first, supine or prone) and scan direction, index order is DICOM LPS order.

    Args:
        source: a directory (every DICOM file in it must belong to the series) or a list of files.
        spacing_rtol: relative tolerance on the gap between consecutive slice positions.
    Returns:
        ``Volume`` with ``hu`` float32 (z, y, x): z inferior → superior, y anterior → posterior, x right → left;
        ``spacing_mm`` (dz, dy, dx) in mm, in that order (for an axial series: the slice spacing from
        ImagePositionPatient, then PixelSpacing row, column); ``meta`` (slice_thickness_mm, kvp,
        acquired_spacing_mm, series_uid, manufacturer).
    Raises:
        SeriesError: naming the offending file for: mixed SeriesInstanceUIDs, a file that is not CT image data
            (Modality other than CT, a non-CT SOP class, enhanced multi-frame CT), a missing, non-numeric,
            non-finite or degenerate ImagePositionPatient / ImageOrientationPatient / PixelSpacing (spacing ≤ 0),
            a missing or non-finite RescaleSlope / RescaleIntercept or a zero slope, differing orientation / matrix
            size / pixel spacing, duplicate slice positions, missing slices (a gap that is a whole multiple of the
            spacing), inconsistent slice spacing, compressed pixel data without a decoder, an oblique
            ImageOrientationPatient (the row or column direction or the slice normal more than ``OBLIQUE_TOL_DEG``,
            0.1°, off the patient axes) or a gantry tilt (slice positions stepping more than that off the normal).
    """
    import pydicom

    files = list_series_files(source)
    headers, geoms = [], []
    for f in files:
        try:
            ds = pydicom.dcmread(f, stop_before_pixels=True)
        except Exception as e:  # pydicom raises several types for a broken file
            cut = _truncated(f)
            raise SeriesError(f"{f}: " + (cut or f"not a readable DICOM file ({e})"),
                              TRUNCATED_HINT if cut else "remove the file from the series folder") from e
        for tag in ("Modality", "SeriesInstanceUID", "ImagePositionPatient", "ImageOrientationPatient",
                    "PixelSpacing", "Rows", "Columns", "RescaleSlope", "RescaleIntercept"):
            if tag not in ds:
                cut = _truncated(f)                 # pydicom stops quietly at a cut: say so, not "missing tag"
                if cut:
                    raise SeriesError(f"{f}: {cut}", TRUNCATED_HINT)
                if tag == "Modality":
                    raise SeriesError(f"{f}: missing Modality, cannot tell that it is CT image data",
                                      "only CT image slices can be read as a series; restore the original file")
                if tag.startswith("Rescale"):
                    raise SeriesError(f"{f}: missing {tag}, cannot convert stored values to HU",
                                      "CT images must carry RescaleSlope and RescaleIntercept (Type 1, PS3.3 "
                                      "C.8.2.1); restore the original file from the archive")
                raise SeriesError(f"{f}: missing {tag}, cannot place the slice in a volume",
                                  "only CT image slices can be read as a series")
            if tag == "Modality":      # first: an MR or PET file lacks the CT tags below (no HU rescale)
                _check_ct(f, ds)
        geoms.append(_slice_geometry(f, ds))
        headers.append(ds)

    # one series only; name the files of the smaller group
    uids: dict[str, list[Path]] = {}
    for f, ds in zip(files, headers):
        uids.setdefault(str(ds.SeriesInstanceUID), []).append(f)
    if len(uids) > 1:
        groups = sorted(uids.items(), key=lambda kv: -len(kv[1]))
        main_uid, main_files = groups[0]
        odd_uid, odd_files = groups[1]
        raise SeriesError(f"mixed series: {odd_files[0]} has SeriesInstanceUID {odd_uid}, but {len(main_files)} "
                          f"other files have {main_uid}",
                          "put each series in its own folder, or pass only one series' files")

    ref = headers[0]
    ref_orient, ref_spacing = geoms[0]["orientation"], geoms[0]["spacing"]
    for f, ds, g in zip(files, headers, geoms):
        if not np.allclose(g["orientation"], ref_orient, atol=1e-4):
            raise SeriesError(f"{f}: ImageOrientationPatient {list(ds.ImageOrientationPatient)} differs from "
                              f"{files[0].name}'s {list(ref.ImageOrientationPatient)}", "the slices must be parallel")
        if (int(ds.Rows), int(ds.Columns)) != (int(ref.Rows), int(ref.Columns)):
            raise SeriesError(f"{f}: matrix {ds.Rows}×{ds.Columns} differs from {files[0].name}'s "
                              f"{ref.Rows}×{ref.Columns}", "all slices of a series must have the same size")
        if not np.allclose(g["spacing"], ref_spacing, rtol=1e-4):
            raise SeriesError(f"{f}: PixelSpacing {list(ds.PixelSpacing)} differs from {files[0].name}'s "
                              f"{list(ref.PixelSpacing)}", "all slices of a series must share one pixel spacing")

    row_dir, col_dir = ref_orient[:3], ref_orient[3:]
    normal = np.cross(row_dir, col_dir)
    normal /= np.linalg.norm(normal)
    _check_axis_aligned(files[0], np.column_stack([row_dir, col_dir, normal]))
    pos = np.array([float(np.dot(g["position"], normal)) for g in geoms])
    order = np.argsort(pos, kind="stable")
    files = [files[i] for i in order]
    geoms = [geoms[i] for i in order]
    pos = pos[order]

    dz = _check_slice_gaps(files, pos, spacing_rtol)
    _check_no_tilt(files, np.array([g["position"] for g in geoms]), pos, normal)

    slices = []
    for f, g in zip(files, geoms):
        slices.append(_read_hu(f, g["slope"], g["intercept"]))
    hu = np.stack(slices).astype(np.float32, copy=False)
    # array axes (slice, row, column) run along (normal, column cosines, row cosines): bring them to LPS (z, y, x)
    hu, spacing = _to_lps(hu, (normal, col_dir, row_dir), (dz, float(ref_spacing[0]), float(ref_spacing[1])))
    thickness = ref.get("SliceThickness")
    kvp = ref.get("KVP")
    meta = {
        "slice_thickness_mm": float(thickness) if thickness not in (None, "") else None,
        "kvp": float(kvp) if kvp not in (None, "") else None,
        "acquired_spacing_mm": spacing,
        "series_uid": str(ref.SeriesInstanceUID),
        "manufacturer": str(ref.get("Manufacturer", "")),
        "format": "dicom",
    }
    src = str(Path(files[0]).parent)
    return Volume(hu, spacing, meta, src)


def _check_ct(path: Path, ds) -> None:
    """SeriesError unless ``ds`` is single-frame CT image data: Modality CT and (when stated) CT Image Storage."""
    modality = str(ds.Modality).strip()
    if modality != "CT":
        raise SeriesError(f"{path}: Modality is {modality or '(empty)'!r}, not 'CT': not CT image data",
                          "this reader takes CT series only (HU); remove other modalities from the folder")
    sop = str(ds.get("SOPClassUID") or getattr(getattr(ds, "file_meta", None), "MediaStorageSOPClassUID", "") or "")
    if sop in ENHANCED_CT_SOP_CLASSES:
        raise SeriesError(f"{path}: SOPClassUID {sop} ({ENHANCED_CT_SOP_CLASSES[sop]}) is multi-frame CT, which this "
                          "reader does not support", "convert it to single-frame CT Image Storage files (e.g. "
                          "`emf2sf` from dcm4che) or to NIfTI (dcm2niix)")
    if sop and sop != CT_IMAGE_STORAGE:
        import pydicom

        name = pydicom.uid.UID(sop).name
        raise SeriesError(f"{path}: SOPClassUID {sop} ({name}) is not CT Image Storage ({CT_IMAGE_STORAGE}): not CT "
                          "image data", "this reader takes CT image slices only; remove the file from the folder")


def _floats(path: Path, ds, tag: str, n: int) -> np.ndarray:
    """The ``n`` values of multi-valued numeric ``tag`` as float64, or SeriesError naming file, tag and value."""
    from pydicom.multival import MultiValue

    raw = ds.get(tag)
    values = list(raw) if isinstance(raw, (list, tuple, MultiValue)) else [raw]
    try:
        out = np.array([float(v) for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        out = None
    if out is None or out.shape != (n,) or not np.isfinite(out).all():
        what = "a finite number" if n == 1 else f"{n} finite numbers"
        raise SeriesError(f"{path}: {tag} {values if n > 1 else raw!r} is not {what}",
                          "the header is corrupt: restore the original file from the archive, or remove it")
    return out


def _slice_geometry(path: Path, ds) -> dict:
    """Position (mm), orientation cosines, pixel spacing (mm, row then column) and HU rescale of one slice;
    SeriesError naming file and tag for values that are missing, non-finite, non-positive or degenerate."""
    orient = _floats(path, ds, "ImageOrientationPatient", 6)
    row, col = orient[:3], orient[3:]
    # PS3.3 C.7.6.2.1.1: two orthogonal unit vectors (written with limited precision by real scanners)
    if abs(np.linalg.norm(row) - 1) > 1e-2 or abs(np.linalg.norm(col) - 1) > 1e-2 or abs(np.dot(row, col)) > 1e-2:
        raise SeriesError(f"{path}: ImageOrientationPatient {list(ds.ImageOrientationPatient)} is not two orthogonal "
                          "unit vectors", "the header is corrupt: restore the original file from the archive")
    orient = np.concatenate([row / np.linalg.norm(row), col / np.linalg.norm(col)])
    spacing = _floats(path, ds, "PixelSpacing", 2)
    if (spacing <= 0).any():
        raise SeriesError(f"{path}: PixelSpacing {list(ds.PixelSpacing)} is not positive",
                          "the header is corrupt: restore the original file from the archive")
    slope = _floats(path, ds, "RescaleSlope", 1)[0]
    if slope == 0:
        raise SeriesError(f"{path}: RescaleSlope is 0, every voxel would read as RescaleIntercept",
                          "the header is corrupt: restore the original file from the archive")
    return {"position": _floats(path, ds, "ImagePositionPatient", 3), "orientation": orient, "spacing": spacing,
            "slope": float(slope), "intercept": float(_floats(path, ds, "RescaleIntercept", 1)[0])}


def _check_axis_aligned(path: Path, axes: np.ndarray, tol_deg: float = OBLIQUE_TOL_DEG) -> float:
    """The largest angle in degrees between the row direction, column direction or slice normal (the columns of
    ``axes``) and its nearest patient axis, as ``nifti._check_axis_aligned`` measures an affine's voxel axes.

    Raises:
        SeriesError: the angle exceeds ``tol_deg``: an oblique ImageOrientationPatient, which ``_to_lps`` would only
            snap to the closest axes (flips and transposes), placing every voxel off its patient position."""
    angles, _nearest = axis_angles(axes)   # > tol_deg whenever two share an axis (they are orthogonal: ≥ 45°)
    worst = int(angles.argmax())
    if angles[worst] > tol_deg:
        what = ("row direction", "column direction", "slice normal")[worst]
        raise SeriesError(f"{path}: ImageOrientationPatient {np.round(axes[:, :2].T.ravel(), 4).tolist()} is "
                          f"oblique (the {what} is {angles[worst]:.2f}° off the patient axes, more than {tol_deg:g}°); "
                          "this sample reads axis-aligned series only", DEOBLIQUE_HINT)
    return float(angles[worst])


def _check_no_tilt(files: list[Path], positions: np.ndarray, along: np.ndarray, normal: np.ndarray,
                   tol_deg: float = OBLIQUE_TOL_DEG) -> float:
    """The angle in degrees between the line the slice positions (sorted, ``along`` the normal) step along and the
    slice normal: the least-squares in-plane drift per mm along the normal, so that rounding in single positions
    averages out.

    Raises:
        SeriesError: the angle exceeds ``tol_deg``: a gantry-tilted (sheared) series, whose slices the reader would
            stack straight along the normal, shifting each one in-plane by its offset from the first."""
    inplane = positions - np.outer(along, normal)                    # each slice's position within its own plane
    drift = np.polyfit(along - along.mean(), inplane, 1)[0]          # mm in-plane per mm along the normal (3,)
    angle = float(np.degrees(np.arctan(np.linalg.norm(drift))))
    if angle > tol_deg:
        raise SeriesError(f"gantry-tilted series: the slice positions (ImagePositionPatient, {files[0]} to "
                          f"{files[-1].name}) step {angle:.2f}° off the slice normal, more than {tol_deg:g}°; this "
                          "sample reads axis-aligned series only", TILT_HINT)
    return angle


def _to_lps(hu: np.ndarray, axes_dir: tuple[np.ndarray, ...], spacing: tuple[float, float, float]
            ) -> tuple[np.ndarray, tuple[float, float, float]]:
    """``hu`` (3-D, array axis a running along unit patient vector ``axes_dir[a]``, ``spacing[a]`` mm apart)
    transposed and flipped so that its axes run along +z, +y, +x (LPS), with the spacing in that order: each array
    axis goes to the patient axis it lies closest to (``nibabel.orientations.io_orientation``, as
    ``as_closest_canonical`` does for NIfTI)."""
    from nibabel.orientations import apply_orientation, io_orientation

    direction = np.eye(4)
    direction[:3, :3] = np.column_stack(axes_dir)   # column a: where array axis a runs, in LPS
    ornt = io_orientation(direction)                # row a: (patient axis, +1 / -1) of array axis a
    xyz = apply_orientation(hu, ornt)               # axes now +x, +y, +z
    along = {int(p): float(spacing[a]) for a, (p, _) in enumerate(ornt)}
    return np.ascontiguousarray(xyz.transpose(2, 1, 0)), (along[2], along[1], along[0])


def _check_slice_gaps(files: list[Path], pos: np.ndarray, rtol: float) -> float:
    """The slice spacing in mm (the median gap); raises SeriesError for duplicate, missing or uneven slices."""
    if len(files) < 2:
        raise SeriesError(f"{files[0]}: a series of one slice is not a volume", "pass the whole series")
    gaps = np.diff(pos)
    for i, g in enumerate(gaps):
        if abs(g) < 1e-3:
            raise SeriesError(f"{files[i + 1]}: same slice position ({pos[i]:.3f} mm) as {files[i].name}",
                              "remove the duplicate slice (or the second series mixed in)")
    ref = float(np.median(gaps))
    tol = max(1e-2, rtol * ref)
    for i, g in enumerate(gaps):
        if abs(g - ref) <= tol:
            continue
        k = g / ref
        if round(k) >= 2 and abs(g - round(k) * ref) <= tol * round(k):
            raise SeriesError(f"missing slice: {int(round(k)) - 1} slice(s) missing between {files[i].name} "
                              f"(at {pos[i]:.2f} mm) and {files[i + 1]} (at {pos[i + 1]:.2f} mm); spacing is "
                              f"{ref:.3f} mm", "restore the missing files from the archive")
        raise SeriesError(f"inconsistent slice spacing: {files[i + 1]} is {g:.3f} mm from {files[i].name}, the "
                          f"series spacing is {ref:.3f} mm", "check ImagePositionPatient of that file, or resample "
                          "the series with a tool that handles variable spacing")
    return ref


TRUNCATED_HINT = "the file is truncated (an interrupted copy or download?): copy it again, or remove it from the folder"


def _truncated(path: Path) -> str | None:
    """Why the DICOM file is cut short, or None. pydicom reads a truncated file quietly up to the last whole element,
    so: bytes left over after the last element read, a value shorter than its declared length (pixel data cut), or a
    file that ends inside an element (pydicom's "No tag to read" / EOF errors)."""
    import pydicom

    size = Path(path).stat().st_size
    try:
        ds = pydicom.dcmread(path)
    except (EOFError, OSError) as e:
        return f"the file is truncated or corrupt ({size} bytes; pydicom: {e})"
    except Exception:
        return None
    if not len(ds):
        return None
    last = ds.get_item(list(ds.keys())[-1])
    tell, length = getattr(last, "value_tell", None), getattr(last, "length", None)
    if tell is None or length is None or length == 0xFFFFFFFF:
        return None
    short = _short_value(last)
    if short:
        return short
    if tell + length < size and "PixelData" not in ds:
        return (f"the file is truncated: it ends at byte {size} inside the header, before any pixel data "
                f"(the last whole element ends at byte {tell + length})")
    return None


def _short_value(elem) -> str | None:
    """"the file is truncated: …" when a raw element holds fewer bytes than its declared length, else None."""
    length, value = getattr(elem, "length", None), getattr(elem, "value", None)
    if length is None or length == 0xFFFFFFFF or not isinstance(value, (bytes, bytearray)) or len(value) >= length:
        return None
    what = "pixel data" if elem.tag == 0x7FE00010 else f"element {elem.tag}"
    return f"the file is truncated: its {what} has {len(value)} of {length} bytes"


def _read_hu(path: Path, slope: float, intercept: float) -> np.ndarray:
    """One slice in HU (stored value × ``slope`` + ``intercept``, from ``_slice_geometry``), float32 (rows, columns).
    Raises SeriesError for pixel data that cannot be decoded."""
    import pydicom

    ds = pydicom.dcmread(path)
    pix = ds.get_item("PixelData") if "PixelData" in ds else None
    cut = _truncated(path) if pix is None else _short_value(pix)  # (reading the file again only when it lacks pixels)
    if cut:
        raise SeriesError(f"{path}: {cut}", TRUNCATED_HINT)
    ts = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if ts is not None and ts.is_compressed:
        missing = _missing_decoder(ts)
        if missing is not None:
            raise SeriesError(f"{path}: pixel data is compressed ({ts.name}, {ts}) and no installed decoder can read "
                              f"it (needs one of: {missing})", DECODER_HINT)
    try:
        arr = ds.pixel_array
    except Exception as e:
        what = f"compressed ({ts.name}) " if ts is not None and ts.is_compressed else ""
        raise SeriesError(f"{path}: cannot decode {what}pixel data ({type(e).__name__}: {e})",
                          "the file may be truncated or corrupt") from e
    if arr.ndim != 2:
        raise SeriesError(f"{path}: pixel data has shape {arr.shape}, expected one 2-D slice",
                          "multi-frame (enhanced) CT is not supported by this reader")
    return arr.astype(np.float32) * np.float32(slope) + np.float32(intercept)


def _missing_decoder(ts) -> str | None:
    """None when pydicom has a usable decoder for transfer syntax ``ts``, else the plugins it would need."""
    try:
        from pydicom.pixels import get_decoder
    except ImportError:             # pydicom < 3: let pixel_array try
        return None
    try:
        dec = get_decoder(ts)
    except NotImplementedError:
        return "a decoder pydicom does not know"
    if dec.is_available:
        return None
    return "; ".join(dec.missing_dependencies) or "a pixel-data plugin"
