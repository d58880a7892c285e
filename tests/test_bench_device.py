"""Jetson-aware bench (power mode, clock lock, tegrastats parsed from tool output in the formats JetPack 5/6 print on
Orin and Xavier), `--concurrency N` closed-loop clients and `--inputs DIR` real inputs, on real ORT CPU sessions.
The tool output below is written in the formats NVIDIA documents (L4T developer guide: tegrastats, nvpmodel,
jetson_clocks); it was not captured from a board in this session."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsedge.cli import main
from dsedge.runtime import jetson
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.toolchain.bundle_writer import write_bundle
from tiny_models import mlp_onnx

NVPMODEL_MAXN = "NV Power Mode: MAXN\n0\n"
NVPMODEL_15W = "NVPM WARN: ...\nNV Power Mode: 15W\n1\n"
CLOCKS_DVFS = """SOC family:tegra234  Machine:NVIDIA Jetson AGX Orin Developer Kit
Online CPUs: 0-11
cpu0: Online=1 Governor=schedutil MinFreq=115200 MaxFreq=2201600 CurrentFreq=729600 IdleStates: WFI=1 c7=1
cpu1: Online=1 Governor=schedutil MinFreq=115200 MaxFreq=2201600 CurrentFreq=1497600 IdleStates: WFI=1 c7=1
GPU MinFreq=306000000 MaxFreq=1300500000 CurrentFreq=306000000
EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=2133000000 FreqOverride=0
DLA0_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000
NV Power Mode: MAXN
"""
CLOCKS_LOCKED = """SOC family:tegra234  Machine:NVIDIA Jetson AGX Orin Developer Kit
cpu0: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=0 c7=0
cpu1: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=0 c7=0
cpu8: Online=0 Governor=schedutil MinFreq=115200 MaxFreq=2201600 CurrentFreq=115200
GPU MinFreq=1300500000 MaxFreq=1300500000 CurrentFreq=1300500000
EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=3199000000 FreqOverride=1
NV Power Mode: MAXN
"""
TEGRASTATS_ORIN = ("12-01-2026 08:00:00 RAM 2270/30536MB (lfb 6863x4MB) SWAP 0/15268MB (cached 0MB) "
                   "CPU [2%@729,1%@729,off,off,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 12%@3199 GR3D_FREQ 87%@[1300,1300] "
                   "NVENC off NVDEC off VIC off APE 174 cpu@43.968C soc2@40.062C gpu@61.312C tj@62.5C "
                   "VDD_GPU_SOC 9393mW/6393mW VDD_CPU_CV 1399mW/1299mW VIN_SYS_5V0 3228mW/3228mW")
TEGRASTATS_XAVIER = ("RAM 3340/31920MB (lfb 5863x4MB) CPU [5%@1190,2%@1190,off,off] EMC_FREQ 3%@1600 "
                     "GR3D_FREQ 0%@318 APE 150 MTS fg 0% bg 0% AO@40C GPU@91.5C Tdiode@43.25C PMIC@50C "
                     "GPU 0mW/0mW CPU 311mW/311mW")


def test_power_mode_clock_lock_and_tegrastats_parse():
    assert jetson.parse_nvpmodel(NVPMODEL_MAXN) == {"name": "MAXN", "id": 0}
    assert jetson.parse_nvpmodel(NVPMODEL_15W) == {"name": "15W", "id": 1}
    assert jetson.parse_nvpmodel("no mode here") is None
    dvfs, locked = jetson.parse_jetson_clocks(CLOCKS_DVFS), jetson.parse_jetson_clocks(CLOCKS_LOCKED)
    assert dvfs["locked"] is False and dvfs["units"]["gpu"]["currentfreq"] == 306000000
    assert locked["locked"] is True and "cpu8" not in locked["units"]  # offline cores do not count
    orin = jetson.parse_tegrastats(TEGRASTATS_ORIN)
    assert orin["gpu"] == {"load_pct": 87, "mhz": 1300} and orin["emc"] == {"load_pct": 12, "mhz": 3199}
    assert orin["ram_mb"] == {"used": 2270, "total": 30536} and orin["cpu"][2] is None and orin["cpu"][0]["mhz"] == 729
    assert orin["temperature_c"]["gpu"] == 61.312 and orin["power"]["VDD_GPU_SOC"] == {"mw": 9393, "avg_mw": 6393}
    xav = jetson.parse_tegrastats(TEGRASTATS_XAVIER)
    assert xav["gpu"] == {"load_pct": 0, "mhz": 318} and xav["temperature_c"]["gpu"] == 91.5


def test_collect_warns_when_clocks_float_the_mode_is_capped_or_the_module_is_hot():
    out = {("nvpmodel", "-q"): NVPMODEL_15W, ("jetson_clocks", "--show"): CLOCKS_DVFS}
    facts = jetson.collect(run=lambda cmd: out.get(tuple(cmd)), tegrastats=lambda: TEGRASTATS_XAVIER)
    text = " | ".join(facts["warnings"])
    assert facts["power_mode"] == {"name": "15W", "id": 1} and facts["clocks_locked"] is False
    assert "not locked" in text and "15W" in text and "GPU 92 °C" in text.replace("gpu", "GPU")
    out = {("nvpmodel", "-q"): NVPMODEL_MAXN, ("jetson_clocks", "--show"): CLOCKS_LOCKED}
    facts = jetson.collect(run=lambda cmd: out.get(tuple(cmd)), tegrastats=lambda: TEGRASTATS_ORIN)
    assert facts["clocks_locked"] is True and facts["warnings"] == []
    facts = jetson.collect(run=lambda cmd: NVPMODEL_MAXN if cmd[0] == "nvpmodel" else None, tegrastats=lambda: None)
    assert facts["clocks_locked"] is None and "needs root" in facts["warnings"][0]


def test_xavier_pmic_placeholder_reading_is_not_a_hot_module():
    """Found by review: Xavier (and Nano/TX1) tegrastats print ``PMIC@100C`` on every line (the PMIC-Die thermal zone
    reports a constant 100 °C); `dsedge bench` called every Xavier 'hot, it may throttle'."""
    line = ("RAM 3412/15822MB (lfb 1x2MB) CPU [12%@1907,8%@1907,15%@1907,6%@1907] EMC_FREQ 39%@2133 GR3D_FREQ 23%@522 "
            "APE 150 PLL@42C CPU@44C PMIC@100C GPU@43C AO@39.5C thermal@43.4C GPU 0mW/0mW CPU 311mW/311mW")
    out = {("nvpmodel", "-q"): NVPMODEL_MAXN, ("jetson_clocks", "--show"): CLOCKS_LOCKED}
    facts = jetson.collect(run=lambda cmd: out.get(tuple(cmd)), tegrastats=lambda: line)
    assert facts["tegrastats"]["temperature_c"]["pmic"] == 100.0 and facts["warnings"] == []
    hot = line.replace("GPU@43C", "GPU@91C")  # a really hot GPU is still reported
    facts = jetson.collect(run=lambda cmd: out.get(tuple(cmd)), tegrastats=lambda: hot)
    assert any("GPU 91 °C" in w.replace("gpu", "GPU") and "pmic" not in w for w in facts["warnings"])


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("benchdev")
    return write_bundle(tmp / "m-cpu.dse", name="m", target={"name": "cpu"},
                        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                        models={"models/fp32.onnx": mlp_onnx(tmp / "m.onnx")},
                        variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32",
                        shape_ranges={"batch": {"min": 1, "opt": 1, "max": 8}}, latency_budget_ms=1000.0)


def bench(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["bench", *map(str, args)])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_bench_records_jetson_state_and_warns_when_clocks_are_not_fixed(bundle, capsys, monkeypatch, caplog):
    out = {("nvpmodel", "-q"): NVPMODEL_MAXN, ("jetson_clocks", "--show"): CLOCKS_DVFS}
    monkeypatch.setattr(jetson, "is_jetson", lambda: True)
    monkeypatch.setattr(jetson, "_run", lambda cmd, timeout=5.0: out.get(tuple(cmd)))
    monkeypatch.setattr(jetson, "_tegrastats_line", lambda timeout=3.0: TEGRASTATS_ORIN)
    code, text, _ = bench(capsys, bundle, "--iterations", 5, "--warmup", 1, "--json")
    rep = json.loads(text)
    jet = rep["device"]["jetson"]
    assert code == 0 and jet["power_mode"] == {"name": "MAXN", "id": 0} and jet["clocks_locked"] is False
    assert jet["tegrastats"]["gpu"]["mhz"] == 1300 and any("not locked" in n for n in rep["notes"])
    assert "Jetson clocks are not locked" in caplog.text
    code, text, _ = bench(capsys, bundle, "--iterations", 5, "--warmup", 1)
    flat = " ".join(text.split())
    assert "jetson : power mode MAXN (0), clocks locked NO, GPU 1300 MHz, EMC 3199 MHz" in flat
    assert "note : Jetson clocks are not locked" in flat


def test_concurrency_runs_closed_loop_clients(bundle, capsys):
    code, text, _ = bench(capsys, bundle, "--batch", "1,2", "--iterations", 12, "--warmup", 1, "--concurrency", 3,
                          "--threads", 1, "--json")
    rep = json.loads(text)
    assert code == 0 and rep["settings"]["concurrency"] == 3
    for r in rep["results"]:
        assert r["concurrency"] == 3 and r["iterations"] == 12 and r["throughput"]["inferences_per_s"] > 0


def test_inputs_dir_benches_real_rows(bundle, capsys, tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    rng = np.random.default_rng(0)
    np.savez(d / "a.npz", x=rng.standard_normal((5, 64)).astype(np.float32))
    np.savez(d / "b.npz", x=rng.standard_normal((3, 64)).astype(np.float32))
    code, text, _ = bench(capsys, bundle, "--batch", "4", "--iterations", 6, "--warmup", 0, "--inputs", d, "--json")
    rep = json.loads(text)
    assert code == 0 and rep["results"][0]["inputs"] == str(d) and rep["results"][0]["shapes"] == {"x": [4, 64]}
    np.savez(d / "c.npz", y=np.zeros((2, 64), np.float32))
    code, _, err = bench(capsys, bundle, "--iterations", 2, "--inputs", d)
    assert code == 2 and "c.npz has no array 'x'" in err


def test_windows_cycle_through_the_real_rows():
    from dsedge.runtime.bench_load import input_windows

    w = input_windows({"x": np.arange(10)[:, None]}, 4)
    assert [f["x"][:, 0].tolist() for f in w] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert input_windows({"x": np.arange(3)[:, None]}, 4)[0]["x"][:, 0].tolist() == [0, 1, 2, 0]


def test_inputs_dir_refuses_a_static_axis_of_the_wrong_size_naming_the_file(bundle, capsys, tmp_path):
    """Found by a user: a file whose static feature axis was wrong (20 columns for the input's [batch, 64]) was
    zero-padded to 64 and benchmarked without a word when another file was right; alone it was refused without
    naming the file. Only symbolic axes are padded; a static one of another size is a usage error naming the file,
    the input and both sizes."""
    d = tmp_path / "inputs"
    d.mkdir()
    rng = np.random.default_rng(0)
    np.savez(d / "b.npz", x=rng.standard_normal((3, 20)).astype(np.float32))
    for present in ("alone", "beside a right file"):
        code, text, err = bench(capsys, bundle, "--batch", "4", "--iterations", 2, "--warmup", 0, "--inputs", d)
        flat = " ".join(err.split())
        assert code == 2 and "Traceback" not in err and text == "", (present, err)
        assert "b.npz: array 'x' has shape [3, 20]: axis 1 holds 20" in flat and "static 64" in flat, (present, err)
        np.savez(d / "a.npz", x=rng.standard_normal((5, 64)).astype(np.float32))
    np.savez(d / "b.npz", x=rng.standard_normal(64).astype(np.float32))  # one right row without the batch axis
    code, text, err = bench(capsys, bundle, "--batch", "4", "--iterations", 2, "--warmup", 0, "--inputs", d, "--json")
    assert code == 0 and json.loads(text)["results"][0]["shapes"] == {"x": [4, 64]}, err
