"""Faults: temp-folder ownership under concurrent builds, kill -9 of `dsedge build` at seeded random points, a full
disk (a real EFBIG through RLIMIT_FSIZE in the child). Real processes, real files, bounded in time."""
from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsedge.runtime.bundle import remove_stale_temp, verify_bundle
from dsedge.runtime.tempdirs import is_temp_name, owned_temp_dir, owner, release, remove_stale
from tiny_models import mlp_onnx

TESTS = Path(__file__).resolve().parent
DSEDGE = [sys.executable, "-m", "dsedge.cli"]


def _litter(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if is_temp_name(p.name))


def test_a_live_owner_keeps_its_folder_whatever_digits_its_name_holds(tmp_path):
    """Before: cleanup read the first number of a temp folder's name as its owner's pid, so a build of a model
    named ``resnet-7777`` could delete a live build's temp folder when pid 7777 was not running."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dsedge.runtime.tempdirs import owned_temp_dir; "
        "d = owned_temp_dir(sys.argv[1], '.resnet-7777-cpu.dse.tmp-7777-'); print(d, flush=True); time.sleep(60)"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        live = Path(holder.stdout.readline().strip())
        assert live.is_dir() and owner(live)["pid"] == holder.pid
        assert remove_stale_temp(tmp_path) == [] and live.is_dir()      # what every build and bundle write runs
        holder.kill()
        holder.wait()
        assert remove_stale_temp(tmp_path) == [live] and _litter(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


WRITER = """
import os, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from dsedge.runtime.bundle import IOSpec, Variant, remove_stale_temp
from dsedge.runtime.errors import DsedgeError
from dsedge.toolchain.bundle_writer import write_bundle
from tiny_models import mlp_onnx
out, me, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = mlp_onnx(Path(sys.argv[4]) / f"m{{me}}.onnx", seed=me)
ok = 0
for i in range(rounds):
    name = "resnet-7777" if i % 2 else f"resnet-{{os.getpid() + 1}}"    # shared name, and digits of another pid
    try:
        write_bundle(out / f"{{name}}-cpu.dse", name=name, target={{"name": "cpu"}},
                     inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                     models={{"models/fp32.onnx": model}}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                     default_variant="fp32", shape_ranges={{"batch": {{"min": 1, "opt": 1, "max": 8}}}},
                     extra_files={{"build/who.txt": f"{{me}} {{i}}"}})
        ok += 1
    except DsedgeError as e:
        print("clean failure:", e)
    remove_stale_temp(out)
print("ok", ok)
"""


def test_concurrent_bundle_writes_into_one_folder_all_succeed(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    script = WRITER.format(tests=str(TESTS))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(out), str(k), "12", str(work)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-2000:]
        assert stdout.strip().endswith("ok 12"), stdout
    bundles = sorted(p.name for p in out.iterdir())
    assert "resnet-7777-cpu.dse" in bundles and len(bundles) == 5 and _litter(out) == []
    for b in bundles:
        verify_bundle(out / b)


def test_concurrent_cli_builds_into_one_out_folder(tmp_path):
    models = [mlp_onnx(tmp_path / f"resnet-{n}.onnx", seed=i) for i, n in enumerate((7777, os.getpid()))]
    out = tmp_path / "out"
    procs = [subprocess.Popen([*DSEDGE, "build", "--model", str(m), "--target", "cpu", "--out", str(out),
                               "--precision", "fp32"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for m in models * 2]                       # each model twice: two builds race for one destination
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{m.stem}-cpu.dse" for m in models)
    for b in out.iterdir():
        verify_bundle(b)


def _build(model: Path, out: Path, precision: str = "int8", **kw) -> subprocess.Popen:
    return subprocess.Popen([*DSEDGE, "build", "--model", str(model), "--target", "cpu", "--out", str(out),
                             "--precision", precision], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            **kw)


@pytest.mark.slow
def test_kill_9_at_random_points_never_leaves_a_half_bundle(tmp_path):
    model, out = mlp_onnx(tmp_path / "mlp.onnx"), tmp_path / "out"
    first = _build(model, out)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    dest = out / "mlp-cpu.dse"
    t0 = time.monotonic()
    first_m = verify_bundle(dest)
    rng = random.Random(15)
    finished = 0
    for _ in range(20):
        p = _build(model, out)
        time.sleep(rng.uniform(0.05, 2.4))
        p.kill()
        finished += p.wait(timeout=60) == 0
        m = verify_bundle(dest)                         # the old bundle or the new one, never a half one
        assert m.name == first_m.name and set(m.files) == set(first_m.files)
        assert sorted(x.name for x in out.iterdir() if not is_temp_name(x.name)) == ["mlp-cpu.dse"]
    assert time.monotonic() - t0 < 120
    last = _build(model, out)
    assert last.wait(timeout=120) == 0, last.stderr.read()
    verify_bundle(dest)
    assert sorted(x.name for x in out.iterdir()) == ["mlp-cpu.dse"]   # what the killed builds left is gone
    assert finished < 20                                               # the kills did land mid-build


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("limit", [4096, 20000])   # fails at the export copy / at the bundle's model copy
def test_a_full_disk_fails_in_one_line_and_the_existing_bundle_survives(tmp_path, limit):
    """Before: a raw OSError traceback. The limit makes a real write return EFBIG (Python ignores SIGXFSZ)."""
    model, out = mlp_onnx(tmp_path / "mlp.onnx"), tmp_path / "out"
    ok = _build(model, out, "fp32")
    assert ok.wait(timeout=120) == 0
    before = verify_bundle(out / "mlp-cpu.dse").files
    p = _build(model, out, preexec_fn=_limit_file_size(limit))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "file grew past the size limit" in err and err.count("\n") <= 2
    assert verify_bundle(out / "mlp-cpu.dse").files == before
    assert sorted(x.name for x in out.iterdir()) == ["mlp-cpu.dse"]   # the failing build cleaned up after itself


def test_owned_dirs_are_released_and_orphan_locks_removed(tmp_path):
    d = owned_temp_dir(tmp_path, ".x.dse.tmp-1-")
    assert Path(str(d) + ".lock").is_file() and remove_stale(tmp_path) == []
    release(d)
    assert list(tmp_path.iterdir()) == []
    orphan = tmp_path / ".y.dse.tmp-2-abc.lock"      # owner died between its lock file and its directory
    orphan.write_text("{}")
    assert remove_stale(tmp_path) == [] and not orphan.exists()


TMPFS_SCRIPT = """
set -u
mount -t tmpfs -o size=160k tmpfs "$MNT" || exit 77
"$PY" -m dsedge.cli build --model "$MODEL" --target cpu --out "$MNT/out" --precision fp32 >/dev/null 2>&1 || exit 78
echo "first ok"
"$PY" -m dsedge.cli build --model "$MODEL" --target cpu --out "$MNT/out" --precision int8 >/dev/null 2>"$ERR"
echo "second rc $?"
"$PY" -c "import sys, os; from dsedge.runtime.bundle import verify_bundle; verify_bundle(sys.argv[1] + '/mlp-cpu.dse');
print('left', sorted(os.listdir(sys.argv[1])))" "$MNT/out"
"""


def test_a_full_tmpfs_fails_in_one_line_and_the_existing_bundle_survives(tmp_path):
    """A real ENOSPC: a 160 KiB tmpfs in a private mount namespace (where this machine allows mounting)."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here; the RLIMIT_FSIZE test covers the full-disk path")
    mnt, err = tmp_path / "mnt", tmp_path / "err.txt"
    mnt.mkdir()
    env = {**os.environ, "MNT": str(mnt), "PY": sys.executable, "MODEL": str(mlp_onnx(tmp_path / "mlp.onnx")),
           "ERR": str(err)}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", TMPFS_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=120)
    if r.returncode == 77 or "unshare:" in r.stderr:
        pytest.skip(f"mounting a tmpfs is not allowed here ({r.stderr.strip()[:80]})")
    assert "first ok" in r.stdout, r.stdout + r.stderr
    assert "second rc 2" in r.stdout, r.stdout + err.read_text()
    text = err.read_text()
    assert "the disk is full" in text and "Traceback" not in text and text.count("\n") <= 2
    assert "left ['mlp-cpu.dse']" in r.stdout, r.stdout + r.stderr
