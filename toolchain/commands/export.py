"""``dsedge export triton BUNDLE --out REPO``: a bundle as a Triton Inference Server model repository."""
from __future__ import annotations

import json

import click

from ..triton.repository import PLATFORMS, VERSION_COMPATIBLE_FLAG


@click.group("export")
def export() -> None:
    """Export a bundle for another serving stack."""


@export.command("triton")
@click.argument("bundle", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Model repository directory: a new or empty folder, or an existing model repository updated in "
                   "place (each model renamed into place, replacing one of the same name unless dsedge exported "
                   "that one for another target; other models are kept).")
@click.option("--platform", type=click.Choice(PLATFORMS), default=None,
              help="Triton backend: onnxruntime (default on CPU, and on GPU without an engine in the bundle), "
                   "tensorrt (engine or trtexec command), python (model.py running dsedge's Session).")
@click.option("--instances", type=click.IntRange(min=1), default=None,
              help="Model instances per device (instance_group count). Default 1.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="ONNX Runtime intra-op threads per instance (python and onnxruntime platforms).")
@click.option("--json", "as_json", is_flag=True, help="Print the models and their batching settings as JSON.")
@click.pass_context
def triton(ctx: click.Context, bundle: str, out: str, platform: str | None, instances: int | None,
           threads: int | None, as_json: bool) -> None:
    """Write a Triton model repository for BUNDLE: one model per variant, config.pbtxt derived from the bundle."""
    from ..triton import export_triton

    quiet = ctx.meta.get("dsedge.verbosity", 0) < 0  # -q: the repository and its models, no notes or next step

    result = export_triton(bundle, out, platform=platform, instances=instances, threads=threads)
    models = [{"name": m.name, "variant": m.variant, "platform": m.platform,
               "max_batch_size": m.policy.max_batch_size, "preferred_batch_size": list(m.policy.preferred_batch_sizes),
               "max_queue_delay_us": m.policy.max_queue_delay_us, "timeout_us": m.policy.timeout_us,
               "max_queue_size": m.policy.max_queue_size, "notes": [*m.policy.derived_from, *m.notes]}
              for m in result.models]
    if as_json:
        click.echo(json.dumps({"repository": str(result.repository), "models": models}, indent=2))
        return
    click.echo(f"wrote Triton model repository {result.repository}")
    for m in models:
        click.echo(f"  {m['name']} ({m['platform']}): max_batch_size {m['max_batch_size']}, preferred "
                   f"{m['preferred_batch_size']}, max_queue_delay {m['max_queue_delay_us']} µs, "
                   f"REJECT after {m['timeout_us']} µs queued")
        for n in [] if quiet else m["notes"]:
            if ("build_engine.sh" in n or "rewritten" in n or "TensorRT accelerator" in n or VERSION_COMPATIBLE_FLAG in n
                    or n.startswith("1/model.plan is")):
                click.echo(f"    {n}")
    if not quiet:
        extra = (f" {VERSION_COMPATIBLE_FLAG}" if any(VERSION_COMPATIBLE_FLAG in n for m in models for n in m["notes"])
                 else "")
        click.echo(f"serve: tritonserver --model-repository={result.repository}{extra}")
