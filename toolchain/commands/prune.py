"""``dsedge prune``: ONNX in, ONNX out — 2:4 semi-structured sparsity or structured MLP channel pruning."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ...runtime.errors import ConfigError
from .quantize import _load, save_model_atomic


@click.command("prune")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output .onnx path.")
@click.option("--pattern", type=click.Choice(["2:4", "channels"]), default="2:4", show_default=True,
              help="2:4 = zero 2 of every 4 weights along K (A100/Orin sparse tensor cores); channels = remove "
                   "hidden channels of Linear → activation → Linear blocks.")
@click.option("--sparsity", type=float, default=0.3, show_default=True,
              help="Global fraction of MLP hidden channels to remove (--pattern channels).")
@click.option("--calib", type=click.Path(path_type=Path),
              help="Calibration data (.npz or dir): activation-aware importance (Wanda) instead of magnitude.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
def prune(model: Path, output: Path, pattern: str, sparsity: float, calib: Path | None,
          report_path: Path | None) -> None:
    """Prune an ONNX MODEL and write the result to --output (written atomically). Fine-tune afterwards to recover
    accuracy (dsedge.toolchain.qat / dsedge train)."""
    from ..prune import prune_2_4, prune_channels
    from ..quantize.graph import select_layers
    from ..quantize.weight_only import layer_activations

    if pattern == "2:4" and sparsity != 0.3:
        raise ConfigError("--sparsity applies to --pattern channels; 2:4 is always 50 %", "drop --sparsity")
    m = _load(model)
    acts = layer_activations(m, calib, select_layers(m, None)) if calib else None
    if pattern == "2:4":
        out, report = prune_2_4(m, acts)
    else:
        out, report = prune_channels(m, sparsity, activations=acts)
    save_model_atomic(out, output)
    report = {"source": str(model), "output": str(output), **report}
    if report_path:
        report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if pattern == "2:4":
        click.echo(f"wrote {output}: 2:4 sparsity on {len(report['layers'])} layers"
                   + (f" (skipped {len(report['skipped'])})" if report["skipped"] else ""))
    else:
        click.echo(f"wrote {output}: {report['sparsity']:.1%} of MLP hidden channels removed "
                   f"in {len(report['blocks'])} blocks")
