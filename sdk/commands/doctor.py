"""``dsedge doctor``: what this machine can run bundles with."""
from __future__ import annotations

import importlib.util
import json
import platform
from typing import Any

import click


def _installed(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "installed"


def machine_report() -> dict[str, Any]:
    """Backends, providers, GPU and package versions on this machine (no torch import)."""
    from ..runtime.backends.ort import available_providers, import_ort, ort_distributions
    from ..runtime.backends.tensorrt import tensorrt_unusable_reason
    from ..runtime.bench import tensorrt_version
    from ..runtime.gpu_info import detect_gpu

    ort = import_ort()  # BackendUnavailable (one line, which extra to install) when there is none
    gpu = detect_gpu()
    return {
        "onnxruntime_packages": ort_distributions(),
        "platform": platform.platform(), "python": platform.python_version(), "machine": platform.machine(),
        "onnxruntime": ort.__version__, "ort_device": ort.get_device(), "providers": available_providers(),
        "tensorrt": tensorrt_version(), "tensorrt_backend": tensorrt_unusable_reason() or "usable", "torch": _installed("torch"), "onnx": _installed("onnx"),
        "gpus": [f"{gpu.name} (sm{gpu.compute_capability.replace('.', '')})"] if gpu else [],
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
    if len(r["onnxruntime_packages"]) > 1:
        click.secho(f"warning       {' and '.join(r['onnxruntime_packages'])} are both installed: they overwrite each "
                    "other's files (keep one: docs/jetpack.md)", fg="yellow")
    if not r["tensorrt"]:
        click.echo("tensorrt      not installed: bundles run on ONNX Runtime")
    elif r["tensorrt_backend"] == "usable":
        click.echo(f"tensorrt      {r['tensorrt']} (dsedge builds and runs engines with it)")
    else:  # installed, but `dsedge.load` falls back to ONNX Runtime: say why here, not only in a log line
        click.secho(f"tensorrt      {r['tensorrt']}, not usable: {r['tensorrt_backend']}; bundles run on ONNX Runtime",
                    fg="yellow")
    click.echo(f"torch         {r['torch'] or 'not installed (not needed to run bundles)'}")
    click.echo(f"gpus          {', '.join(r['gpus']) or 'none found'}")
