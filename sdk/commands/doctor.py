"""``dsedge doctor``: what this machine can run bundles with."""
from __future__ import annotations

import importlib.util
import json
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        from importlib.metadata import version

        return version({"tensorrt": "tensorrt", "onnxruntime": "onnxruntime"}.get(module, module))
    except Exception:  # installed without metadata (e.g. JetPack's system tensorrt)
        return "installed"


def _gpus() -> list[str]:
    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            gpus += [g.strip() for g in out.stdout.splitlines() if g.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    model = Path("/proc/device-tree/model")
    if model.is_file():  # Jetson boards name themselves here
        name = model.read_text(errors="ignore").strip("\x00\n ")
        if "jetson" in name.lower() or "orin" in name.lower():
            gpus.append(name)
    return gpus


def machine_report() -> dict[str, Any]:
    """Backends, providers, GPUs and package versions on this machine (no torch import)."""
    import onnxruntime as ort

    from ..runtime.backends.ort import available_providers

    return {
        "platform": platform.platform(), "python": platform.python_version(), "machine": platform.machine(),
        "onnxruntime": ort.__version__, "ort_device": ort.get_device(), "providers": available_providers(),
        "tensorrt": _version("tensorrt"), "torch": _version("torch"), "onnx": _version("onnx"),
        "gpus": _gpus(),
    }


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def doctor(as_json: bool) -> None:
    """Show the backends, providers and GPUs this machine has."""
    r = machine_report()
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"platform      {r['platform']} ({r['machine']}), Python {r['python']}")
    click.echo(f"onnxruntime   {r['onnxruntime']} ({r['ort_device']}); providers: {', '.join(r['providers'])}")
    click.echo(f"tensorrt      {r['tensorrt'] or 'not installed: bundles run on ONNX Runtime'}")
    click.echo(f"torch         {r['torch'] or 'not installed (not needed to run bundles)'}")
    click.echo(f"gpus          {', '.join(r['gpus']) or 'none found'}")
