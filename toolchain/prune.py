"""Pruning of ONNX models: 2:4 semi-structured sparsity and structured (channel) pruning of MLP blocks.

- **2:4** (``prune_2_4``): in every group of 4 consecutive input channels (K) of each output column of a
  MatMul/Gemm weight, the 2 least important weights are zeroed — the pattern Ampere+ sparse tensor cores run
  (TensorRT ``--sparsity=enable``; A100 and Orin). Importance is ``|w| * ||x_k||`` (Wanda, arXiv:2306.11695) with
  calibration data, else ``|w|``. A Conv weight ``[K, C/groups, kh, kw]`` gets the pattern TensorRT's structured
  sparsity asks of a convolution: for each output channel and each kernel position, 2 of every 4 consecutive input
  channels are zero (by ``|w|``; C/groups a multiple of 4, else the layer is skipped).
- **Channels** (``prune_channels``): hidden channels of ``MatMul/Gemm(W1) [+ bias] → elementwise activation →
  MatMul/Gemm(W2)`` blocks (transformer FFNs, MLPs; a Gemm as torch exports ``nn.Linear``: ``transB=1``, the bias
  as C) are removed — columns of W1 and the bias, rows of W2 — to a global
  sparsity target, lowest importance first across all blocks; importance of hidden channel j is
  ``||W1[:, j]|| * ||W2[j, :]||`` (times the channel's RMS activation with calibration data). The graph gets
  really smaller. ONNX weights cannot be fine-tuned here: to recover accuracy, prune the torch model instead
  (``dsedge.toolchain.prune_torch`` + ``dsedge.toolchain.finetune``, i.e. ``dsedge build --prune channels:0.3``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from ..runtime.errors import QuantizationError
from .quantize.blockwise import check_finite
from .quantize.graph import initializers, select_layers, set_weight, weight_kn

ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Sigmoid", "Relu", "Gelu", "FastGelu",
                         "LeakyRelu", "Pow", "Sqrt", "Exp", "HardSigmoid", "HardSwish", "Softplus", "Clip",
                         "Identity", "Cast"})


def nm_mask(w: np.ndarray, n: int = 2, m: int = 4, importance: np.ndarray | None = None) -> np.ndarray:
    """Boolean keep-mask ``[K, N]`` keeping the ``n`` most important of every ``m`` consecutive rows (K) per column.

    ``importance``: float ``[K]`` per-input-channel scale (e.g. ``||x_k||``); K must be a multiple of ``m``.
    """
    k, cols = w.shape
    if k % m:
        raise QuantizationError(f"{n}:{m} sparsity needs K divisible by {m}, got K={k}", "skip this layer")
    score = np.abs(w) * (1.0 if importance is None else np.asarray(importance, np.float32)[:, None])
    g = score.reshape(k // m, m, cols)
    order = np.argsort(g, axis=1)                                  # ascending
    keep = np.ones_like(g, dtype=bool)
    np.put_along_axis(keep, order[:, : m - n, :], False, axis=1)
    return keep.reshape(k, cols)


def prune_2_4(model: onnx.ModelProto, activations: dict[str, np.ndarray] | None = None, *,
              nodes: list[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """A copy of ``model`` whose MatMul/Gemm weights follow 2:4 sparsity along K, and whose Conv weights along the
    input channels (:func:`conv_nm_mask`; by magnitude).

    Args:
        activations: ``{input tensor: [rows, K]}`` calibration activations (Wanda importance for MatMul/Gemm);
            None = magnitude.
        nodes: layers to prune (default all with K (a Conv's C/groups) % 4 == 0; others are listed as skipped).
    Returns:
        (model, report: per-layer sparsity, skipped layers).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    layers, skipped, done = select_layers(out, nodes), [], []
    for layer in layers:
        if layer.k % 4:
            skipped.append(layer.node)
            continue
        w = weight_kn(out, layer)
        check_finite(w, layer.node)
        x = None if activations is None else activations.get(layer.activation)
        imp = None if x is None else np.sqrt((x.astype(np.float64) ** 2).sum(0)).astype(np.float32)
        mask = nm_mask(w, 2, 4, imp)
        set_weight(out, layer, np.where(mask, w, 0.0))
        done.append({"node": layer.node, "sparsity": round(float(1 - mask.mean()), 4)})
    inits = initializers(out)
    for node in out.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in inits \
                or (nodes is not None and node.name not in nodes):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        if w.ndim < 3 or not np.issubdtype(w.dtype, np.floating):
            continue
        if w.shape[1] % 4:  # e.g. a stem reading 3 image channels
            skipped.append(node.name)
            continue
        check_finite(w, node.name)
        mask = conv_nm_mask(w)
        _replace(out, node.input[1], np.where(mask, w, 0).astype(w.dtype))
        done.append({"node": node.name, "op": "Conv", "sparsity": round(float(1 - mask.mean()), 4)})
    return out, {"pattern": "2:4", "layers": done, "skipped": skipped,
                 "importance": "wanda" if activations is not None else "magnitude"}


def conv_nm_mask(w: np.ndarray, n: int = 2, m: int = 4) -> np.ndarray:
    """Boolean keep-mask of a Conv weight ``[K, C, *kernel]`` keeping the ``n`` largest ``|w|`` of every ``m``
    consecutive input channels, for each output channel and kernel position (TensorRT's structured sparsity for
    convolutions). C must be a multiple of ``m``."""
    k, c = w.shape[:2]
    g = np.abs(w).reshape(k, c // m, m, *w.shape[2:])
    order = np.argsort(g, axis=2)                                  # ascending along the group of m channels
    keep = np.ones_like(g, dtype=bool)
    np.put_along_axis(keep, order[:, :, : m - n], False, axis=2)
    return keep.reshape(w.shape)


@dataclass
class MLPBlock:
    """``up`` (MatMul/Gemm, weight [K, H]) → optional bias Add ([H]) → elementwise region → ``down`` ([H, N]).

    ``bias`` names the bias Add node, or ``up`` itself for a Gemm whose C is the [H] bias (torch's Linear)."""

    up: str
    bias: str | None
    down: str
    hidden: int
    region: list[str]


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def find_mlp_blocks(model: onnx.ModelProto) -> list[MLPBlock]:
    """MLP blocks whose hidden width can be pruned: every path from ``up``'s output runs through elementwise ops
    whose other operands are scalars, the [H] bias right after ``up``, or tensors of the region itself (``x · σ(x)``),
    and ends at the one ``down`` layer. A gated FFN (``down(act(gate(x)) · up(x))``, SwiGLU) is not such a block:
    its two branches would have to be cut together."""
    layers = {lay.node: lay for lay in select_layers(model, None)}
    inits = initializers(model)
    consumers = _consumers(model)
    graph_outputs = {o.name for o in model.graph.output}
    nodes = {n.name: n for n in model.graph.node}
    scalar_sizes = {name: int(np.prod(t.dims)) for name, t in inits.items()}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            scalar_sizes[n.output[0]] = int(np.prod(n.attribute[0].t.dims))
    behind = _identity_sources(model)             # a constant read through Identity (torch's shared equal weights)
    blocks = []
    for up in layers.values():
        h = up.n
        start = nodes[up.node].output[0]
        bias = None
        if up.op_type == "Gemm" and len(nodes[up.node].input) > 2 and nodes[up.node].input[2]:
            c = behind.get(nodes[up.node].input[2], nodes[up.node].input[2])  # torch's Linear: the bias as C
            dims = list(inits[c].dims) if c in inits else None
            if dims is None or (int(np.prod(dims)) != 1 and (int(np.prod(dims)) != h or dims[-1] != h)):
                continue                              # C is not a constant [H], [1, H] or scalar
            if int(np.prod(dims)) == h:               # shared with other nodes: prune_channels cuts its own copy
                bias = up.node
        cons = consumers.get(start, [])
        if bias is None and len(cons) == 1 and cons[0].op_type == "Add":
            other = [behind.get(i, i) for i in cons[0].input if i != start]
            if other and other[0] in inits and list(inits[other[0]].dims) == [h]:
                bias = cons[0].name
                start = cons[0].output[0]
        frontier, region, ends, ok = [start], [], set(), True
        seen: set[str] = set()
        while frontier and ok:
            t = frontier.pop()
            if t in graph_outputs or not consumers.get(t):
                ok = False
                break
            for c in consumers[t]:
                if c.name in seen:
                    continue
                if c.name in layers and layers[c.name].activation == t and layers[c.name].k == h:
                    ends.add(c.name)
                    continue
                scalars = [i for i in c.input if i and i != t and scalar_sizes.get(i) == 1]
                region_inputs = [i for i in c.input if i and i not in scalars]
                if c.op_type not in ELEMENTWISE or len(c.output) != 1 or len(region_inputs) > 2:
                    ok = False
                    break
                seen.add(c.name)
                region.append(c.name)
                frontier.append(c.output[0])
        if ok and region:
            # a two-input op of the region whose other operand comes from outside it (a gated FFN's gate branch,
            # a residual) would keep the full width there: cutting this block's channels would break its shape
            inside = {start} | {nodes[r].output[0] for r in region}
            ok = all(i in inside or scalar_sizes.get(i) == 1 for r in region for i in nodes[r].input if i)
        if ok and len(ends) == 1:
            blocks.append(MLPBlock(up.node, bias, ends.pop(), h, region))
    return blocks


def prune_channels(model: onnx.ModelProto, sparsity: float, *, activations: dict[str, np.ndarray] | None = None,
                   min_keep: int = 8, multiple_of: int = 8) -> tuple[onnx.ModelProto, dict]:
    """Remove a global fraction ``sparsity`` of the hidden channels of every MLP block (a copy is returned).

    Channels are ranked together across blocks by ``||W1[:, j]|| * ||W2[j, :]||`` (× RMS of the hidden activation
    feeding ``down`` when ``activations`` has it); each block keeps at least ``min_keep`` channels and a multiple of
    ``multiple_of`` (tensor-core friendly). A weight or bias a pruned block shares with other nodes (torch.onnx.export
    dedups equal initializers, read directly or through Identity nodes) is cut in the block's own copy; the other
    readers keep the whole tensor. Raises QuantizationError when no MLP block is found or ``sparsity`` is outside
    [0, 1).
    """
    if not 0.0 <= sparsity < 1.0:
        raise QuantizationError(f"channel sparsity {sparsity} is outside [0, 1)", "e.g. --channels 0.3")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    blocks = find_mlp_blocks(out)
    if not blocks:
        raise QuantizationError("no prunable MLP block (MatMul/Gemm → elementwise → MatMul/Gemm) found",
                                "channel pruning needs Linear → activation → Linear blocks with constant weights "
                                "whose hidden tensor feeds only the second Linear")
    layers = {lay.node: lay for lay in select_layers(out, None)}
    scores = []
    for b in blocks:
        w1, w2 = weight_kn(out, layers[b.up]), weight_kn(out, layers[b.down])
        s = np.linalg.norm(w1, axis=0) * np.linalg.norm(w2, axis=1)
        x = None if activations is None else activations.get(layers[b.down].activation)
        if x is not None:
            s = s * np.sqrt((x.astype(np.float64) ** 2).mean(0))
        scores.append(s / (s.mean() + 1e-12))                     # comparable across blocks
    flat = np.concatenate(scores)
    n_prune = int(round(sparsity * flat.size))
    threshold = np.sort(flat)[n_prune - 1] if n_prune else -np.inf
    nodes = {n.name: n for n in out.graph.node}
    report, detached = [], set()
    for b, s in zip(blocks, scores):
        keep_n = max(min_keep, int(np.count_nonzero(s > threshold)))
        keep_n = min(b.hidden, -(-keep_n // multiple_of) * multiple_of)
        keep = np.sort(np.argsort(-s)[:keep_n])
        # every tensor cut here must be this block's alone: torch.onnx.export shares equal initializers (BERT's
        # zero-init biases), directly or through Identity nodes, and another layer reading one needs it whole
        up, down = (replace(layers[name], weight=_own_initializer(out, nodes[name], 1, detached))
                    for name in (b.up, b.down))
        w1, w2 = weight_kn(out, up), weight_kn(out, down)
        set_weight(out, up, w1[:, keep])
        set_weight(out, down, w2[keep, :])
        if b.bias:
            bias_node = nodes[b.bias]
            index = (2 if bias_node.op_type == "Gemm"                            # Gemm's own C
                     else next(j for j, i in enumerate(bias_node.input) if i != nodes[b.up].output[0]))
            bname = _own_initializer(out, bias_node, index, detached)
            _replace(out, bname, numpy_helper.to_array(initializers(out)[bname])[..., keep])
        report.append({"up": b.up, "down": b.down, "hidden_before": b.hidden, "hidden_after": int(keep_n)})
    _drop_unread(out, detached)
    _clear_shapes(out)
    before = sum(r["hidden_before"] for r in report)
    after = sum(r["hidden_after"] for r in report)
    return out, {"pattern": "channels", "target_sparsity": sparsity, "sparsity": round(1 - after / before, 4),
                 "blocks": report}


def _identity_sources(model: onnx.ModelProto) -> dict[str, str]:
    """``{output of an Identity chain: the initializer it reads}`` (the graph is in topological order)."""
    inits = initializers(model)
    behind: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "Identity" and n.input and n.output:
            src = behind.get(n.input[0], n.input[0])
            if src in inits:
                behind[n.output[0]] = src
    return behind


def _reads(graph: onnx.GraphProto) -> list[str]:
    """Every tensor name the nodes of ``graph`` read, subgraphs (If/Loop/Scan bodies: outer-scope names) included."""
    names = []
    for n in graph.node:
        names.extend(i for i in n.input if i)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                      list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                names.extend(_reads(g))
    return names


def _own_initializer(model: onnx.ModelProto, node: onnx.NodeProto, index: int, detached: set[str]) -> str:
    """The name of an initializer that ``node.input[index]`` reads and nothing else does, made by copying when
    needed: the input reads an initializer through Identity nodes, or the initializer has other readers (another
    node, a graph output). ``node`` is rewired to the copy (the same tensor, a new unique name); the name it read
    before is added to ``detached``. Returns the initializer's name."""
    name = node.input[index]
    src = _identity_sources(model).get(name, name)
    graph_outputs = {o.name for o in model.graph.output}
    if name == src and _reads(model.graph).count(src) == 1 and src not in graph_outputs:
        return src
    taken = ({t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
             | {o for n in model.graph.node for o in n.output})
    new, k = f"{src}.{node.name}", 1
    while new in taken:
        new, k = f"{src}.{node.name}.{k}", k + 1
    copy = onnx.TensorProto()
    copy.CopyFrom(initializers(model)[src])
    copy.name = new
    model.graph.initializer.append(copy)
    node.input[index] = new
    detached.add(name)
    return new


def _drop_unread(model: onnx.ModelProto, names: set[str]) -> None:
    """Remove what :func:`_own_initializer` left unread: the Identity nodes producing ``names`` and the
    initializers behind them, once nothing (no node, subgraph or graph output) reads them any more."""
    keep = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    todo = set(names)
    while todo:
        read = set(_reads(model.graph)) | keep        # a graph input stays, an initializer it overrides too
        gone = {t for t in todo if t not in read}
        todo = set()
        for n in list(model.graph.node):
            if n.op_type == "Identity" and n.output[0] in gone:
                model.graph.node.remove(n)
                todo.add(n.input[0])                  # its own input may now be unread too
        for t in list(model.graph.initializer):
            if t.name in gone:
                model.graph.initializer.remove(t)


def _replace(model: onnx.ModelProto, name: str, arr: np.ndarray) -> None:
    t = initializers(model)[name]
    dtype = numpy_helper.to_array(t).dtype
    t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr).astype(dtype), name))


def _clear_shapes(model: onnx.ModelProto) -> None:
    """Intermediate shapes changed: drop stale value_info (ORT re-infers)."""
    del model.graph.value_info[:]


__all__ = ["nm_mask", "prune_2_4", "find_mlp_blocks", "prune_channels", "MLPBlock", "set_weight"]


def prune_onnx(model: onnx.ModelProto, pattern: str, sparsity: float,
               calibration: object = None) -> tuple[onnx.ModelProto, dict]:
    """Prune an ONNX model on the graph: ``pattern`` ``2:4`` (:func:`prune_2_4`) or ``channels`` at a global
    ``sparsity`` (:func:`prune_channels`); activation-aware (Wanda) when ``calibration`` (a .npz, a directory of them
    or a list of batches) is given, else by magnitude. Returns (model, report)."""
    from .quantize.graph import select_layers
    from .quantize.weight_only import layer_activations

    acts = layer_activations(model, calibration, select_layers(model, None)) if calibration is not None else None
    if pattern == "2:4":
        return prune_2_4(model, acts)
    return prune_channels(model, sparsity, activations=acts)
