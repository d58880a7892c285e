"""Stage ``engine_recipe``: the bundle's ``build/trtexec.sh`` and its notes, the shape ranges of the optimization
profile, and with ``--engine`` the TensorRT engines built on this machine."""
from __future__ import annotations

import os
from pathlib import Path

from ...runtime.bundle import Variant
from ...targets import Target
from ..artifacts import Prepared, Recipe, VariantDraft
from ..config import BuildPlan
from ..export import Exported
from ..recipe import recipe_notes, trtexec_script
from ..sources import Source


def engine_recipe(plan: BuildPlan, model: Prepared, variants: list[VariantDraft], work: Path) -> Recipe:
    """trtexec script + notes per variant (2:4-sparse variants get ``--sparsity=enable``), and ``--engine``'s
    engines (``engines/NAME.engine``). Raises BackendUnavailable / TargetError from ``build_engines``."""
    target, cfg = plan.target, plan.config
    ranges = shape_ranges_for(model.exported, target, model.source)
    sparse = {"sparsity": "2:4"} if plan.prune is not None and plan.prune.pattern == "2:4" else {}
    vdicts = [{"name": v.name, "precision": v.precision, "file": v.file, **_graph_facts(v.path), **sparse}
              for v in variants]
    io = [s.to_dict() for s in model.exported.inputs]
    files: dict[str, str | bytes] = {"build/trtexec.sh": trtexec_script(target, vdicts, io, ranges,
                                                                         dla_core=cfg.dla_core)}
    notes = recipe_notes(target, vdicts, io, ranges, dla_core=cfg.dla_core)
    if cfg.engine:
        files.update(build_engines(work, target, model.exported, [v.to_variant() for v in variants], ranges,
                                   model.source.name, cfg.dla_core))
    return Recipe(ranges, notes, files, tuple(sorted(k for k in files if k.startswith("engines/"))))


def shape_ranges_for(exported: Exported, target: Target, source: Source) -> dict[str, dict[str, int]]:
    """min/opt/max per symbolic dim: the target profile's for ``batch``/``sequence``, else the example's size."""
    ranges: dict[str, dict[str, int]] = {}
    for spec in exported.inputs:
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str) and d not in ranges:
                if d in target.shapes:
                    ranges[d] = dict(target.shapes[d])
                else:
                    n = int(source.example_inputs[spec.name].shape[axis]) if spec.name in source.example_inputs else 1
                    ranges[d] = {"min": 1, "opt": n, "max": max(n, 1)}
    return ranges


def _graph_facts(path: Path) -> dict:
    """What the recipe's notes read from a variant's graph: ``ops`` (its op types), ``dq_gather`` (a
    DequantizeLinear feeds a Gather: a quantized embedding table), ``dq_unparsable`` (the DequantizeLinear inputs
    TensorRT's ONNX parser refuses: a UINT4 or INT32 (quantized bias) tensor, or a non-zero zero point; TensorRT
    quantizes symmetrically), ``int4_blocks`` (the block sizes of its INT4 DequantizeLinear nodes, 0 for one
    without blocks) and ``conv_spatial`` (the most spatial dims of a Conv/ConvTranspose weight initializer; 0
    without one; a weight behind a DequantizeLinear counts through it)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    from ...runtime.backends.ort_rewrites import int4_block_sizes

    m = onnx.load(os.fspath(path), load_external_data=False)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    dq_out = {n.output[0]: n for n in g.node if n.op_type == "DequantizeLinear"}
    bad = []
    for n in dq_out.values():
        x = inits.get(n.input[0])
        zp = inits.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if x is not None and x.data_type in (TensorProto.UINT4, TensorProto.INT32):  # INT32: a quantized bias
            bad.append(n.name or n.output[0])
        elif zp is not None and zp.data_location != TensorProto.EXTERNAL and np.any(
                numpy_helper.to_array(zp).astype(np.int64) != 0):
            bad.append(n.name or n.output[0])

    def weight(name: str) -> str:  # through a DequantizeLinear (an INT8 Q/DQ CNN's weights)
        return dq_out[name].input[0] if name in dq_out else name

    conv_spatial = max((len(inits[weight(n.input[1])].dims) - 2 for n in g.node
                        if n.op_type in ("Conv", "ConvTranspose") and len(n.input) > 1
                        and weight(n.input[1]) in inits), default=0)
    return {"ops": sorted({n.op_type for n in g.node}),
            "dq_gather": any(n.op_type == "Gather" and n.input and n.input[0] in dq_out for n in g.node),
            "dq_unparsable": bad, "conv_spatial": conv_spatial, "int4_blocks": sorted(int4_block_sizes(m))}


def build_engines(work: Path, target: Target, exported: Exported, variants: list[Variant],
                  ranges: dict[str, dict[str, int]], name: str, dla_core: int | None) -> dict[str, bytes]:
    """``--engine``: build each variant's TensorRT engine on this machine (TensorRT and the target's GPU needed).

    Raises:
        BackendUnavailable: no TensorRT or no GPU here. TargetError: this GPU is not the target's.
    """
    from ...runtime.backends.tensorrt import build_engine_file
    from ...runtime.bundle import Manifest

    manifest = Manifest(name=name, target=target.to_dict(), inputs=exported.inputs, outputs=exported.outputs,
                        variants=variants, default_variant=variants[0].name, shape_ranges=ranges)
    out: dict[str, bytes] = {}
    for v in variants:
        path = build_engine_file(work, manifest, v, work / "engines", dla_core=dla_core)
        out[f"engines/{path.name}"] = path.read_bytes()
    return out
