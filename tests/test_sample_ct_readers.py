"""samples/ct readers on edited copies of the real data: non-CT series, HU rescale and geometry tags that are missing,
non-finite or degenerate (each refused naming file and tag), patient positions other than head-first supine (read in
LPS index order), and NIfTI spacing from the affine, not pixdim. Found by a tester; each test failed before its fix."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from samples.ct.dicom import read_dicom_series
from samples.ct.nifti import read_nifti
from samples.ct.volume import SeriesError

REPO = Path(__file__).resolve().parents[1]
DICOM = "ct-chest-lung-pet-ct-dx-a0002"
NIFTI = "ct-totalsegmentator-example/example_ct.nii.gz"
NAMES = ("1-01", "1-02", "1-03", "1-04", "1-05", "1-06")   # z = 312 … 272 mm, 8 mm apart
MR_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.4"

pytestmark = [pytest.mark.filterwarnings("ignore:Invalid value for VR DS"),       # the NaN/inf tags written here
              pytest.mark.filterwarnings("ignore:pixdim\\[1,2,3\\] should be non-zero")]


def _copy(shared_data: Path, dst: Path, edit=None, only: str | None = None) -> Path:
    """Six real slices copied to ``dst``; ``edit(ds, name)`` applied to each (or to ``only``) and saved."""
    import pydicom

    dst.mkdir()
    for n in NAMES:
        shutil.copyfile(shared_data / DICOM / f"{n}.dcm", dst / f"{n}.dcm")
        if edit is not None and (only is None or n == only):
            ds = pydicom.dcmread(dst / f"{n}.dcm")
            edit(ds, n)
            ds.save_as(dst / f"{n}.dcm")
    return dst


def _set(**tags):
    def edit(ds, _name):
        for k, v in tags.items():
            if v is None:
                delattr(ds, k)
            else:
                setattr(ds, k, v)
    return edit


@pytest.fixture(scope="module")
def top6(shared_data, tmp_path_factory):
    """The six slices as read unedited (head-first supine): the reference every reoriented copy must match."""
    return read_dicom_series(_copy(shared_data, tmp_path_factory.mktemp("ref") / "s"))


# ---------------------------------------------------------------------------------------------- 1. not CT
def _mr(ds, _name):
    ds.Modality = "MR"
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = MR_IMAGE_STORAGE


def _sop(uid):
    def edit(ds, _name):
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = uid
    return edit


@pytest.mark.parametrize("edit, says", [
    (_mr, r"1-03\.dcm: Modality is 'MR', not 'CT': not CT image data"),
    (_set(Modality="PT"), r"1-03\.dcm: Modality is 'PT', not 'CT'"),
    (_set(Modality=None), r"1-03\.dcm: missing Modality, cannot tell that it is CT image data"),
    (_sop("1.2.840.10008.5.1.4.1.1.7"),        # Modality CT, but a secondary-capture screenshot
     r"1-03\.dcm: SOPClassUID 1\.2\.840\.10008\.5\.1\.4\.1\.1\.7 \(Secondary Capture Image Storage\) is not CT Image"),
    (_sop("1.2.840.10008.5.1.4.1.1.2.1"), r"1-03\.dcm: SOPClassUID .* \(Enhanced CT Image Storage\) is multi-frame"),
])
def test_a_file_that_is_not_ct_image_data_is_refused_naming_it(shared_data, tmp_path, edit, says):
    """An MR series was read as if it were CT (its values taken as HU)."""
    d = _copy(shared_data, tmp_path / "s", edit, only="1-03")
    with pytest.raises(SeriesError, match=says) as e:
        read_dicom_series(d)
    assert e.value.hint


def test_a_whole_mr_series_is_refused(shared_data, tmp_path):
    with pytest.raises(SeriesError, match=r"1-01\.dcm: Modality is 'MR'"):
        read_dicom_series(_copy(shared_data, tmp_path / "s", _mr))


# -------------------------------------------------------------------------------------------- 2. HU rescale
@pytest.mark.parametrize("edit, says", [
    (_set(RescaleSlope=None), r"1-03\.dcm: missing RescaleSlope, cannot convert stored values to HU"),
    (_set(RescaleIntercept=None), r"1-03\.dcm: missing RescaleIntercept, cannot convert stored values to HU"),
    (_set(RescaleSlope=0), r"1-03\.dcm: RescaleSlope is 0"),
    (_set(RescaleSlope="nan"), r"1-03\.dcm: RescaleSlope .*nan.* is not a finite number"),
    (_set(RescaleIntercept="-inf"), r"1-03\.dcm: RescaleIntercept .*inf.* is not a finite number"),
])
def test_a_missing_or_unusable_rescale_is_refused_naming_file_and_tag(shared_data, tmp_path, edit, says):
    """Both are Type 1 in the CT Image module: a missing intercept read air as 0 HU (not -1024), a zero or missing
    slope as 1."""
    d = _copy(shared_data, tmp_path / "s", edit, only="1-03")
    with pytest.raises(SeriesError, match=says) as e:
        read_dicom_series(d)
    assert e.value.hint


def test_a_per_slice_rescale_is_honoured(shared_data, tmp_path, top6):
    d = _copy(shared_data, tmp_path / "s", _set(RescaleSlope=2, RescaleIntercept=-2048), only="1-03")
    v = read_dicom_series(d)
    np.testing.assert_array_equal(v.hu[3], top6.hu[3] * 2)   # (stored − 1024) × 2; 1-03 is the 4th from the bottom
    np.testing.assert_array_equal(v.hu[[0, 1, 2, 4, 5]], top6.hu[[0, 1, 2, 4, 5]])


# ---------------------------------------------------------------------------------------------- 3. geometry
@pytest.mark.parametrize("edit, says", [
    (_set(ImagePositionPatient=["-173.17", "-294.17", "nan"]), r"ImagePositionPatient .* is not 3 finite numbers"),
    (_set(ImagePositionPatient=["-173.17", "inf", "296"]), r"ImagePositionPatient .* is not 3 finite numbers"),
    (_set(ImagePositionPatient=["-173.17", "-294.17"]), r"ImagePositionPatient .* is not 3 finite numbers"),
    (_set(PixelSpacing=[0, 0]), r"PixelSpacing .* is not positive"),
    (_set(PixelSpacing=[-0.65, -0.65]), r"PixelSpacing .* is not positive"),
    (_set(PixelSpacing=["nan", "0.65"]), r"PixelSpacing .* is not 2 finite numbers"),
    (_set(ImageOrientationPatient=[1, 0, 0, 0, "nan", 0]), r"ImageOrientationPatient .* is not 6 finite numbers"),
    (_set(ImageOrientationPatient=[0, 0, 0, 0, 0, 0]), r"ImageOrientationPatient .* is not two orthogonal unit"),
    (_set(ImageOrientationPatient=[1, 0, 0, 1, 0, 0]), r"ImageOrientationPatient .* is not two orthogonal unit"),
])
def test_unusable_slice_geometry_is_refused_naming_file_and_tag(shared_data, tmp_path, edit, says):
    """A NaN position raised a bare ValueError (cannot convert float NaN to integer); zero or negative PixelSpacing
    was returned as the volume's spacing."""
    d = _copy(shared_data, tmp_path / "s", edit, only="1-03")
    with pytest.raises(SeriesError, match=r"1-03\.dcm: " + says) as e:
        read_dicom_series(d)
    assert e.value.hint


# ------------------------------------------------------------------------------------- 4. patient position
def test_the_head_first_series_is_read_as_stored(series_files):
    """The real (head-first supine, IOP 1\\0\\0\\0\\1\\0) series is unchanged by the reorientation: slices by z
    ascending, rows and columns as stored."""
    import pydicom

    v = read_dicom_series(series_files[0].parent)
    stored = sorted(series_files, key=lambda f: float(pydicom.dcmread(f, stop_before_pixels=True)
                                                       .ImagePositionPatient[2]))
    assert stored[0].name == "1-30.dcm" and v.spacing_mm == pytest.approx((8.0, 0.646484375, 0.646484375))
    expect = np.stack([pydicom.dcmread(f).pixel_array.astype(np.float32) - 1024.0 for f in stored])
    np.testing.assert_array_equal(v.hu, expect)


@pytest.fixture(scope="module")
def series_files(shared_data) -> list[Path]:
    return sorted((shared_data / DICOM).glob("*.dcm"))


@pytest.mark.parametrize("orientation, flip", [
    ([-1, 0, 0, 0, 1, 0], (slice(None), slice(None), slice(None, None, -1))),       # feet first supine: normal −z
    ([1, 0, 0, 0, -1, 0], (slice(None), slice(None, None, -1), slice(None))),       # rows posterior → anterior
    ([-1, 0, 0, 0, -1, 0], (slice(None), slice(None, None, -1), slice(None, None, -1))),  # head first prone
])
def test_other_patient_positions_come_out_in_lps_index_order(shared_data, tmp_path, top6, orientation, flip):
    """Feet-first came out superior → inferior (slices sorted along a normal pointing to the feet) and columns left
    → right: the same pixels at the same positions, with the row/column directions reversed, must read as the
    head-first volume flipped in those axes."""
    d = _copy(shared_data, tmp_path / "s", _set(ImageOrientationPatient=orientation))
    v = read_dicom_series(d)
    np.testing.assert_array_equal(v.hu, top6.hu[flip])
    assert v.spacing_mm == top6.spacing_mm


def test_a_coronal_series_is_transposed_to_z_y_x(shared_data, tmp_path, top6):
    """Rows along −z (head at row 0), columns along +x, slices stepping 8 mm posterior: z comes from the rows."""
    def coronal(ds, _name):
        x, _y, z = (float(p) for p in ds.ImagePositionPatient)
        ds.ImageOrientationPatient = [1, 0, 0, 0, 0, -1]
        ds.ImagePositionPatient = [x, z, 100.0]                 # the slice's old z becomes its y
    v = read_dicom_series(_copy(shared_data, tmp_path / "s", coronal))
    np.testing.assert_array_equal(v.hu, top6.hu.transpose(1, 0, 2)[::-1])
    assert v.spacing_mm == pytest.approx((0.646484375, 8.0, 0.646484375))
    assert v.meta["acquired_spacing_mm"] == v.spacing_mm


def _rotated(degrees: float, axis: str):
    """ImageOrientationPatient and ImagePositionPatient rotated together by ``degrees`` about patient ``axis``
    (through the origin): the same pixels, in a grid turned rigidly, slices still stepping along their normal."""
    t = np.radians(degrees)
    c, s = np.cos(t), np.sin(t)
    rot = {"z": np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]]),
           "x": np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])}[axis]

    def edit(ds, _name):
        ds.ImageOrientationPatient = [f"{v:.10f}" for v in (*rot[:, 0], *rot[:, 1])]   # rotated (1,0,0), (0,1,0)
        ds.ImagePositionPatient = [f"{v:.6f}" for v in rot @ np.array([float(p) for p in ds.ImagePositionPatient])]
    return edit


@pytest.mark.parametrize("axis, says", [
    ("z", "[0.9397, 0.342, 0.0, -0.342, 0.9397, 0.0] is oblique (the row direction is 20.00°"),
    ("x", "[1.0, 0.0, 0.0, 0.0, 0.9397, 0.342] is oblique (the column direction is 20.00°"),
])
def test_an_oblique_series_is_refused_and_float_noise_is_not(shared_data, tmp_path, top6, axis, says):
    """Found by a user: a series whose ImageOrientationPatient was rotated 20° was read silently, snapped to the
    closest axes (the same array and spacing as the unrotated series). Beyond OBLIQUE_TOL_DEG (0.1°, as for NIfTI)
    it is refused; a 0.05° rotation still reads as the axis-aligned original."""
    d = _copy(shared_data, tmp_path / "s20", _rotated(20.0, axis))
    with pytest.raises(SeriesError) as e:
        read_dicom_series(d)
    assert str(e.value) == (f"{d / '1-01.dcm'}: ImageOrientationPatient {says} off the patient axes, more than "
                            "0.1°); this sample reads axis-aligned series only")
    assert "resample_to_output" in e.value.hint

    v = read_dicom_series(_copy(shared_data, tmp_path / "s005", _rotated(0.05, axis)))
    np.testing.assert_array_equal(v.hu, top6.hu)
    assert v.spacing_mm == pytest.approx(top6.spacing_mm, rel=1e-6)


def _tilted(degrees: float):
    """Axial slices whose positions drift anterior-posterior by tan(``degrees``) per mm of z, as a tilted gantry
    writes them (IOP unchanged)."""
    def edit(ds, _name):
        x, y, z = (float(p) for p in ds.ImagePositionPatient)
        ds.ImagePositionPatient = [x, f"{y + (z - 312.0) * np.tan(np.radians(degrees)):.6f}", z]
    return edit


def test_a_gantry_tilted_series_is_refused_and_float_noise_is_not(shared_data, tmp_path, top6):
    """A 15° gantry tilt was read silently as a straight stack (the same array: each slice shifted in y by up to
    10.7 mm over these 40 mm, 62 mm over the whole 232 mm series). Beyond 0.1° it is refused; 0.05° reads as is."""
    d = _copy(shared_data, tmp_path / "t15", _tilted(15.0))
    with pytest.raises(SeriesError) as e:
        read_dicom_series(d)
    assert str(e.value) == (f"gantry-tilted series: the slice positions (ImagePositionPatient, {d / '1-06.dcm'} to "
                            "1-01.dcm) step 15.00° off the slice normal, more than 0.1°; this sample reads "
                            "axis-aligned series only")
    assert "_Tilt" in e.value.hint

    v = read_dicom_series(_copy(shared_data, tmp_path / "t005", _tilted(0.05)))
    np.testing.assert_array_equal(v.hu, top6.hu)
    assert v.spacing_mm == top6.spacing_mm


# ------------------------------------------------------------------------------------------------- 5. NIfTI
def _canonical(shared_data):
    import nibabel as nib

    img = nib.as_closest_canonical(nib.load(str(shared_data / NIFTI)))
    return np.asarray(img.dataobj, dtype=np.float32), img.affine


@pytest.mark.parametrize("pixdim", [1.0, 0.0])
def test_nifti_spacing_comes_from_the_affine_not_pixdim(shared_data, tmp_path, pixdim):
    """sform says 1.5 × 2.5 × 4 mm, pixdim says 1 mm (or 0): the volume was read as 1 mm isotropic."""
    import nibabel as nib

    data, affine = _canonical(shared_data)
    aff = affine.copy()
    aff[:3, :3] = np.diag([1.5, 2.5, 4.0])
    img = nib.Nifti1Image(data, aff)
    img.header["pixdim"][1:4] = pixdim
    img.header.set_qform(None, code=0)
    img.header.set_sform(aff, code=1)
    nib.save(img, str(tmp_path / "v.nii.gz"))
    raw = gzip.open(tmp_path / "v.nii.gz").read(348)               # the file really says so (nibabel reads 0 as 1)
    assert np.frombuffer(raw[80:92], "<f4").tolist() == [pixdim] * 3  # pixdim[1:4], NIfTI-1 header bytes 80-91
    v = read_nifti(tmp_path / "v.nii.gz")
    assert v.spacing_mm == (4.0, 2.5, 1.5) and v.meta["acquired_spacing_mm"] == (4.0, 2.5, 1.5)
    np.testing.assert_array_equal(v.hu, read_nifti(shared_data / NIFTI).hu)


def test_a_nifti_affine_with_a_zero_voxel_size_is_refused(shared_data, tmp_path):
    import nibabel as nib

    hdr = nib.Nifti1Header()
    hdr.set_data_shape((8, 8, 8))
    hdr.set_data_dtype(np.float32)
    hdr.set_sform(np.diag([3.0, 3.0, 0.0, 1.0]), code=1)
    hdr.set_qform(None, code=0)
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), None, hdr), str(tmp_path / "z.nii.gz"))
    with pytest.raises(SeriesError, match=r"z\.nii\.gz: the NIfTI affine \(sform/qform\) gives voxel size "
                                          r"\[3\.0, 3\.0, 0\.0\] mm") as e:
        read_nifti(tmp_path / "z.nii.gz")
    assert e.value.hint


@pytest.mark.parametrize("degrees", [20.0, 0.5, 0.05])
def test_an_oblique_nifti_affine_is_refused_and_float_noise_is_not(shared_data, tmp_path, degrees):
    """Found by a user: an affine rotated 20° about z was read silently as axis-aligned (the same array, no flag).
    The pipeline only flips and transposes axes, so beyond OBLIQUE_TOL_DEG (0.1°) the volume is refused."""
    import nibabel as nib

    data, affine = _canonical(shared_data)
    t = np.radians(degrees)
    rot = np.array([[np.cos(t), -np.sin(t), 0.0], [np.sin(t), np.cos(t), 0.0], [0.0, 0.0, 1.0]])
    aff = affine.copy()
    aff[:3, :3] = rot @ affine[:3, :3]
    nib.save(nib.Nifti1Image(data, aff), str(tmp_path / "o.nii.gz"))
    if degrees > 0.1:                                   # samples.ct.nifti.OBLIQUE_TOL_DEG
        with pytest.raises(SeriesError) as e:
            read_nifti(tmp_path / "o.nii.gz")
        assert str(e.value) == (f"{tmp_path / 'o.nii.gz'}: the NIfTI affine is oblique (a voxel axis is "
                                f"{degrees:.2f}° off the patient axes, more than 0.1°); this sample reads "
                                "axis-aligned volumes only")
        assert "resample_to_output" in e.value.hint
    else:                                               # within tolerance: read as the axis-aligned original
        v = read_nifti(tmp_path / "o.nii.gz")
        assert v.spacing_mm == (3.0, 3.0, 3.0)
        np.testing.assert_array_equal(v.hu, read_nifti(shared_data / NIFTI).hu)


def test_a_nifti_affine_with_two_axes_along_one_is_refused(tmp_path):
    import nibabel as nib

    aff = np.array([[3.0, 3.0, 0, 0], [0, 0.001, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), aff), str(tmp_path / "d.nii.gz"))
    with pytest.raises(SeriesError, match=r"d\.nii\.gz: the NIfTI affine points two voxel axes along the same "
                                          r"patient axis") as e:
        read_nifti(tmp_path / "d.nii.gz")
    assert "set_sform" in e.value.hint


def test_a_complex_nifti_is_refused(shared_data, tmp_path):
    """The imaginary part was dropped with only a numpy ComplexWarning."""
    import nibabel as nib

    data, affine = _canonical(shared_data)
    nib.save(nib.Nifti1Image((data + 1j * data).astype(np.complex64), affine), str(tmp_path / "c.nii.gz"))
    with pytest.raises(SeriesError, match=r"c\.nii\.gz: NIfTI voxels are complex64 \(complex\), expected real HU"):
        read_nifti(tmp_path / "c.nii.gz")


# ------------------------------------------------------------------------------------------ the CLI's path
def test_evaluate_on_an_mr_series_ends_with_one_line(shared_data, tmp_path):
    """`samples.ct evaluate --volume <MR folder>` reads it through make_scans: error + hint, exit 2, no report."""
    d = _copy(shared_data, tmp_path / "mr", _mr)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "builds.json").write_text(json.dumps({"builds": [
        {"model": "student", "target": "cpu", "precision": "fp32", "ok": True, "bundle": "x.dse"}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "samples.ct", "evaluate", "--bundles", str(tmp_path / "b"), "--out",
                        str(tmp_path / "rep"), "--volume", str(d), "--timing-volume", ""],
                       cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"error: {d / '1-01.dcm'}: Modality is 'MR', not 'CT'" in p.stderr and "\nhint: " in p.stderr, p.stderr
    assert not (tmp_path / "rep").exists()


def test_a_damaged_dcm_file_is_named_not_reported_missing(shared_data, tmp_path):
    """A helper's pass on the samples: a slice overwritten with random bytes was skipped as a non-DICOM file and
    the series then failed as "missing slice … restore the missing files", never naming the damaged file; a note
    beside the slices (not named .dcm) is still skipped."""
    d = _copy(shared_data, tmp_path / "s")
    (d / "1-04.dcm").write_bytes(np.random.default_rng(0).bytes(4096))
    (d / "notes.txt").write_text("acquired 2019\n")
    with pytest.raises(SeriesError, match=r"1 file\(s\) named \.dcm in .* are not DICOM Part 10 files .* e\.g\. "
                                          r"1-04\.dcm") as e:
        read_dicom_series(d)
    assert "restore them" in e.value.hint
    (d / "1-04.dcm").unlink()
    shutil.copyfile(shared_data / DICOM / "1-04.dcm", d / "1-04.dcm")
    assert read_dicom_series(d).hu.shape[0] == 6  # the note is skipped
