"""samples/ct: readers on the real CT data, malformed-series errors, lesion insertion geometry, lung mask, NMS/FROC,
and the device pipeline on a cropped real volume through a bundle built by `dsedge build` (real ORT session)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from samples.ct.dicom import read_dicom_series
from samples.ct.froc import froc
from samples.ct.infer import (
    CELL, PATCH, gaussian_weights, lesion_probability, plan_batch, session_runner, sliding_window,
    sliding_window_stream, window_origins,
)
from samples.ct.lesions import Lesion, insert_lesions, lesion_alpha, sample_lesions
from samples.ct.nifti import read_nifti
from samples.ct.nms import Detection, detect, nms_3d
from samples.ct.preprocess import lung_mask, resample
from samples import data_path
from samples.ct.scans import cell_labels, make_scan, meta_vector, resolve_data_path
from samples.ct.volume import SeriesError, Volume

REPO = Path(__file__).resolve().parents[1]
DICOM = "ct-chest-lung-pet-ct-dx-a0002"
NIFTI = "ct-totalsegmentator-example/example_ct.nii.gz"


@pytest.fixture(scope="module")
def series(shared_data) -> Volume:
    return read_dicom_series(shared_data / DICOM)


@pytest.fixture(scope="module")
def nifti(shared_data) -> Volume:
    return read_nifti(shared_data / NIFTI)


# ------------------------------------------------------------------------------------------------------- readers
def test_dicom_series_shape_spacing_hu(series):
    assert series.shape == (30, 512, 512)
    assert series.spacing_mm == pytest.approx((8.0, 0.646484375, 0.646484375))
    assert series.hu.dtype == np.float32
    assert series.hu.min() == -1024.0 and series.hu.max() == 1548.0   # uint16 × 1 − 1024 (PROVENANCE.md)
    assert series.meta["slice_thickness_mm"] == 8.0 and series.meta["kvp"] == 120.0
    # sorted inferior → superior: first slice is the one at z = 80 mm (1-30.dcm), lungs: air-filled centre
    import pydicom
    last = pydicom.dcmread(Path(series.source) / "1-30.dcm")
    np.testing.assert_array_equal(series.hu[0], last.pixel_array.astype(np.float32) - 1024.0)
    assert -950 < float(np.median(series.hu[15, 200:300, 100:180])) < -600   # right-lung parenchyma


def test_nifti_orientation_and_hu(nifti, shared_data):
    import nibabel as nib

    raw = np.asarray(nib.load(shared_data / NIFTI).dataobj)     # (x, y, z), RAS
    assert nifti.shape == (112, 101, 122) and nifti.spacing_mm == (3.0, 3.0, 3.0)
    assert nifti.hu.min() == -1207.0 and nifti.hu.max() == 3382.0
    assert nifti.hu[5, 10, 20] == raw[121 - 20, 100 - 10, 5]          # flipped to DICOM's LPS index order
    assert nifti.meta["slice_thickness_mm"] is None and nifti.meta["kvp"] is None
    m = meta_vector(nifti.meta)
    assert m.tolist() == pytest.approx([0.6, 0.6, 0.0, 1.0, 0.0, 1.0])   # missing tags imputed 0 + flag


def test_nan_voxels_of_a_nifti_volume_become_air_and_a_slice_or_all_nan_one_is_refused(shared_data, tmp_path):
    import nibabel as nib

    img = nib.load(str(shared_data / NIFTI))
    data = np.asarray(img.dataobj, dtype=np.float32)
    data[:10, :, :] = np.nan  # outside the field of view, as some pipelines write it
    data[50, 50, 50] = np.inf
    nib.save(nib.Nifti1Image(data, img.affine), str(tmp_path / "nan.nii.gz"))
    vol = read_nifti(tmp_path / "nan.nii.gz")
    assert np.isfinite(vol.hu).all() and vol.meta["nonfinite_voxels"] == 10 * 101 * 112 + 1
    assert (vol.hu == -1024.0).sum() >= 10 * 101 * 112 + 1
    nib.save(nib.Nifti1Image(np.zeros((8, 8), np.float32), img.affine), str(tmp_path / "slice.nii.gz"))
    with pytest.raises(SeriesError, match="expected a 3-D volume") as e:  # one slice: not the 4-D series hint
        read_nifti(tmp_path / "slice.nii.gz")
    assert "single slice" in e.value.hint
    nib.save(nib.Nifti1Image(np.full((4, 4, 4), np.nan, np.float32), img.affine), str(tmp_path / "all.nii.gz"))
    with pytest.raises(SeriesError, match="every voxel is NaN") as e:
        read_nifti(tmp_path / "all.nii.gz")
    assert e.value.hint


def test_a_missing_volume_is_named_as_given(tmp_path, monkeypatch):
    from samples.ct.scans import read_volume

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SeriesError, match=r"no such CT volume: nope/scan\.nii\.gz \(nor .*nope/scan\.nii\.gz\)") as e:
        read_volume("nope/scan.nii.gz")
    assert e.value.hint


def test_lung_mask_keeps_lungs_and_drops_bowel_gas(series, nifti):
    chest = resample(series, 4.0)
    lungs_l = lung_mask(chest).sum() * 64 / 1e6
    assert 2.0 < lungs_l < 6.0                               # adult lungs, litres
    m = lung_mask(nifti)                                     # abdomen: only the lung bases at the top are lung
    z = np.flatnonzero(m.any(axis=(1, 2)))
    assert z.min() >= 95 and m.sum() * 27 / 1e3 > 50        # ml; stomach/colon gas (z 55-100) excluded


def test_resample_keeps_mm_positions(series):
    r = resample(series, 2.0)
    assert r.spacing_mm == (2.0, 2.0, 2.0) and r.shape == (117, 166, 166)
    # voxel (z, y, x) of the output samples mm (2z, 2y, 2x) of the input
    assert r.hu[4, 50, 60] == pytest.approx(_trilinear(series, (8.0, 100.0, 120.0)), abs=0.05)
    assert r.hu[5, 50, 60] == pytest.approx(_trilinear(series, (10.0, 100.0, 120.0)), abs=0.05)


def _trilinear(v: Volume, mm: tuple[float, float, float]) -> float:
    from scipy.ndimage import map_coordinates

    return float(map_coordinates(v.hu, np.array(mm)[:, None] / np.array(v.spacing_mm)[:, None], order=1)[0])


# ----------------------------------------------------------------------------------------------- malformed series
def _copy_series(src: Path, dst: Path, names=("1-01", "1-02", "1-03", "1-04", "1-05", "1-06")) -> Path:
    dst.mkdir()
    for n in names:
        shutil.copyfile(src / f"{n}.dcm", dst / f"{n}.dcm")
    return dst


def test_good_partial_series_reads(shared_data, tmp_path):
    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    (d / "notes.txt").write_text("not a dicom file")             # non-DICOM files are skipped
    v = read_dicom_series(d)
    assert v.shape == (6, 512, 512) and v.spacing_mm[0] == pytest.approx(8.0)


def test_mixed_series_uid_names_file(shared_data, tmp_path):
    import pydicom

    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    ds = pydicom.dcmread(d / "1-04.dcm")
    ds.SeriesInstanceUID = "1.2.3.4.5"
    ds.save_as(d / "1-04.dcm")
    with pytest.raises(SeriesError, match=r"mixed series: .*1-04\.dcm has SeriesInstanceUID 1\.2\.3\.4\.5") as e:
        read_dicom_series(d)
    assert e.value.hint


def test_missing_slice_names_neighbours(shared_data, tmp_path):
    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    (d / "1-03.dcm").unlink()                                     # z = 296 mm, between 1-04 (288) and 1-02 (304)
    with pytest.raises(SeriesError, match=r"missing slice: 1 slice\(s\) missing between 1-04\.dcm .*1-02\.dcm"):
        read_dicom_series(d)


def test_inconsistent_spacing_names_file(shared_data, tmp_path):
    import pydicom

    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    ds = pydicom.dcmread(d / "1-03.dcm")
    ds.ImagePositionPatient = [ds.ImagePositionPatient[0], ds.ImagePositionPatient[1], 299.0]
    ds.save_as(d / "1-03.dcm")
    with pytest.raises(SeriesError, match=r"inconsistent slice spacing: .*1-03\.dcm is 11\.000 mm from 1-04\.dcm"):
        read_dicom_series(d)


def test_compressed_without_decoder_names_file(shared_data, tmp_path):
    import pydicom
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGLSLossless

    if get_decoder(JPEGLSLossless).is_available:
        pytest.skip("a JPEG-LS decoder is installed here; the no-decoder path cannot be shown")
    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    ds = pydicom.dcmread(d / "1-05.dcm")
    ds.file_meta.TransferSyntaxUID = JPEGLSLossless
    ds.PixelData = encapsulate([b"\xff\xd8" + b"\x00" * 64 + b"\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.save_as(d / "1-05.dcm", enforce_file_format=True)
    with pytest.raises(SeriesError, match=r"1-05\.dcm: pixel data is compressed \(JPEG-LS Lossless.*no installed "
                                          r"decoder") as e:
        read_dicom_series(d)
    assert "pylibjpeg" in e.value.hint


@pytest.mark.parametrize("keep, says", [
    (2000, r"it ends at byte 2000 inside the header, before any pixel data"),       # cut inside the header
    (3000, r"it ends at byte 3000 inside the header, before any pixel data"),       # header whole, pixels gone
    (200000, r"its pixel data has 196992 of 524288 bytes"),                      # cut inside the pixels
])
def test_truncated_file_says_truncated(shared_data, tmp_path, keep, says):
    d = _copy_series(shared_data / DICOM, tmp_path / "s")
    (d / "1-03.dcm").write_bytes((shared_data / DICOM / "1-03.dcm").read_bytes()[:keep])
    with pytest.raises(SeriesError, match=r"1-03\.dcm: the file is truncated: " + says) as e:
        read_dicom_series(d)
    assert "truncated" in e.value.hint and "missing" not in str(e.value)


def test_not_a_series_directory(tmp_path):
    with pytest.raises(SeriesError, match="no DICOM files in"):
        read_dicom_series(tmp_path)


def test_evaluate_without_a_build_names_the_missing_file(tmp_path):
    """No training, no build: evaluate stops before reading any volume, with one line and the step to run."""
    import os

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "samples.ct", "evaluate", "--volume", "no-such-volume"],
                       cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "error: runs/bundles/builds.json: no such file" in p.stderr
    assert "hint: run `python -m samples.ct build` first" in p.stderr


def _ct_build(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    import os

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "samples.ct", "build", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def test_build_without_the_runs_stops_at_once_with_one_line(tmp_path):
    """Found by a user: `build --runs NOPE` tried every build, each failed, and it exited 0."""
    out = tmp_path / "bundles"
    p = _ct_build(tmp_path, "--runs", str(tmp_path / "nope"), "--out", str(out))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"error: --runs {tmp_path / 'nope'}: no such directory" in p.stderr, p.stderr
    assert "hint: run `python -m samples.ct train` first" in p.stderr
    assert not out.exists() and "$ dsedge build" not in p.stderr  # stopped before the inputs and the builds
    (tmp_path / "runs" / "ct-teacher").mkdir(parents=True)
    p = _ct_build(tmp_path, "--runs", "runs", "--out", str(out))
    assert p.returncode == 2 and "error: no such run directory: runs/ct-student\n" in p.stderr, p.stderr
    assert not out.exists()


def test_build_exits_non_zero_naming_the_builds_that_failed(tmp_path):
    """Run directories that hold no run: every dsedge build fails; builds.json still records each error."""
    runs, out = tmp_path / "runs", tmp_path / "bundles"
    for model in ("teacher", "student"):
        (runs / f"ct-{model}").mkdir(parents=True)
    p = _ct_build(Path(__file__).resolve().parents[1], "--runs", str(runs), "--out", str(out))  # the CT data paths
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert ("error: 6 of 6 builds failed: teacher cpu fp32, student cpu fp32, student cpu int8, student cpu auto, "
            "student jetson fp16, student jetson int8\n") in p.stderr, p.stderr
    builds = json.loads((out / "builds.json").read_text())["builds"]
    assert len(builds) == 6 and not any(b["ok"] for b in builds)
    assert all("not a Hugging Face model or a dsedge training run" in b["error"] for b in builds)


# ------------------------------------------------------------------------------------------ lesion insertion
def _phantom(spacing=(2.0, 2.0, 2.0), thickness=None) -> tuple[Volume, np.ndarray]:
    """A 'lung' ball of -850 HU (r = 50 mm) in soft tissue (40 HU), 120 mm cube."""
    n = [int(120 / s) for s in spacing]
    g = np.meshgrid(*[np.arange(k) * s - 60 for k, s in zip(n, spacing)], indexing="ij")
    r = np.sqrt(sum(x ** 2 for x in g))
    hu = np.where(r < 50, -850.0, 40.0).astype(np.float32)
    return Volume(hu, spacing, {"slice_thickness_mm": thickness}), r < 50


def test_lesions_lie_inside_mask_apart_and_in_size_range():
    vol, mask = _phantom()
    les = sample_lesions(mask, vol.spacing_mm, 6, np.random.default_rng(3))
    assert len(les) == 6
    for a in les:
        assert 4.0 - 1e-6 <= a.diameter_mm <= 30.0 + 1e-6
        box, alpha = lesion_alpha(vol.shape, vol.spacing_mm, a)
        assert mask[box][alpha > 0.5].all()                   # the whole lesion is in the lung mask
        for b in les:
            if a is not b:
                gap = np.linalg.norm(np.subtract(a.center_mm, b.center_mm))
                assert gap >= a.max_radius_mm + b.max_radius_mm + 5.0 - 1e-6


def test_insertion_geometry_and_hu():
    vol, _ = _phantom()
    eye = np.eye(3).tolist()
    les = Lesion((60.0, 60.0, 60.0), (10.0, 6.0, 4.0), eye, hu=30.0, kind="solid", edge_mm=0.5, noise_hu=0.0)
    out = insert_lesions(vol, [les], np.random.default_rng(0))
    inside = (out.hu > -410) & (vol.hu < 0)                     # half-way between -850 and 30 HU, in the lung
    z, y, x = np.nonzero(inside)
    # extents along the axes match the semi-axes (2 mm voxels: ±1 voxel)
    assert (z.max() - z.min() + 1) * 2 == pytest.approx(20, abs=2.5)
    assert (y.max() - y.min() + 1) * 2 == pytest.approx(12, abs=2.5)
    assert (x.max() - x.min() + 1) * 2 == pytest.approx(8, abs=2.5)
    assert out.hu[30, 30, 30] == pytest.approx(30.0, abs=1.0)
    far = np.ones(vol.shape, bool)
    far[15:46, 15:46, 15:46] = False
    np.testing.assert_array_equal(out.hu[far], vol.hu[far])      # nothing changes away from the lesion
    assert out.meta["lesions"][0]["diameter_mm"] == pytest.approx(2 * (240) ** (1 / 3), abs=0.01)


def test_thick_slices_blur_small_lesions():
    """Partial volume: a 4 mm lesion on an 8 mm slice reaches only part of its HU; on 2 mm slices all of it."""
    les = Lesion((60.0, 60.0, 60.0), (2.0, 2.0, 2.0), np.eye(3).tolist(), 30.0, "solid", 0.5, 0.0)
    thin = lesion_alpha((60, 60, 60), (2.0, 2.0, 2.0), les)[1].max()
    thick = lesion_alpha((15, 60, 60), (8.0, 2.0, 2.0), les, slice_thickness_mm=8.0)[1].max()
    assert thin > 0.9 and 0.2 < thick < 0.7


def test_cell_labels_mark_lesion_cells():
    les = Lesion((31.0, 41.0, 51.0), (3.0, 3.0, 3.0), np.eye(3).tolist(), 30.0, "solid", 0.5, 0.0)
    lab = cell_labels((40, 40, 40), (2.0, 2.0, 2.0), [les])
    assert lab.shape == (20, 20, 20)
    assert lab[7, 10, 12] == 1                                   # the cell holding the centre (31/4, 41/4, 51/4)
    assert lab.sum() <= 8 and lab[0, 0, 0] == 0


# ------------------------------------------------------------------------------------------ NMS and FROC
def test_nms_3d_suppresses_overlaps_only():
    a = Detection((10.0, 10.0, 10.0), 5.0, 0.9)
    b = Detection((11.0, 10.0, 10.0), 5.0, 0.8)                  # IoU ≈ 0.82 with a
    c = Detection((40.0, 10.0, 10.0), 5.0, 0.7)
    assert nms_3d([c, b, a]) == [a, c]


def test_froc_counts_hits_and_false_positives():
    les = [Lesion((10.0, 10.0, 10.0), (3.0, 3.0, 3.0), np.eye(3).tolist(), 0, "solid", 1, 0),
           Lesion((50.0, 50.0, 50.0), (8.0, 8.0, 8.0), np.eye(3).tolist(), 0, "solid", 1, 0)]
    dets = [Detection((11.0, 10.0, 12.0), 3, 0.9),                # hit lesion 0 (within 5 mm floor)
            Detection((90.0, 90.0, 90.0), 3, 0.8),                # FP
            Detection((12.0, 11.0, 11.0), 3, 0.7),                # second hit on lesion 0: neither TP nor FP
            Detection((56.0, 50.0, 50.0), 3, 0.6)]                # hit lesion 1 (within its 8 mm radius)
    f = froc([dets, []], [les, []], fp_rates=(0.25, 0.5, 1.0))
    assert f["sensitivity"] == [0.0, 0.5, 0.5, 0.5, 1.0]
    assert f["fps_per_scan"] == [0.0, 0.0, 0.5, 0.5, 0.5]
    assert f["sensitivity_at"] == {"0.25": 0.5, "0.5": 1.0, "1": 1.0}


# ------------------------------------------------------------------------------- pipeline on a cropped volume
@pytest.fixture(scope="module")
def scan(series):
    return make_scan(series.crop((8, 120, 40), (16, 256, 256)), 3, seed=7)


def test_scan_on_cropped_volume(scan):
    assert scan.image.shape == (61, 83, 83) and 0.0 <= scan.image.min() and scan.image.max() <= 1.0
    assert len(scan.lesions) == 3 and scan.mask.sum() * 8 / 1000 > 100           # ml of lung in the crop
    assert scan.cell_labels.shape == (31, 42, 42) and scan.cell_labels.sum() >= 3
    for les in scan.lesions:                                   # the lesion is in the image: denser than lung
        z, y, x = (int(round(c / 2)) for c in les.center_mm)
        assert scan.image[z, y, x] > 0.35                       # > -510 HU in the lung window


def test_oracle_windows_find_every_lesion(scan):
    """Feeding the windows their true cell labels as logits, stitching + NMS + FROC find all lesions, no FP."""
    origins, padded = window_origins(scan.image.shape, scan.mask)
    labels = np.zeros(tuple(p // CELL for p in padded), np.float32)
    labels[tuple(slice(0, n) for n in scan.cell_labels.shape)] = scan.cell_labels
    it = iter(origins)

    def oracle(patches, meta):
        out = []
        for _ in range(len(patches)):
            c = next(it) // CELL
            lab = labels[c[0]:c[0] + 16, c[1]:c[1] + 16, c[2]:c[2] + 16].reshape(-1)
            out.append(np.stack([np.zeros_like(lab), np.where(lab > 0, 8.0, -8.0)], -1))
        return np.stack(out)

    prob, stats = sliding_window(oracle, scan.image, scan.mask, scan.meta, batch_size=5)
    assert stats["windows"] == len(origins) < stats["windows_total"]
    dets = detect(prob, scan.spacing_mm, scan.mask, threshold=0.5)
    f = froc([dets], [scan.lesions], fp_rates=(1.0,))
    assert f["sensitivity_at"]["1"] == 1.0 and f["fps_per_scan_total"] == 0.0


def test_gaussian_weights_and_probability():
    w = gaussian_weights()
    assert w.shape == (16, 16, 16) and w.max() == pytest.approx(1.0) and w[0, 0, 0] < 0.01
    p = lesion_probability(np.array([[0.0, 0.0], [0.0, 50.0], [50.0, 0.0]], np.float32))
    np.testing.assert_allclose(p, [0.5, 1.0, 0.0], atol=1e-6)


@pytest.fixture(scope="module")
def student_bundle(tmp_path_factory) -> Path:
    """The seed-0 untrained student built by the real CLI: dsedge build --model samples.ct.model:student_source."""
    out = tmp_path_factory.mktemp("ct-bundle")
    p = subprocess.run([sys.executable, "-m", "dsedge", "build", "--model", "samples.ct.model:student_source",
                        "--target", "cpu", "--precision", "fp32", "--out", str(out), "--threads", "2"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return next(out.glob("*.dse"))


@pytest.mark.slow
def test_bundle_sliding_window_matches_torch_and_reports(student_bundle, scan, tmp_path, monkeypatch):
    import dsedge
    import torch

    from samples.ct.model import student_source
    from samples.ct.report import write_json, write_png
    from samples.ct.torch_baseline import torch_runner

    with dsedge.load(student_bundle, threads=2) as s:
        assert [i.name for i in s.inputs] == ["patch", "meta"] and len(s.outputs) == 1
        run = session_runner(s)
        plan = plan_batch(run, budget_ms=1e4, candidates=(1, 4))
        assert plan.batch_size == 4 and plan.within_budget and set(plan.latency_ms) == {1, 4}
        tight = plan_batch(run, budget_ms=1e-3, candidates=(1, 4))
        assert tight.batch_size == 1 and not tight.within_budget and set(tight.latency_ms) == {1}
        prob, stats = sliding_window(run, scan.image, scan.mask, scan.meta, batch_size=4)
        sprob, sstats = sliding_window_stream(s, scan.image, scan.mask, scan.meta, budget_ms=5e3)
    torch.manual_seed(123)                                      # student_source's weights do not depend on it
    tprob, tstats = sliding_window(torch_runner(student_source()[0], threads=2), scan.image, scan.mask, scan.meta, 4)
    assert prob.shape == scan.cell_labels.shape
    np.testing.assert_allclose(prob, tprob, atol=1e-4)
    np.testing.assert_allclose(sprob, prob, atol=1e-5)
    assert stats["windows"] == tstats["windows"] == sstats["windows"] and stats["batches"] == -(-stats["windows"] // 4)
    assert sstats["rejected"] == 0 and sstats["mode"] == "stream"

    dets = detect(prob, scan.spacing_mm, scan.mask)
    f = froc([dets], [scan.lesions])
    j = write_json(tmp_path / "r" / "report.json", {"froc": f, "timing": stats})
    body = json.loads(j.read_text())
    assert body["schema"] == "dsedge.sample-ct-report/1" and body["froc"]["lesions"] == 3
    png = write_png(tmp_path / "r" / "report.png", scan, dets, {"untrained student": f})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the images' licences ask for attribution where results made from them are shown (a helper's pass): the
    # sample's figure carries the credit line, and report.json the sources (samples/ct/__main__.py)
    import matplotlib.figure

    from samples.ct.__main__ import CREDIT, SOURCES

    seen, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (seen.append([t.get_text() for t in fig.texts]), save(fig, *a, **k))[1])
    write_png(tmp_path / "r" / "credited.png", scan, dets, {"untrained student": f}, credit=CREDIT)
    assert CREDIT in seen[0] and "10.7937/TCIA.2020.NNC2-0461" in CREDIT
    assert [s["licence"].split(" ")[0] for s in SOURCES] == ["CC", "Apache-2.0"]


@pytest.mark.slow
def test_evaluate_warms_up_alternates_and_times_the_same_work(student_bundle, scan, tmp_path, monkeypatch):
    """Found by a user: held-out scans were timed once with no warm-up, always in the same model order (torch right
    after a bundle or the reverse), with detection time added in. Now: one untimed pass per model, then rounds in
    alternating order, the median of the sliding window alone."""
    from safetensors.torch import save_file

    import samples.ct.evaluate as ev
    from samples.ct.model import student_source

    run = tmp_path / "run" / "final"                    # a finished "dsedge train" run of the bundle's own model
    run.mkdir(parents=True)
    (run / "model.json").write_text(json.dumps({"factory": "samples.ct.model:make_student", "kwargs": {}}))
    save_file({k: v.contiguous() for k, v in student_source()[0].state_dict().items()}, str(run / "model.safetensors"))
    calls = []                                          # (runner, timed seconds) in call order

    def recorded(run_batch, *a, **k):
        prob, st = sliding_window(run_batch, *a, **k)
        calls.append((run_batch, st["seconds"]))
        return prob, st

    monkeypatch.setattr(ev, "sliding_window", recorded)
    entries = [ev.ModelEntry("bundle", "bundle", str(student_bundle)),
               ev.ModelEntry("torch", "torch", str(tmp_path / "run"), batch_from="bundle")]
    models = ev.evaluate(entries, [scan, scan], threads=2, repeats=2,
                         batch_sizes={"bundle": 8, "torch": 8})["models"]
    name = {calls[0][0]: "bundle", calls[1][0]: "torch"}  # the warm-up runs the entries in list order
    assert [name[r] for r, _ in calls] == (["bundle", "torch"]                       # warm-up, untimed
                                           + ["bundle", "torch", "torch", "bundle"] * 2)  # scan 1, scan 2: alternating
    for e, m in models.items():
        timed = [t for r, t in calls[2:] if name[r] == e]
        assert [t for st in m["per_scan"] for t in st["seconds_passes"]] == timed and m["timed_passes"] == 4
        # the median of the sliding-window passes alone: detection is timed apart and not added in
        assert m["volume_seconds_median"] == round(float(np.median(timed)), 4)
        assert m["per_scan"][0]["seconds"] == round(float(np.median(timed[:2])), 4)
        assert m["detect_seconds_median"] > 0 and "detection excluded" in m["timing"]
        assert m["froc"]["lesions"] == 6                   # detections of both scans scored once each
    assert models["bundle"]["froc"]["cpm"] == models["torch"]["froc"]["cpm"]  # same model: same detections
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        ev.evaluate(entries[:1], [scan], repeats=0)


@pytest.mark.parametrize("args, quiet, every", [((), False, 30.0), (("-q", "--every", "5"), True, 5.0)])
def test_train_follows_each_runs_log_for_progress_lines(monkeypatch, args, quiet, every):
    """Found by a user: `python -m samples.ct train` captured dsedge's output and printed nothing for minutes. Each
    command now runs with progress lines from its run's metrics.jsonl (samples.progress; tested on a real training
    in test_sample_fraud.py); -q turns them off. The commands are recorded here, not run (minutes each)."""
    from click.testing import CliRunner

    import samples.progress
    from samples.ct.__main__ import main

    calls = []
    monkeypatch.setattr(samples.progress, "run_training", lambda cmd, metrics, steps, label, **kw:
                        calls.append((cmd[3:], metrics, steps, label, kw)) or 0)
    r = CliRunner().invoke(main, ["train", *args])
    assert r.exit_code == 0, r.output
    here = REPO / "samples" / "ct"
    assert calls == [
        (["train", "-q", str(here / "teacher.toml")], Path("runs/ct-teacher/metrics.jsonl"), 240, "teacher",
         {"interval_s": every, "quiet": quiet}),
        (["distill", "-q", str(here / "student.toml")], Path("runs/ct-student/metrics.jsonl"), 160, "student",
         {"interval_s": every, "quiet": quiet})]


def test_device_side_modules_import_without_torch():
    """Reading, preprocessing, sliding window, NMS and FROC run where torch is absent (a Jetson image)."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import samples.ct.dicom, samples.ct.nifti, samples.ct.scans, samples.ct.infer, samples.ct.nms, "
            "samples.ct.froc, samples.ct.report, dsedge\n"
            "print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-1000:]


# ------------------------------------------------------------------------- evaluate / plateau: user mistakes
def _ct(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "samples.ct", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def _evaluate(tmp_path: Path, builds: object, shared_data: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "b").mkdir(exist_ok=True)
    (tmp_path / "b" / "builds.json").write_text(builds if isinstance(builds, str) else json.dumps(builds))
    return _ct(REPO, "evaluate", "--bundles", str(tmp_path / "b"), "--out", str(tmp_path / "rep"),
               "--volume", str(shared_data / NIFTI), "--timing-volume", "", *args)


def _refused_before_writing(p, tmp_path, error: str, hint: str) -> None:
    """``evaluate`` ended with a one-line error and hint (exit 2, no traceback) and wrote no report."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert error in p.stderr and hint in p.stderr, p.stderr
    assert not (tmp_path / "rep").exists()


def test_evaluate_without_a_successful_build_refuses_before_writing(tmp_path, shared_data):
    """Found by a user: every build failed, evaluate crashed (StopIteration) after writing a report.json."""
    builds = {"builds": [{"model": "student", "target": "cpu", "precision": "fp32", "ok": False, "error": "x"},
                         {"model": "student", "target": "cpu", "precision": "auto", "ok": True, "bundle": "a.dse"}]}
    _refused_before_writing(_evaluate(tmp_path, builds, shared_data), tmp_path,
                            f"error: no bundle built; see {tmp_path / 'b' / 'builds.json'}",
                            "hint: fix the errors recorded there")


@pytest.mark.parametrize("content, says", [
    ('{"builds": [{"model": "student"}]}', "builds[0] has no 'target'"),
    ('{"builds": [{"model": "student", "target": "cpu", "precision": "fp32"}]}', "builds[0] has no 'ok'"),
    ('{"builds": [{"model": "student", "target": "cpu", "precision": "fp32", "ok": true}]}',
     "builds[0] is ok but names no 'bundle'"),
    ('"hello"', "not a builds file"),
    ('{"builds": 3}', "not a builds file"),
    ('[1]', "builds[0] is a int, not an object"),
])
def test_evaluate_names_a_builds_json_out_of_shape(tmp_path, shared_data, content, says):
    _refused_before_writing(_evaluate(tmp_path, content, shared_data), tmp_path,
                            f"error: {tmp_path / 'b' / 'builds.json'}: {says}",
                            "hint: run `python -m samples.ct build` again")


@pytest.mark.parametrize("args, option", [
    (("--scans", "0"), "--scans"), (("--scans", "-1"), "--scans"), (("--lesions", "-1"), "--lesions"),
    (("--budget-ms", "-5"), "--budget-ms"), (("--budget-ms", "0"), "--budget-ms"), (("--threads", "0"), "--threads"),
])
def test_evaluate_refuses_bad_numbers_up_front(tmp_path, shared_data, args, option):
    """`--scans 0` divided by zero after the models ran; `--budget-ms -5` was taken."""
    ok = {"builds": [{"model": "student", "target": "cpu", "precision": "fp32", "ok": True, "bundle": "x.dse"}]}
    p = _evaluate(tmp_path, ok, shared_data, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"Error: Invalid value for '{option}'" in p.stderr, p.stderr
    assert not (tmp_path / "rep").exists()


def test_froc_without_lesions_leaves_sensitivity_undefined():
    f = froc([[Detection((1.0, 2.0, 3.0), 3, 0.9)], []], [[], []], fp_rates=(1.0,))
    assert f["sensitivity_at"] == {"1": None} and f["cpm"] is None and f["max_sensitivity"] is None
    assert f["sensitivity"] == [None, None] and f["fps_per_scan"] == [0.0, 0.5] and f["lesions"] == 0


def test_evaluate_with_no_lesions_times_and_reports_sensitivity_na(tmp_path, shared_data, student_bundle):
    """`--lesions 0` crashed in write_png (one Axes) after report.json was written; now a timing-only report."""
    builds = {"builds": [{"model": "student", "target": "jetson", "precision": "fp16", "ok": True,
                          "bundle": str(student_bundle)}]}              # no torch baseline: no run dir needed
    p = _evaluate(tmp_path, builds, shared_data, "--scans", "1", "--lesions", "0")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["data"]["lesions"] == 0
    row = rep["summary"]["models"]["student jetson fp16"]
    assert row["cpm"] is None and set(row["sensitivity_at"].values()) == {None} and row["volume_seconds"] > 0
    assert rep["summary"]["chosen_precision"] == {}
    assert (tmp_path / "rep" / "report.png").stat().st_size > 1000
    assert sorted(x.name for x in (tmp_path / "rep").iterdir()) == ["report.json", "report.png"]


@pytest.mark.parametrize("args, option", [
    (("--seeds", "x"), "--seeds"), (("--seeds", "0,,1"), "--seeds"), (("--seeds", "0,-1"), "--seeds"),
    (("--seeds", "1,1"), "--seeds"), (("--steps", "0"), "--steps"), (("--every", "0"), "--every"),
    (("--scans", "0"), "--scans"), (("--lesions", "0"), "--lesions"),
])
def test_plateau_refuses_bad_options_before_reading_the_volume(tmp_path, args, option):
    """`--seeds x` raised ValueError after reading the volume; `--steps 0` a RuntimeError from dsedge train."""
    p = _ct(REPO, "plateau", "--out", str(tmp_path / "pl"), "--volume", str(tmp_path / "no-such-volume"), *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"Error: Invalid value for '{option}'" in p.stderr, p.stderr
    assert not (tmp_path / "pl").exists()


def test_the_samples_data_defaults_follow_dsedge_data(tmp_path, monkeypatch):
    """The samples' defaults and configs name ``../shared/data/…``; with ``$DSEDGE_DATA`` set (the tests' rule, and
    the README's) they are read from there, so a checkout without ``../shared`` beside it runs them. They were not:
    ``samples.ct build`` in such a checkout failed on the CT volume whatever DSEDGE_DATA said."""
    (tmp_path / "ct-x").mkdir()
    monkeypatch.setenv("DSEDGE_DATA", str(tmp_path))
    assert resolve_data_path("../shared/data/ct-x") == tmp_path / "ct-x"
    assert data_path("../shared/data/fraud/f.csv") == tmp_path / "fraud" / "f.csv"
    assert data_path("runs/ct-student") == Path("runs/ct-student")  # not under ../shared/data: as given
    assert data_path("/abs/x.nii") == Path("/abs/x.nii")
    monkeypatch.delenv("DSEDGE_DATA")
    assert data_path("../shared/data/ct-x") == Path("../shared/data/ct-x")
