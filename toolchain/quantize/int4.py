"""INT4 weight-only (W4A16) blockwise quantization in standard Q/DQ ONNX form.

Every MatMul and Gemm weight initializer (and, optionally, vocabulary-sized Gather tables) is replaced by a 4-bit
initializer plus fp32 scales feeding ``DequantizeLinear(axis, block_size)`` (ONNX opset 21 spec: blocked
quantization), whose output keeps the weight's original name, so every consumer is unchanged. Blocks run along the
input dimension K (``block_size`` weights share one scale). TensorRT (10.x) reads this form for GEMM weights; ORT CPU
fuses DequantizeLinear+MatMul into MatMulNBits at load.

Round-to-nearest (RTN) is the baseline algorithm, computed by :mod:`.blockwise` (the one INT4 quantizer); AWQ (arXiv:2306.00978) and GPTQ (arXiv:2210.17323) produce codes and
scales that ``write_int4_dq`` places in the same form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ...runtime.errors import QuantizationError
from .blockwise import dequantize_blockwise, quantize_blockwise

INT4_MIN, INT4_MAX = -8, 7
UINT4_MAX = 15


@dataclass
class WeightSite:
    """A weight initializer to quantize: ``axis`` is its K (reduction) axis, ``op`` the consuming node type."""

    name: str
    op: str
    node: str
    axis: int
    shape: tuple[int, ...]


#: Clip ratios of the RTN scale search (``quantize_int4``, INT4 embedding tables): 0.70 … 8/7 — above 1 the code -8
#: becomes reachable for the block's largest magnitude.
RTN_CLIP_GRID = tuple(float(r) for r in np.linspace(0.70, 8 / 7, 23))


def quantize_site(w: np.ndarray, axis: int, block_size: int, symmetric: bool = True,
                  scale_search: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """RTN 4-bit codes of a 2-D weight blocked along ``axis`` (the site's K), through ``blockwise.quantize_blockwise``
    (the one INT4 quantizer), with the per-block MSE scale search over ``RTN_CLIP_GRID`` unless ``scale_search`` is
    False.

    Returns:
        (codes int8 / uint8 with ``w``'s shape, scales float32, zero points uint8 or None), scales and zero points
        with ``axis`` reduced to ceil(K / block_size): what ``write_int4_dq`` writes.
    """
    kn = np.moveaxis(np.asarray(w, dtype=np.float32), axis, 0)
    q = quantize_blockwise(kn, bits=4, block_size=block_size, symmetric=symmetric, clip_search=scale_search,
                           clip_grid=RTN_CLIP_GRID)
    codes = np.moveaxis(q.codes.astype(np.int8 if symmetric else np.uint8), 0, axis)
    zp = None if q.zero_points is None else np.moveaxis(q.zero_points.astype(np.uint8), 0, axis)
    return codes, np.ascontiguousarray(np.moveaxis(q.scales, 0, axis)), zp


def dequantize_site(codes: np.ndarray, scales: np.ndarray, axis: int, block_size: int,
                    zero_points: np.ndarray | None = None) -> np.ndarray:
    """Inverse of ``quantize_site``: float32 weights (what DequantizeLinear computes)."""
    zp = None if zero_points is None else np.moveaxis(zero_points, axis, 0)
    kn = dequantize_blockwise(np.moveaxis(codes, axis, 0), np.moveaxis(scales, axis, 0), zp, block_size)
    return np.moveaxis(kn, 0, axis)


def find_weight_sites(model: Any, embeddings: bool = True, min_vocab: int = 1024,
                      nodes: Iterable[str] | None = None) -> list[WeightSite]:
    """MatMul/Gemm weight initializers (rank 2) and, with ``embeddings``, Gather tables with >= ``min_vocab`` rows.

    Position and token-type tables stay in float: they are small and accuracy-sensitive. Only fp32 initializers are
    weights here: an integer table a Gather reads (ids, a lookup) is data, and a DequantizeLinear in its place would
    feed float where the graph takes integers. ``nodes`` restricts the search to those node names. Each initializer
    appears once (its first consumer decides the axis).
    """
    from onnx import TensorProto, helper

    inits = {t.name: t for t in model.graph.initializer}
    wanted = set(nodes) if nodes is not None else None
    sites: dict[str, WeightSite] = {}
    for node in model.graph.node:
        if wanted is not None and node.name not in wanted:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in inits:
            t = inits[node.input[1]]
            if len(t.dims) != 2 or t.data_type != TensorProto.FLOAT:
                continue
            axis = 1 if (node.op_type == "Gemm" and attrs.get("transB", 0)) else 0
            sites.setdefault(t.name, WeightSite(t.name, node.op_type, node.name, axis, tuple(t.dims)))
        elif embeddings and node.op_type == "Gather" and node.input[0] in inits and attrs.get("axis", 0) == 0:
            t = inits[node.input[0]]
            if len(t.dims) == 2 and t.dims[0] >= min_vocab and t.data_type == TensorProto.FLOAT:
                sites.setdefault(t.name, WeightSite(t.name, "Gather", node.name, 1, tuple(t.dims)))
    return list(sites.values())


def write_int4_dq(model: Any, site: WeightSite, codes: np.ndarray, scales: np.ndarray, block_size: int,
                  zero_points: np.ndarray | None = None) -> Any:
    """Replace initializer ``site.name`` by INT4/UINT4 codes + scales feeding a DequantizeLinear named after it."""
    import ml_dtypes
    from onnx import helper, numpy_helper

    g = model.graph
    idx = next(i for i, t in enumerate(g.initializer) if t.name == site.name)
    del g.initializer[idx]
    for i, vi in enumerate(g.input):  # older exporters also list initializers as inputs
        if vi.name == site.name:
            del g.input[i]
            break
    qtype = ml_dtypes.int4 if zero_points is None else ml_dtypes.uint4
    q_name, s_name = f"{site.name}_int4", f"{site.name}_scale"
    g.initializer.extend([numpy_helper.from_array(codes.astype(qtype), q_name),
                          numpy_helper.from_array(scales.astype(np.float32), s_name)])
    inputs = [q_name, s_name]
    if zero_points is not None:
        z_name = f"{site.name}_zero_point"
        g.initializer.append(numpy_helper.from_array(zero_points.astype(ml_dtypes.uint4), z_name))
        inputs.append(z_name)
    dq = helper.make_node("DequantizeLinear", inputs, [site.name], name=f"{site.name}_DequantizeLinear",
                          axis=site.axis, block_size=block_size)
    g.node.insert(0, dq)
    return model


def ensure_opset21(model: Any) -> Any:
    """Blocked DequantizeLinear needs opset >= 21 (and IR version >= 10)."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if version < 21:
        from ..opset import upgrade_opset

        model = upgrade_opset(model, 21)
    model.ir_version = max(model.ir_version, 10)
    return model


def quantize_int4(model: Any, *, block_size: int = 32, symmetric: bool = True, embeddings: bool = True,
                  nodes: Iterable[str] | None = None, min_vocab: int = 1024,
                  scale_search: bool = True) -> tuple[Any, dict[str, Any]]:
    """RTN INT4 weight-only quantization of an ONNX model (modified in place and returned).

    Args:
        model: ``onnx.ModelProto`` with float32 weights as initializers.
        block_size: weights per scale along K: 16, 32, 64 or 128.
        symmetric: int4 without zero points (TensorRT's INT4 dequantize needs symmetric); else uint4 + zero points.
        embeddings: also quantize vocabulary Gather tables (rows >= ``min_vocab``), blocked along the hidden dim.
        nodes: only these node names (default: all).
        scale_search: pick each block's scale by a grid search minimizing its rounding MSE (still round-to-nearest
            codes); False gives plain absmax RTN.
    Returns:
        (model, report) — report has ``layers`` (name, op, shape, axis, bytes before/after, relative RMS error),
        ``bytes_before``/``bytes_after`` (weight bytes), ``block_size``, ``symmetric``.
    Raises:
        QuantizationError: bad block size, no MatMul/Gemm weight found, or NaN/Inf in a weight (names the layer).
    """
    from onnx import numpy_helper

    if block_size not in (16, 32, 64, 128):
        raise QuantizationError(f"block size {block_size} is not supported", "use 16, 32, 64 or 128")
    model = ensure_opset21(model)
    sites = find_weight_sites(model, embeddings=embeddings, min_vocab=min_vocab, nodes=nodes)
    if not any(s.op in ("MatMul", "Gemm") for s in sites):
        raise QuantizationError("no MatMul or Gemm with a constant 2-D weight was found",
                                "INT4 weight-only needs linear layers whose weights are initializers")
    inits = {t.name: t for t in model.graph.initializer}
    layers = []
    before = after = 0
    for site in sites:
        w = numpy_helper.to_array(inits[site.name]).astype(np.float32)
        if not np.isfinite(w).all():
            raise QuantizationError(f"weight {site.name!r} of {site.op} node {site.node!r} has NaN or Inf values",
                                    "fix the checkpoint before quantizing")
        codes, scales, zp = quantize_site(w, site.axis, block_size, symmetric, scale_search)
        deq = dequantize_site(codes, scales, site.axis, block_size, zp)
        err = float(np.sqrt(np.mean((deq - w) ** 2)) / (np.sqrt(np.mean(w ** 2)) + 1e-12))
        write_int4_dq(model, site, codes, scales, block_size, zp)
        b0 = w.size * 4
        b1 = (w.size + 1) // 2 + scales.size * 4 + (0 if zp is None else (zp.size + 1) // 2)
        before += b0
        after += b1
        layers.append({"name": site.name, "op": site.op, "node": site.node, "shape": list(site.shape),
                       "axis": site.axis, "bytes_before": b0, "bytes_after": b1, "rel_rms_error": round(err, 5)})
    report = {"algorithm": "rtn-mse" if scale_search else "rtn", "block_size": block_size, "symmetric": symmetric, "embeddings": embeddings,
              "layers": layers, "bytes_before": before, "bytes_after": after}
    return model, report


def per_channel_int4_as_blocks(model: Any) -> int:
    """In place: every per-channel INT4/UINT4 DequantizeLinear of a 2-D weight (no ``block_size``: the form
    ``graph.write_blockwise_weight`` gives a weight whose K fits in one block) rewritten as one block along K
    (``block_size`` = K, scales ``[1, N]``, or ``[N, 1]`` for a ``[N, K]`` weight): the same codes and scales, so the
    same values, in the blockwise form TensorRT's INT4 takes. Returns how many were rewritten."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    done = 0
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or not node.input or node.input[0] not in inits:
            continue
        x = inits[node.input[0]]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if x.data_type not in (TensorProto.INT4, TensorProto.UINT4) or len(x.dims) != 2 or attrs.get("block_size"):
            continue
        k_axis = 1 - (attrs.get("axis", 1) % 2)              # the per-channel axis is N; the blocks run along K
        shape = [1, -1] if k_axis == 0 else [-1, 1]
        for name in node.input[1:3]:                        # scales, then the zero point when there is one
            if name and name in inits:
                t = inits[name]
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).reshape(shape), name))
        kept = [a for a in node.attribute if a.name not in ("axis", "block_size")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("axis", k_axis),
                               helper.make_attribute("block_size", int(x.dims[k_axis]))])
        done += 1
    return done
