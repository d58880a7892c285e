"""Bundle format: atomic writes, manifest round trip, hash verification."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsedge.runtime.bundle import Manifest, atomic_directory, read_manifest, verify_bundle
from dsedge.runtime.errors import BundleError, BundleIntegrityError
from tiny_models import tiny_bundle


@pytest.fixture
def bundle(tmp_path):
    return tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path)


def test_written_bundle_verifies_and_lists_every_file(bundle):
    m = verify_bundle(bundle)
    assert set(m.files) == {"models/fp32.onnx"}
    assert m.variant().name == "fp32" and m.variant().size_bytes == (bundle / "models/fp32.onnx").stat().st_size
    assert m.inputs[0].shape == ("batch", 64)
    again = Manifest.from_dict(json.loads((bundle / "manifest.json").read_text()))
    assert again.to_dict() == m.to_dict()


def test_tampered_file_is_refused(bundle):
    p = bundle / "models/fp32.onnx"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(BundleIntegrityError, match="corrupt or was modified"):
        verify_bundle(bundle)


def test_truncated_and_missing_files_are_refused(bundle):
    p = bundle / "models/fp32.onnx"
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(BundleIntegrityError):
        verify_bundle(bundle)
    p.unlink()
    with pytest.raises(BundleIntegrityError, match="missing"):
        verify_bundle(bundle)
    p.mkdir()  # a user's pass: a listed file replaced by a folder (or a pipe) was reported as missing
    with pytest.raises(BundleIntegrityError, match="is not a regular file"):
        verify_bundle(bundle)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(schema_version=99), "schema version 99"),
    (lambda d: d.pop("inputs"), "inputs"),
    (lambda d: d["files"].update({"../outside": "0" * 64}), "files: '../outside' is not a path inside the bundle"),
    (lambda d: d["files"].pop("models/fp32.onnx"), "variants\\[0\\].file: 'models/fp32.onnx' has no hash"),
    (lambda d: d.update(target="jetson"), "field target: 'jetson' is not of type 'object'"),
    (lambda d: d.update(default_variant="nope"), "default_variant: 'nope' is not one of the variants"),
    (lambda d: d.update(variants=[]), "field variants: .* should be non-empty"),
    (lambda d: d["shape_ranges"]["batch"].update(min="a"), "field shape_ranges.batch.min: 'a' is not of type 'integer'"),
    (lambda d: d["inputs"][0].update(dtype="int64"), "manifest inputs do not match fp32.onnx"),
    (lambda d: d["inputs"][0].update(name="y"), "manifest inputs do not match fp32.onnx"),
    (lambda d: d["inputs"][0].update(shape=["batch", 7]), "manifest inputs do not match fp32.onnx"),
    (lambda d: d["outputs"][0].update(shape=["batch", 100]), "manifest outputs do not match fp32.onnx"),
    (lambda d: d["outputs"][0].update(dtype="float16"), "manifest outputs do not match fp32.onnx"),
    (lambda d: d["outputs"][0].update(name="probs"), "manifest outputs do not match fp32.onnx"),
])
def test_malformed_manifest_is_refused(bundle, edit, message):
    path = bundle / "manifest.json"
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(BundleError, match=message):
        verify_bundle(bundle)


def test_not_json_and_not_a_bundle(tmp_path, bundle):
    (bundle / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(bundle)
    with pytest.raises(BundleError, match="does not exist"):
        read_manifest(tmp_path / "nope.dse")
    (tmp_path / "empty.dse").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        read_manifest(tmp_path / "empty.dse")


def test_crash_before_rename_leaves_nothing(tmp_path):
    dest = tmp_path / "out" / "mlp-cpu.dse"

    def crash(_tmp):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        tiny_bundle(dest, tmp_path, before_commit=crash)
    assert not dest.exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_rebuild_replaces_existing_bundle_and_failed_rebuild_keeps_it(tmp_path):
    dest = tmp_path / "b.dse"
    with atomic_directory(dest) as d:
        (d / "a.txt").write_text("one")
    with atomic_directory(dest) as d:
        (d / "a.txt").write_text("two")
    assert (dest / "a.txt").read_text() == "two"
    with pytest.raises(ValueError):
        with atomic_directory(dest) as d:
            (d / "a.txt").write_text("three")
            raise ValueError("crash")
    assert (dest / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.dse"]


def test_published_bundle_has_the_users_usual_mode(bundle):
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o777 & ~umask


def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    from dsedge.runtime.bundle import remove_stale_temp
    from dsedge.runtime.tempdirs import owned_temp_dir, release

    child = ("import sys; from dsedge.runtime.tempdirs import owned_temp_dir; "
             "d = owned_temp_dir(sys.argv[1], '.dsedge-build-7-'); (d / 'fp32.onnx').write_bytes(b'x' * 100); "
             "print(d)")
    dead = Path(subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True,
                               check=True).stdout.strip())          # its owner exited without cleaning up
    legacy = tmp_path / ".x.dse.tmp-1-def"                           # no owner record at all
    legacy.mkdir()
    mine = owned_temp_dir(tmp_path, f".dsedge-build-{dead.name.split('-')[2]}-")  # live, whatever its digits
    keep = tmp_path / "user-folder"
    keep.mkdir()
    assert sorted(remove_stale_temp(tmp_path)) == sorted([dead, legacy])
    assert mine.exists() and keep.exists() and not Path(str(dead) + ".lock").exists()
    release(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user-folder"]


def test_refuses_to_replace_a_folder_that_is_not_a_bundle(tmp_path):
    dest = tmp_path / "mlp-cpu.dse"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="is not a dsedge bundle"):
        tiny_bundle(dest, tmp_path)
    assert (dest / "notes.txt").read_text() == "mine"
