"""Read one CT series of DICOM files into a ``Volume`` (pydicom), refusing malformed series with errors that name
the file.

Geometry follows DICOM PS3.3 C.7.6.2 (Image Plane Module): slices are ordered by the projection of
ImagePositionPatient on the slice normal (the cross product of the two ImageOrientationPatient direction cosines);
the slice spacing is taken from those positions, not from SliceThickness. HU = stored value × RescaleSlope +
RescaleIntercept (PS3.3 C.11.1.1.2).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .volume import SeriesError, Volume

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
        SeriesError: the directory does not exist or holds no DICOM file.
    """
    if isinstance(source, (str, os.PathLike)):
        d = Path(source)
        if not d.is_dir():
            raise SeriesError(f"DICOM series directory not found: {d}", "pass the folder holding the .dcm files")
        files = sorted(p for p in d.iterdir() if p.is_file() and _is_dicom(p))
        if not files:
            raise SeriesError(f"no DICOM files in {d}", "a DICOM file has 'DICM' at byte 128; check the folder")
        return files
    return [Path(p) for p in source]


def read_dicom_series(source: str | os.PathLike | Iterable[str | os.PathLike], *,
                      spacing_rtol: float = 0.01) -> Volume:
    """Read a single-series CT into HU.

    Args:
        source: a directory (every DICOM file in it must belong to the series) or a list of files.
        spacing_rtol: relative tolerance on the gap between consecutive slice positions.
    Returns:
        ``Volume`` with ``hu`` float32 (z, y, x) sorted inferior → superior along the slice normal, ``spacing_mm``
        (slice spacing from positions, PixelSpacing row, column) and ``meta`` (slice_thickness_mm, kvp,
        acquired_spacing_mm, series_uid, manufacturer).
    Raises:
        SeriesError: naming the offending file for: mixed SeriesInstanceUIDs, a file that is not CT image data,
            differing orientation / matrix size / pixel spacing, duplicate slice positions, missing slices (a gap that
            is a whole multiple of the spacing), inconsistent slice spacing, compressed pixel data without a decoder.
    """
    import pydicom

    files = list_series_files(source)
    headers = []
    for f in files:
        try:
            ds = pydicom.dcmread(f, stop_before_pixels=True)
        except Exception as e:  # pydicom raises several types for a broken file
            cut = _truncated(f)
            raise SeriesError(f"{f}: " + (cut or f"not a readable DICOM file ({e})"),
                              TRUNCATED_HINT if cut else "remove the file from the series folder") from e
        for tag in ("SeriesInstanceUID", "ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing", "Rows",
                    "Columns"):
            if tag not in ds:
                cut = _truncated(f)                 # pydicom stops quietly at a cut: say so, not "missing tag"
                if cut:
                    raise SeriesError(f"{f}: {cut}", TRUNCATED_HINT)
                raise SeriesError(f"{f}: missing {tag}, cannot place the slice in a volume",
                                  "only axial CT image slices can be read as a series")
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
    ref_orient = np.asarray(ref.ImageOrientationPatient, dtype=np.float64)
    for f, ds in zip(files, headers):
        if not np.allclose(np.asarray(ds.ImageOrientationPatient, dtype=np.float64), ref_orient, atol=1e-4):
            raise SeriesError(f"{f}: ImageOrientationPatient {list(ds.ImageOrientationPatient)} differs from "
                              f"{files[0].name}'s {list(ref.ImageOrientationPatient)}", "the slices must be parallel")
        if (int(ds.Rows), int(ds.Columns)) != (int(ref.Rows), int(ref.Columns)):
            raise SeriesError(f"{f}: matrix {ds.Rows}×{ds.Columns} differs from {files[0].name}'s "
                              f"{ref.Rows}×{ref.Columns}", "all slices of a series must have the same size")
        if not np.allclose([float(v) for v in ds.PixelSpacing], [float(v) for v in ref.PixelSpacing], rtol=1e-4):
            raise SeriesError(f"{f}: PixelSpacing {list(ds.PixelSpacing)} differs from {files[0].name}'s "
                              f"{list(ref.PixelSpacing)}", "all slices of a series must share one pixel spacing")

    normal = np.cross(ref_orient[:3], ref_orient[3:])
    pos = np.array([float(np.dot(np.asarray(ds.ImagePositionPatient, dtype=np.float64), normal)) for ds in headers])
    order = np.argsort(pos, kind="stable")
    files = [files[i] for i in order]
    headers = [headers[i] for i in order]
    pos = pos[order]

    dz = _check_slice_gaps(files, pos, spacing_rtol)

    slices = []
    for f in files:
        slices.append(_read_hu(f))
    hu = np.stack(slices).astype(np.float32, copy=False)
    dy, dx = (float(v) for v in ref.PixelSpacing)
    thickness = ref.get("SliceThickness")
    kvp = ref.get("KVP")
    meta = {
        "slice_thickness_mm": float(thickness) if thickness not in (None, "") else None,
        "kvp": float(kvp) if kvp not in (None, "") else None,
        "acquired_spacing_mm": (dz, dy, dx),
        "series_uid": str(ref.SeriesInstanceUID),
        "manufacturer": str(ref.get("Manufacturer", "")),
        "format": "dicom",
    }
    src = str(Path(files[0]).parent)
    return Volume(hu, (dz, dy, dx), meta, src)


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


def _read_hu(path: Path) -> np.ndarray:
    """One slice in HU, float32 (rows, columns). Raises SeriesError for pixel data that cannot be decoded."""
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
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    return arr.astype(np.float32) * slope + intercept


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
