"""``dsedge quantize``: ONNX in, ONNX out — INT4 weight-only (RTN/AWQ/GPTQ), INT8 (static Q/DQ or dynamic),
FP16/BF16 with FP32 islands, or INT4 / INT8 mixed precision under an accuracy gate."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ...runtime.params import FiniteFloat

from ...runtime.errors import SourceError


def _load(path: Path):
    import onnx

    if not path.is_file():
        raise SourceError(f"ONNX model {str(path)!r} not found", "pass the path of an .onnx file")
    try:
        return onnx.load(str(path))
    except Exception as e:  # protobuf raises DecodeError and friends
        raise SourceError(f"{str(path)!r} is not a readable ONNX model: {str(e).splitlines()[0]}",
                          "export the model to ONNX first") from None


def save_model_atomic(model, dest: Path) -> None:
    """Write ``model`` to ``dest`` via a temporary file and a rename (external data when over 1.8 GB)."""
    import onnx

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    big = model.ByteSize() > 1_800_000_000
    try:
        onnx.save_model(model, str(tmp), save_as_external_data=big, location=dest.name + ".data" if big else None)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


@click.command("quantize")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output .onnx path.")
@click.option("--precision", type=click.Choice(["int4", "int8", "fp16", "bf16"]), default="int4", show_default=True)
@click.option("--algorithm", type=click.Choice(["rtn", "awq", "gptq", "awq+gptq"]), default="gptq",
              show_default=True, help="INT4 algorithm (AWQ arXiv:2306.00978, GPTQ arXiv:2210.17323).")
@click.option("--block-size", type=click.IntRange(8, 4096), default=32, show_default=True,
              help="INT4 weights per scale along the input dimension.")
@click.option("--asymmetric", is_flag=True, help="INT4/INT8 weights with zero points (not for TensorRT INT4).")
@click.option("--calib", type=click.Path(path_type=Path), help="Calibration data: a .npz or a directory of .npz.")
@click.option("--heldout", type=click.Path(path_type=Path), help="Held-out data for --accuracy-gate (.npz or dir).")
@click.option("--accuracy-gate", "gate", help="METRIC:THRESHOLD[,…], e.g. cosine:0.99 or cosine:0.99,top1:1 "
              "(INT4: raise sensitive layers until all pass; INT8 static: keep the most sensitive layers float).")
@click.option("--method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="INT8 activation calibration.")
@click.option("--int8-mode", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="static = W8A8 Q/DQ (TensorRT and ORT); dynamic = ORT CPU only.")
@click.option("--smooth-alpha", type=FiniteFloat(0, 1), default=None,
              help="INT8 static: SmoothQuant (arXiv:2211.10438) with this alpha first (e.g. 0.5).")
@click.option("--nodes", help="Comma-separated node names to quantize (default: all MatMul/Gemm weights).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
def quantize(model: Path, output: Path, precision: str, algorithm: str, block_size: int, asymmetric: bool,
             calib: Path | None, heldout: Path | None, gate: str | None, method: str, int8_mode: str,
             smooth_alpha: float | None, nodes: str | None, report_path: Path | None) -> None:
    """Quantize an ONNX MODEL and write the result to --output (written atomically)."""
    from ..quantize.fp16 import convert_float16
    from ..quantize.int8 import quantize_int8_dynamic, quantize_int8_static
    from ..quantize.int8_gate import quantize_int8_gated
    from ..quantize.mixed import parse_gates, quantize_mixed
    from ..quantize.weight_only import quantize_weight_only

    m = _load(model)
    node_list = [n.strip() for n in nodes.split(",") if n.strip()] if nodes else None
    if precision == "int4" and gate:
        if heldout is None:
            raise SourceError("--accuracy-gate needs --heldout data", "pass --heldout DIR_OR_NPZ")
        out, report = quantize_mixed(m, calib, gate=parse_gates(gate), heldout=heldout, algorithm=algorithm,
                                     block_size=block_size, symmetric=not asymmetric, nodes=node_list,
                                     on_step=lambda msg: click.echo(f"  {msg}", err=True))
    elif precision == "int4":
        out, report = quantize_weight_only(m, calib, algorithm=algorithm, block_size=block_size,
                                           symmetric=not asymmetric, nodes=node_list)
    elif precision == "int8" and int8_mode == "static" and gate:
        if heldout is None:
            raise SourceError("--accuracy-gate needs --heldout data", "pass --heldout DIR_OR_NPZ")
        out, report = quantize_int8_gated(m, calib, gate=parse_gates(gate), heldout=heldout, method=method,
                                          smooth_alpha=smooth_alpha,
                                          on_step=lambda msg: click.echo(f"  {msg}", err=True))
    elif precision == "int8" and int8_mode == "static":
        out, report = quantize_int8_static(m, calib, method=method, smooth_alpha=smooth_alpha)
    elif precision == "int8":
        out, report = quantize_int8_dynamic(m)
    else:
        out, report = convert_float16(m, dtype=precision)
    save_model_atomic(out, output)
    report = {"source": str(model), "output": str(output), "precision": precision,
              "size_bytes": output.stat().st_size, "source_size_bytes": model.stat().st_size, **report}
    if report_path:
        report_path.write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
    ratio = report["size_bytes"] / max(report["source_size_bytes"], 1)
    click.echo(f"wrote {output} ({precision}, {report['size_bytes'] / 1e6:.2f} MB, {ratio:.1%} of the source)")
    for r in report.get("raised", []):
        click.echo(f"  kept {r['to']}: {r['node']} — {r['reason']}")
    for r in report.get("kept_float", []):
        if isinstance(r, dict):                       # the INT8 gate's records (INT4 lists bare node names)
            click.echo(f"  kept float: {r['node']} — {r['reason']}")
