"""Engine files with metadata, cache keys and staleness rules, GPU identification parsing (all real, no fakes)."""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import pytest

from dsedge.runtime.engine_cache import EngineCache, EngineKey, MAGIC, read_engine, settings_digest, write_engine
from dsedge.runtime.errors import EngineError
from dsedge.runtime.gpu_info import GpuInfo, jetson_from_device_tree, parse_nvidia_smi

KEY = EngineKey(variant="int8", gpu="NVIDIA Jetson AGX Orin Developer Kit", compute_capability="8.7", sm_count=16,
                tensorrt="10.3.0.30", model_sha256="ab" * 32, settings_sha256=settings_digest({"precision": "int8"}))
PLAN = b"\x00plan-bytes\xff" * 100


def test_write_read_roundtrip_and_header(tmp_path):
    p = write_engine(tmp_path / "e.engine", PLAN, KEY, {"notes": ["x"]})
    header, plan = read_engine(p)
    assert plan == PLAN and header["key"]["gpu"] == KEY.gpu and header["notes"] == ["x"]
    assert p.read_bytes().startswith(MAGIC)
    assert [f.name for f in tmp_path.iterdir()] == ["e.engine"]  # no temp file left


@pytest.mark.parametrize("damage, words", [
    (lambda b: b"NOT-AN-ENGINE" + b[13:], "bad magic"),
    (lambda b: b[:len(MAGIC) + 10], "truncated (header)"),
    (lambda b: b[:-7], "plan sha256"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "plan sha256"),
    (lambda b: b[:len(MAGIC) + 4] + b"[" + b[len(MAGIC) + 5:], "malformed header"),
])
def test_corrupt_engines_are_refused_with_one_line(tmp_path, damage, words):
    p = write_engine(tmp_path / "e.engine", PLAN, KEY)
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(EngineError) as e:
        read_engine(p)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change, words", [
    (dict(gpu="NVIDIA Jetson Orin NX Engineering Reference Developer Kit", sm_count=8), "built for GPU"),
    (dict(compute_capability="8.6"), "sm86"),
    (dict(tensorrt="10.7.0.23"), "built with TensorRT 10.7.0.23, this is TensorRT 10.3.0.30"),
    (dict(model_sha256="cd" * 32), "another model"),
    (dict(settings_sha256=settings_digest({"precision": "fp16"})), "other settings"),
])
def test_stale_or_foreign_engine_reasons(change, words):
    other = replace(KEY, **change)
    from dataclasses import asdict
    assert words in KEY.mismatch(asdict(other))
    assert KEY.mismatch(asdict(KEY)) is None


def test_slot_separates_gpus_and_models_but_not_trt_versions():
    assert KEY.slot() == replace(KEY, tensorrt="10.7.0").slot()  # an upgrade replaces the engine
    assert KEY.slot() != replace(KEY, gpu="Orin NX", sm_count=8).slot()  # AGX and NX both sm87
    assert KEY.slot() != replace(KEY, model_sha256="cd" * 32).slot()
    assert KEY.slot().startswith("int8-abababab") and KEY.slot().endswith("-sm87-16.engine")


def test_dla_and_gpu_engines_have_slots_of_their_own():
    """Found by review: an engine for a DLA core and one for the GPU (or another DLA core) shared one cache slot, so
    each load on the other device rebuilt the engine (minutes on a Jetson) and evicted the other's. The GPU slot
    keeps the name it had, so prebuilt and cached GPU engines still match."""
    dla0, dla1 = replace(KEY, dla_core=0), replace(KEY, dla_core=1)
    assert len({KEY.slot(), dla0.slot(), dla1.slot()}) == 3
    assert KEY.slot().endswith("-sm87-16.engine") and dla0.slot().endswith("-sm87-16-dla0.engine")
    from dataclasses import asdict
    assert KEY.mismatch(asdict(dla0)) == "built for DLA core 0, this run is on the GPU"
    assert dla1.mismatch(asdict(dla0)) == "built for DLA core 0, this run is on DLA core 1"
    old_header = {k: v for k, v in asdict(KEY).items() if k != "dla_core"}  # written before the field existed
    assert KEY.mismatch(old_header) is None and "built for the GPU" in dla0.mismatch(old_header)


def test_cache_builds_once_then_reuses_and_rebuilds_stale_with_a_log_line(tmp_path, caplog):
    cache = EngineCache(tmp_path)
    built = []

    def build():
        built.append(1)
        return PLAN + bytes([len(built)])

    caplog.set_level(logging.INFO, logger="dsedge.engine")
    plan, did = cache.get_or_build(KEY, build)
    assert did and plan == PLAN + b"\x01"
    plan, did = cache.get_or_build(KEY, build)
    assert not did and plan == PLAN + b"\x01" and len(built) == 1
    upgraded = replace(KEY, tensorrt="10.4.0.26")
    plan, did = cache.get_or_build(upgraded, build)
    assert did and plan == PLAN + b"\x02"
    assert "built with TensorRT 10.3.0.30, this is TensorRT 10.4.0.26; rebuilding" in caplog.text
    cache.path_for(upgraded).write_bytes(b"garbage")
    plan, did = cache.get_or_build(upgraded, build)
    assert did and "bad magic" in caplog.text
    assert len(list(tmp_path.iterdir())) == 1


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_engine(tmp_path / "e.engine", PLAN, KEY)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DSEDGE_ENGINE_CACHE", str(tmp_path / "c"))
    assert EngineCache().root == tmp_path / "c"


def test_gpu_identification_parsing():
    assert parse_nvidia_smi("NVIDIA A100-SXM4-80GB, 8.0\nNVIDIA A100-SXM4-80GB, 8.0\n") == GpuInfo(
        "NVIDIA A100-SXM4-80GB", "8.0")
    assert parse_nvidia_smi("NVIDIA H200, 9.0").sm == "sm90"
    assert parse_nvidia_smi("No devices were found") is None
    agx = jetson_from_device_tree("NVIDIA Jetson AGX Orin Developer Kit\x00")
    nano = jetson_from_device_tree("NVIDIA Jetson Orin Nano Developer Kit\x00")
    assert agx.compute_capability == nano.compute_capability == "8.7" and agx.name != nano.name
    assert jetson_from_device_tree("NVIDIA Jetson AGX Xavier\x00").sm == "sm72"
    assert jetson_from_device_tree("Raspberry Pi 5 Model B") is None


def test_detect_gpu_asks_nvidia_smi(tmp_path, monkeypatch):
    from dsedge.runtime import gpu_info

    smi = tmp_path / "nvidia-smi"  # stand-in for NVIDIA's tool, which cannot exist here
    smi.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=name,compute_cap" ] && echo "NVIDIA A100-SXM4-80GB, 8.0"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_info, "_from_cuda_python", lambda: None)
    monkeypatch.setattr(gpu_info, "DEVICE_TREE_MODEL", tmp_path / "no-device-tree")
    gpu_info.detect_gpu.cache_clear()
    try:
        assert gpu_info.detect_gpu() == GpuInfo("NVIDIA A100-SXM4-80GB", "8.0")
    finally:
        gpu_info.detect_gpu.cache_clear()
