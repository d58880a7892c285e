"""Jetson power and clock state for benchmarks: the power mode (``nvpmodel -q``), whether clocks are locked
(``jetson_clocks --show``), and GPU/EMC load, clocks, temperatures and power rails (one ``tegrastats`` line).

Latency on Jetson depends on these more than on anything else: DVFS lowers GPU and memory (EMC) clocks when idle, so
an unlocked board measures ramp-up; a lower nvpmodel mode caps clocks; a hot module throttles. ``dsedge bench``
records them in its JSON and warns when the clocks are not fixed. The parsers take the tools' text output (formats of
JetPack 5.x/6.x on Orin and Xavier); ``collect`` runs the tools, each with a timeout, and leaves out what it cannot
read (``jetson_clocks --show`` needs root).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
_NOT_HOT = ("tj", "pmic")  # tj has its own (95 °C) threshold; pmic is a placeholder reading (see ``collect``)
TEGRA_RELEASE = Path("/etc/nv_tegra_release")


def is_jetson() -> bool:
    """True on an NVIDIA Jetson (L4T): the device-tree model says Jetson, or ``/etc/nv_tegra_release`` exists."""
    try:
        if "jetson" in DEVICE_TREE_MODEL.read_text(errors="replace").lower():
            return True
    except OSError:
        pass
    return TEGRA_RELEASE.is_file()


def parse_nvpmodel(text: str) -> dict[str, Any] | None:
    """``nvpmodel -q`` → ``{"name": "MAXN", "id": 0}`` (None when the output has no power mode)."""
    m = re.search(r"NV Power Mode:\s*(\S+)", text)
    if not m:
        return None
    after = text[m.end():].split()
    mode_id = int(after[0]) if after and after[0].isdigit() else None
    return {"name": m.group(1), "id": mode_id}


def _freqs(line: str) -> dict[str, int]:
    return {k.lower(): int(v) for k, v in re.findall(r"(MinFreq|MaxFreq|CurrentFreq)=(\d+)", line)}


def parse_jetson_clocks(text: str) -> dict[str, Any]:
    """``jetson_clocks --show`` → per unit (``cpu0``…, ``gpu``, ``emc``) min/max/current Hz (GPU, EMC) or kHz (CPUs,
    as the tool prints them), and ``locked``: every online CPU, the GPU and EMC run at min = max (what
    ``jetson_clocks`` sets; EMC also counts as locked with ``FreqOverride=1``)."""
    units: dict[str, dict[str, int]] = {}
    emc_override = False
    for line in text.splitlines():
        s = line.strip()
        cpu = re.match(r"(cpu\d+):\s*Online=(\d)", s)
        if cpu:
            if cpu.group(2) == "1":
                units[cpu.group(1)] = _freqs(s)
        elif s.startswith("GPU ") or s.startswith("GPU:"):
            units["gpu"] = _freqs(s)
        elif s.startswith("EMC "):
            units["emc"] = _freqs(s)
            emc_override = "FreqOverride=1" in s
    def fixed(u: dict[str, int]) -> bool:
        return bool(u) and u.get("minfreq") == u.get("maxfreq")

    locked = None
    if "gpu" in units:
        locked = (fixed(units["gpu"]) and (fixed(units.get("emc", {})) or emc_override)
                  and all(fixed(u) for k, u in units.items() if k.startswith("cpu")))
    return {"units": units, "locked": locked}


def parse_tegrastats(line: str) -> dict[str, Any]:
    """One ``tegrastats`` line → RAM (MB), CPU load/clock per core, EMC and GPU (GR3D) load % and clock MHz,
    temperatures (°C) and power rails (mW, current/average). Orin prints the GPU clock per GPC (``0%@[305,0]``):
    the highest is kept."""
    out: dict[str, Any] = {}
    m = re.search(r"RAM (\d+)/(\d+)MB", line)
    if m:
        out["ram_mb"] = {"used": int(m.group(1)), "total": int(m.group(2))}
    m = re.search(r"CPU \[([^\]]*)\]", line)
    if m:
        cores = []
        for c in m.group(1).split(","):
            cm = re.match(r"(\d+)%@(\d+)", c.strip())
            cores.append({"load_pct": int(cm.group(1)), "mhz": int(cm.group(2))} if cm else None)
        out["cpu"] = cores
    m = re.search(r"EMC_FREQ (\d+)%(?:@(\d+))?", line)
    if m:
        out["emc"] = {"load_pct": int(m.group(1)), "mhz": int(m.group(2)) if m.group(2) else None}
    m = re.search(r"GR3D_FREQ (\d+)%(?:@\[?([\d,]+)\]?)?", line)
    if m:
        clocks = [int(x) for x in (m.group(2) or "").split(",") if x]
        out["gpu"] = {"load_pct": int(m.group(1)), "mhz": max(clocks) if clocks else None}
    temps = {k.lower(): float(v) for k, v in re.findall(r"\b([A-Za-z][\w]*)@(-?\d+(?:\.\d+)?)C\b", line)}
    if temps:
        out["temperature_c"] = temps
    rails = {k: {"mw": int(a), "avg_mw": int(b)} for k, a, b in re.findall(r"\b([A-Z][A-Z0-9_]+) (\d+)mW/(\d+)mW", line)}
    if rails:
        out["power"] = rails
    return out


def _run(cmd: list[str], timeout: float = 5.0) -> str | None:
    exe = shutil.which(cmd[0])
    if not exe:
        return None
    try:
        r = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _tegrastats_line(timeout: float = 3.0) -> str | None:
    exe = shutil.which("tegrastats")
    if not exe:
        return None
    try:
        p = subprocess.Popen([exe, "--interval", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    try:
        import select

        ready, _, _ = select.select([p.stdout], [], [], timeout)
        return p.stdout.readline() if ready else None
    finally:
        p.terminate()
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.kill()


def collect(run: Callable[[list[str]], str | None] | None = None,
            tegrastats: Callable[[], str | None] | None = None) -> dict[str, Any]:
    """The board's state now: ``power_mode``, ``clocks`` (``parse_jetson_clocks``), ``tegrastats``, ``warnings``.

    ``run`` / ``tegrastats`` produce the tools' output (default: run the tools; tests pass recorded output).
    Never raises.
    """
    run = run or _run
    tegrastats = tegrastats or _tegrastats_line
    facts: dict[str, Any] = {"power_mode": None, "clocks_locked": None, "clocks": None, "tegrastats": None}
    warnings = []
    q = run(["nvpmodel", "-q"])
    if q:
        facts["power_mode"] = parse_nvpmodel(q)
    show = run(["jetson_clocks", "--show"])
    if show:
        clocks = parse_jetson_clocks(show)
        facts["clocks"], facts["clocks_locked"] = clocks["units"], clocks["locked"]
        if facts["power_mode"] is None:
            facts["power_mode"] = parse_nvpmodel(show)
    line = tegrastats()
    if line:
        facts["tegrastats"] = parse_tegrastats(line)
    if facts["clocks_locked"] is False:
        warnings.append("Jetson clocks are not locked (DVFS): latency includes clock ramp-up; run `sudo jetson_clocks` "
                        "before benchmarking")
    elif facts["clocks_locked"] is None:
        warnings.append("could not read whether Jetson clocks are locked (`jetson_clocks --show` needs root): "
                        "figures may include DVFS ramp-up")
    mode = facts["power_mode"]
    if mode and mode.get("name") and "MAXN" not in str(mode["name"]).upper():
        warnings.append(f"power mode {mode['name']} (nvpmodel {mode.get('id')}) caps clocks: not the board's "
                        "fastest figures (MAXN)")
    temps = (facts["tegrastats"] or {}).get("temperature_c", {})
    # PMIC: the PMIC-Die thermal zone of Xavier/Nano/TX1 reads a constant 100 °C (``PMIC@100C`` in every tegrastats
    # line), not a measured temperature: it would call every Xavier hot.
    hot = {k: v for k, v in temps.items() if v >= 85.0 and k not in _NOT_HOT} or (
        {"tj": temps["tj"]} if temps.get("tj", 0) >= 95.0 else {})
    if hot:
        warnings.append(f"module is hot ({', '.join(f'{k} {v:.0f} °C' for k, v in hot.items())}): it may throttle")
    facts["warnings"] = warnings
    return facts
