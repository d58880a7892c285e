"""``build/trtexec.sh``: the exact trtexec commands a user runs on the device to build each variant's engine."""
from __future__ import annotations

from ..targets import Target


def _shape_arg(inputs: list[dict], shape_ranges: dict, key: str) -> str:
    parts = []
    for spec in inputs:
        dims = [str(d) if isinstance(d, int) else str(shape_ranges.get(d, {}).get(key, 1)) for d in spec["shape"]]
        parts.append(f"{spec['name']}:{'x'.join(dims)}")
    return ",".join(parts)


def trtexec_script(target: Target, variants: list[dict], inputs: list[dict], shape_ranges: dict) -> str:
    """Bash script text with one ``trtexec`` command per variant (TensorRT 10.x flag spellings)."""
    lines = ["#!/usr/bin/env bash", f"# Build TensorRT engines for {target.name} ({target.description}).",
             "# Run from the bundle directory on the device.", "set -euo pipefail", "mkdir -p engines", ""]
    for v in variants:
        flags = [f"--onnx={v['file']}", f"--saveEngine=engines/{v['name']}.plan"]
        if v["precision"] in ("int4", "int8"):
            flags.append("--stronglyTyped")
        elif v["precision"] in ("fp16", "bf16"):
            flags.append(f"--{v['precision']}")
        if any(isinstance(d, str) for s in inputs for d in s["shape"]):
            for key, flag in (("min", "--minShapes"), ("opt", "--optShapes"), ("max", "--maxShapes")):
                flags.append(f"{flag}={_shape_arg(inputs, shape_ranges, key)}")
        if target.workspace_mb:
            flags.append(f"--memPoolSize=workspace:{target.workspace_mb}M")
        flags.append("--timingCacheFile=engines/timing.cache")
        lines.append(f"# variant {v['name']} ({v['precision']})")
        lines.append("trtexec " + " \\\n    ".join(flags))
        lines.append("")
    return "\n".join(lines)
