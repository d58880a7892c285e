"""FP16 / BF16 conversion of an fp32 ONNX model, keeping FP32 islands where 16-bit overflows or loses too much.

Every float tensor becomes FP16 (or BF16), except:
- *island* ops (LayerNormalization, Softmax, reductions, L2-normalization, Pow/Sqrt/Exp/Log …) compute in FP32:
  their float inputs are cast to FP32 and their outputs cast back (the known TensorRT FP16 failure kinds: variance
  and sum-of-squares overflow past 65504, softmax/exp saturation);
- initializers read only by islands stay FP32 (LayerNorm gamma/beta keep full precision);
- graph inputs and outputs keep their FP32 type (a Cast at each), so the model's IO contract does not change;
- inputs ONNX requires as float32 (Resize's roi/scales) stay FP32;
- ops whose ONNX schema at the model's opset has no such 16-bit type are islands too (BF16 Conv, MaxPool,
  AveragePool and GlobalAveragePool came only with opset 22): a BF16 Conv below it is a model no runtime loads;
- control-flow nodes (If, Loop, Scan: any node with a subgraph) are islands too, their bodies left as they are: a
  body reads outer-scope tensors by name, so converting an initializer it reads (and not the body) gave a model ONNX
  Runtime refuses to load. The float tensors a body reads from the outer graph are read in FP32 (a Cast where the
  outer tensor became 16-bit), and the initializers only such bodies or islands read stay FP32.
Initializer values beyond the 16-bit range are clamped to it and counted in the report. BF16 is for targets that
have it (A100, H100); ORT CPU runs few BF16 kernels.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...runtime.errors import QuantizationError

FP32_ISLAND_OPS = frozenset({
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "GroupNormalization",
    "InstanceNormalization", "LpNormalization", "Softmax", "LogSoftmax", "ReduceMean", "ReduceSum",
    "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd", "Pow", "Sqrt",
    "Reciprocal", "Exp", "Log", "CumSum", "Range",
})
# inputs that ONNX types as float32 whatever the data type (op → input positions)
FP32_INPUT_POSITIONS = {"Resize": (1, 2), "Upsample": (1,)}
FP16_MAX = 65504.0


def _np_dtype(elem: int):
    if elem == TensorProto.BFLOAT16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float16


def _convert_tensor(t: onnx.TensorProto, elem: int) -> tuple[onnx.TensorProto, int]:
    a = numpy_helper.to_array(t).astype(np.float32)
    limit = FP16_MAX if elem == TensorProto.FLOAT16 else float(np.finfo(np.float32).max)
    clamped = int(np.count_nonzero(np.abs(a[np.isfinite(a)]) > limit))
    a = np.where(np.isfinite(a), np.clip(a, -limit, limit), a)
    return numpy_helper.from_array(a.astype(_np_dtype(elem)), t.name), clamped


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies of a control-flow ``node`` (If's branches, Loop's and Scan's body; any GRAPH/GRAPHS attribute)."""
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` (a subgraph, nested bodies included) reads from its enclosing scopes, in first-read order."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer} \
        | {t.name for t in graph.sparse_initializer}
    reads: dict[str, None] = {}
    for n in graph.node:
        for inp in n.input:
            if inp and inp not in local:
                reads[inp] = None
        for sub in _subgraphs(n):
            for inp in _outer_reads(sub):
                if inp not in local:
                    reads[inp] = None
        local.update(o for o in n.output if o)
    return list(reads)


def _outer_reads_of(node: onnx.NodeProto) -> list[str]:
    """Names the bodies of ``node`` read from the graph ``node`` is in (its implicit inputs)."""
    return list(dict.fromkeys(t for sub in _subgraphs(node) for t in _outer_reads(sub)))


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Make ``graph`` and its nested bodies read ``new`` wherever they read the outer-scope tensor ``old`` (ONNX
    forbids a subgraph to redefine an outer name, so every read of ``old`` in it is the outer one)."""
    for n in graph.node:
        for j, inp in enumerate(n.input):
            if inp == old:
                n.input[j] = new
        for sub in _subgraphs(n):
            _rename_reads(sub, old, new)
    for o in graph.output:                 # a body may return an outer tensor unchanged
        if o.name == old:
            o.name = new


def _refuses(node: onnx.NodeProto, low: int, opsets: dict[str, int], is_float) -> bool:  # type: ignore[no-untyped-def]
    """Whether ONNX's schema of ``node`` at the model's opset refuses ``low`` (FLOAT16 / BFLOAT16) for one of its float
    inputs or outputs, so converting it would give a model no runtime loads: e.g. BF16 for Conv, MaxPool or
    GlobalAveragePool before opset 22, BatchNormalization before 15. Such a node is an FP32 island (both dtypes);
    positions ONNX types as float32 anyway (:data:`FP32_INPUT_POSITIONS`) are not asked; an op without a known schema
    (another domain) is left as it is."""
    version = opsets.get(node.domain or "", opsets.get("ai.onnx"))
    if version is None:
        return False
    try:
        schema = onnx.defs.get_schema(node.op_type, version, node.domain or "")
    except onnx.defs.SchemaError:
        return False
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    want = "tensor(bfloat16)" if low == TensorProto.BFLOAT16 else "tensor(float16)"

    def refused(formals, names: list[str], skip: tuple[int, ...] = ()) -> bool:
        for j, name in enumerate(names):
            if j in skip or not is_float(name) or not formals:
                continue
            type_str = formals[min(j, len(formals) - 1)].type_str
            if want not in allowed.get(type_str, {type_str}):
                return True
        return False

    return (refused(schema.inputs, list(node.input), FP32_INPUT_POSITIONS.get(node.op_type, ()))
            or refused(schema.outputs, list(node.output)))


def convert_float16(model: onnx.ModelProto, *, dtype: str = "fp16", island_ops: frozenset[str] = FP32_ISLAND_OPS,
                    keep_fp32_nodes: list[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """A copy of the fp32 ``model`` computing in FP16 (``dtype="fp16"``) or BF16 (``"bf16"``) with FP32 islands.

    Args:
        island_ops: op types computed in FP32 (default :data:`FP32_ISLAND_OPS`); nodes with subgraphs (If, Loop,
            Scan) are always islands, their bodies unchanged.
        keep_fp32_nodes: extra node names computed in FP32 (e.g. layers the accuracy gate raised).
    Returns:
        (model, report) — report lists ``fp32_nodes`` (names of island nodes), ``fp32_untyped_nodes`` (those among
        them because ONNX's schema at the model's opset has no 16-bit type for them: :func:`_refuses`; then also
        ``fp32_untyped_note``, one line naming them by op type and the opset that has the type),
        ``casts_inserted``, ``clamped`` (initializer values clamped to the 16-bit range).
    Raises:
        QuantizationError for an unknown dtype or a model that is not fp32.
    """
    if dtype not in ("fp16", "bf16"):
        raise QuantizationError(f"unknown float precision {dtype!r}", "use fp16 or bf16")
    low = TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.BFLOAT16
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for i, node in enumerate(g.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    inferred = onnx.shape_inference.infer_shapes(m)
    types: dict[str, int] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    inits = {t.name: t for t in g.initializer}
    for t in g.initializer:
        types[t.name] = t.data_type
    if not any(types.get(t) == TensorProto.FLOAT for t in types):
        raise QuantizationError("the model has no float32 tensor to convert", "give an fp32 model")
    is_float = lambda name: bool(name) and types.get(name) == TensorProto.FLOAT  # noqa: E731
    keep = set(keep_fp32_nodes or [])
    island = {n.name for n in g.node if n.op_type in island_ops or n.name in keep or _subgraphs(n)}
    opsets = {o.domain or "": o.version for o in m.opset_import}
    untyped = {n.name for n in g.node if n.name not in island and _refuses(n, low, opsets, is_float)}
    island |= untyped
    # named before the rewiring below renames their inputs (the opset that types them is asked on the fp32 graph)
    note = _untyped_note(dtype, [n for n in g.node if n.name in untyped], low, opsets, is_float) if untyped else None
    # what each control-flow node's bodies read from the main graph (float only): read in FP32, like an island input
    implicit = {n.name: [t for t in _outer_reads_of(n) if is_float(t)] for n in g.node if _subgraphs(n)}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for n in g.node:
        for j, inp in enumerate(n.input):
            consumers[inp].append((n, j))
        for inp in implicit.get(n.name, []):
            consumers[inp].append((n, -1))             # -1: read by a body, not a position of n.input
    graph_inputs = {i.name for i in g.input if is_float(i.name)}
    graph_outputs = {o.name for o in g.output if is_float(o.name)}

    def needs_fp32(n: onnx.NodeProto, j: int) -> bool:
        return n.name in island or j in FP32_INPUT_POSITIONS.get(n.op_type, ())

    keep_init = {name for name in inits if is_float(name)
                 and consumers.get(name) and all(needs_fp32(n, j) for n, j in consumers[name])}
    new_nodes: list[onnx.NodeProto] = []
    casts = 0
    # graph inputs: one Cast to 16-bit, read by every non-island consumer
    for name in sorted(graph_inputs):
        low_readers = [(n, j) for n, j in consumers.get(name, []) if not needs_fp32(n, j)]
        if not low_readers:                              # e.g. read only by an If's branches: no dead Cast
            continue
        low_name = f"{name}_{dtype}"
        new_nodes.append(helper.make_node("Cast", [name], [low_name], name=f"{name}_to_{dtype}", to=low))
        casts += 1
        for n, j in low_readers:
            n.input[j] = low_name
    fp32_of: dict[str, str] = {}                         # island output → its fp32 tensor name
    for n in g.node:
        pre, post = [], []
        for j, inp in enumerate(n.input):
            if not is_float(inp) or not needs_fp32(n, j) or inp in graph_inputs or inp in keep_init:
                continue
            if inp in fp32_of:                              # produced by an island: read its fp32 value directly
                n.input[j] = fp32_of[inp]
                continue
            up = f"{inp}_fp32_for_{n.name}"
            pre.append(helper.make_node("Cast", [inp], [up], name=f"{n.name}_in{j}_to_fp32", to=TensorProto.FLOAT))
            n.input[j] = up
        for inp in implicit.get(n.name, []):              # outer tensors a body reads: FP32 under another name
            if inp in graph_inputs or inp in keep_init or fp32_of.get(inp) == inp:
                continue
            if inp in fp32_of:
                up = fp32_of[inp]
            else:
                up = f"{inp}_fp32_for_{n.name}"
                pre.append(helper.make_node("Cast", [inp], [up], name=f"{n.name}_{inp}_to_fp32",
                                            to=TensorProto.FLOAT))
            for sub in _subgraphs(n):
                _rename_reads(sub, inp, up)
        if n.name in island:
            for j, out in enumerate(n.output):
                if not is_float(out):
                    continue
                low_readers = [(c, k) for c, k in consumers.get(out, []) if not needs_fp32(c, k)]
                if out in graph_outputs:                    # stays fp32 under its own name
                    fp32_of[out] = out
                    if low_readers:
                        post.append(helper.make_node("Cast", [out], [f"{out}_{dtype}"],
                                                     name=f"{n.name}_out{j}_to_{dtype}", to=low))
                        for c, k in low_readers:
                            c.input[k] = f"{out}_{dtype}"
                    continue
                hi = f"{out}_fp32"
                n.output[j] = hi
                fp32_of[out] = hi
                if low_readers:                              # back to 16-bit only for non-island readers
                    post.append(helper.make_node("Cast", [hi], [out], name=f"{n.name}_out{j}_to_{dtype}", to=low))
        else:
            for a in n.attribute:
                if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = low
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(_convert_tensor(a.t, low)[0])
            for j, out in enumerate(n.output):
                if out in graph_outputs:                      # back to fp32 at the graph boundary
                    low_name = f"{out}_{dtype}"
                    n.output[j] = low_name
                    post.append(helper.make_node("Cast", [low_name], [out], name=f"{out}_to_fp32",
                                                 to=TensorProto.FLOAT))
                    for c, k in consumers.get(out, []):
                        if not needs_fp32(c, k):
                            c.input[k] = low_name
        casts += len(pre) + len(post)
        new_nodes += pre + [n] + post
    clamped = 0
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT and t.name not in keep_init:
            conv, c = _convert_tensor(t, low)
            clamped += c
            t.CopyFrom(conv)
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    report = {"precision": dtype, "fp32_nodes": sorted(island), "fp32_initializers": sorted(keep_init),
              "casts_inserted": casts, "clamped": clamped, "fp32_untyped_nodes": sorted(untyped)}
    if note:
        report["fp32_untyped_note"] = note
    return m, report


def _typed_from(node: onnx.NodeProto, low: int, opsets: dict[str, int], is_float: Callable[[str], bool]) -> int | None:
    """The first opset above the model's whose schema of ``node`` takes ``low``, or None (none yet, or another
    domain)."""
    domain = node.domain or ""
    if domain not in ("", "ai.onnx") or domain not in opsets:
        return None
    for v in range(opsets[domain] + 1, onnx.defs.onnx_opset_version() + 1):
        if not _refuses(node, low, {**opsets, domain: v}, is_float):
            return v
    return None


def _untyped_note(dtype: str, nodes: list[onnx.NodeProto], low: int, opsets: dict[str, int],
                  is_float: Callable[[str], bool]) -> str:
    """``"bf16: 2 Conv, 1 GlobalAveragePool stay FP32: ONNX has no BF16 for them before opset 22 (the model's opset:
    17)"``: what :func:`_refuses` kept FP32, by op type, and the opset that would convert them."""
    counts: dict[str, int] = defaultdict(int)
    first: dict[str, int | None] = {}
    for n in nodes:
        counts[n.op_type] += 1
        first.setdefault(n.op_type, _typed_from(n, low, opsets, is_float))
    ops = ", ".join(f"{c} {op}" for op, c in sorted(counts.items()))
    verb = "stays" if sum(counts.values()) == 1 else "stay"
    model_opset = opsets.get("", opsets.get("ai.onnx"))
    at = set(first.values())
    if at == {None}:
        why = "in any opset"
    elif len(at) == 1:
        why = f"before opset {at.pop()} (the model's opset: {model_opset})"
    else:
        by = ", ".join(f"{op} from opset {v}" if v else f"{op} in none yet" for op, v in sorted(first.items()))
        why = f"at the model's opset {model_opset} ({by})"
    return f"{dtype}: {ops} {verb} FP32: ONNX has no {dtype.upper()} for {'it' if verb == 'stays' else 'them'} {why}"
