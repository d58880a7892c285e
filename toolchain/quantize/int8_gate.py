"""W8A8 under an accuracy gate: keep the layers whose INT8 activations cost the most accuracy in float.

Per-tensor INT8 activations fail on some layers of transformer encoders: the input of the FFN down-projection (the
GELU output) carries a few very large values, so its per-tensor scale leaves the rest of the tensor with a handful
of levels (Bondarenko et al., "Understanding and Overcoming the Challenges of Efficient Transformer Quantization",
arXiv:2109.12948). On all-MiniLM-L6-v2, W8A8 everywhere gives mean cosine 0.85 against fp32; the same graph with
the six FFN down-projections in float gives 0.986. Which layers to keep is measured, not assumed:

1. Calibrate and quantize every MatMul/Gemm/Conv once (:func:`.int8.quantize_int8_static`, SmoothQuant first when
   asked). If the gate passes on held-out data, stop.
2. Sensitivity of each layer = how much the gate metric improves when that layer alone reads float activations
   and float weights in the otherwise all-INT8 graph (graph surgery on the calibrated Q/DQ model, no
   re-calibration; one ORT session per layer).
3. Keep layers in float greedily, most sensitive first, re-measuring after each, until the gate passes; if every
   layer is float and it still fails, raise AccuracyGateError with the best value reached.

TensorRT runs the float layers in FP16 when the engine is built with ``--fp16`` (the recipe passes it with
``--int8``), the others in INT8 — the explicit-precision form of its "INT8 with FP16 fallback" builds.
"""
from __future__ import annotations

from collections.abc import Callable

import onnx

from ...runtime.errors import AccuracyGateError, ConfigError
from .calibration import CalibrationSource, load_calibration
from .float_restore import restore_float_initializer
from .graph import INT8_QDQ_OPSET, ensure_qdq_opset, name_nodes
from .int8 import _copy, quantize_int8_static, smooth_quant
from .mixed import AccuracyGate, GateCheck

QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drop nodes (and then initializers) whose outputs nothing reads, in place."""
    graph = model.graph
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [i for i, n in enumerate(graph.node) if not any(o in used for o in n.output)]
        if not dead:
            break
        for i in reversed(dead):
            del graph.node[i]
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def keep_float(quantized: onnx.ModelProto, float_model: onnx.ModelProto, nodes: list[str]) -> onnx.ModelProto:
    """Copy of the Q/DQ model ``quantized`` where ``nodes`` read float inputs again.

    Activation inputs skip their QuantizeLinear → DequantizeLinear pair; weight and bias inputs get the float
    initializers of ``float_model`` (the model that was quantized, same node names). Unused Q/DQ nodes and INT8
    initializers are removed. Raises ConfigError for a node name not in the model.
    """
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    by_name = {n.name: n for n in out.graph.node}
    float_nodes = {n.name: n for n in float_model.graph.node}
    float_inits = {t.name: t for t in float_model.graph.initializer}
    have = {t.name for t in out.graph.initializer}
    prod = _producers(out)
    for name in nodes:
        if name not in by_name or name not in float_nodes:
            raise ConfigError(f"no quantized layer named {name!r}", "pass node names of MatMul/Gemm/Conv layers")
        node, ref = by_name[name], float_nodes[name]
        for i, (cur, orig) in enumerate(zip(node.input, ref.input)):
            if orig in float_inits:
                node.input[i] = restore_float_initializer(out, float_inits[orig], have)
                continue
            dq = prod.get(cur)
            if dq is not None and dq.op_type == "DequantizeLinear":
                q = prod.get(dq.input[0])
                if q is not None and q.op_type == "QuantizeLinear":
                    node.input[i] = q.input[0]
    remove_dead_nodes(out)
    return out


def quantize_int8_gated(model: onnx.ModelProto, calibration: CalibrationSource | list, *,
                        gate: AccuracyGate | list[AccuracyGate] | str, heldout: CalibrationSource | list | None = None,
                        metric: Callable[[onnx.ModelProto], float | dict[str, float]] | None = None,
                        output: int | str = 0, smooth_alpha: float | None = 0.5, method: str = "minmax",
                        on_step: Callable[[str], None] | None = None,
                        reference: onnx.ModelProto | None = None, top1: str = "argmax",
                        quantize_bias: bool = True) -> tuple[onnx.ModelProto, dict]:
    """W8A8 explicit Q/DQ model whose most sensitive layers stay float until ``gate`` passes.

    Args:
        model: fp32 ONNX model (not modified).
        calibration: batches (``{input: array}``), a ``.npz`` or a directory of them, for the activation ranges.
        gate: ``"cosine:0.99"`` etc. (see :func:`.mixed.parse_gates`); the first gate ranks the layers.
        heldout: held-out batches for the built-in metrics (cosine of ``output`` per sample vs ``model``).
        metric: ``model -> value`` or ``{metric: value}``, instead of the built-in one (e.g. for auc-drop).
        smooth_alpha: SmoothQuant alpha (arXiv:2211.10438) applied before calibration; None = off.
        method: activation range calibration, ``minmax`` | ``entropy`` | ``percentile``.
        reference: the model the built-in metric compares with (default ``model``), e.g. the original model when
            ``model`` is a pruned or QAT-tuned student of it.
        quantize_bias: as in :func:`.int8.quantize_int8_static` (False for TensorRT: float biases).
    Returns:
        (model, report): report["kept_float"] lists ``{node, sensitivity, rank, value_after, reason}``,
        report["values_all_int8"] / ["values"] the gate metrics before and after.
    Raises:
        AccuracyGateError when even every layer in float fails; ConfigError for a gate metric without a metric
        function; CalibrationError / QuantizationError as in :func:`.int8.quantize_int8_static`.
    """
    check = GateCheck(gate, metric=metric, heldout=heldout, reference=reference if reference is not None else model,
                      output=output, top1=top1)
    primary, gate_text = check.primary, check.text
    measure, passes, show = check.measure, check.passes, check.show
    log = on_step or (lambda msg: None)

    base = ensure_qdq_opset(name_nodes(_copy(model)), INT8_QDQ_OPSET)
    smooth = None
    if smooth_alpha is not None:
        base, smooth = smooth_quant(base, load_calibration(base, calibration), alpha=smooth_alpha)
    q, report = quantize_int8_static(base, calibration, method=method, quantize_bias=quantize_bias)
    report["smooth_quant"] = smooth
    values = base_values = measure(q)
    log(f"all int8 (W8A8, {method}): {show(values)}")
    prod = _producers(q)
    layers = [n.name for n in q.graph.node if n.op_type in QUANTIZED_OPS
              and any(i in prod and prod[i].op_type == "DequantizeLinear" for i in n.input)]
    kept: list[dict] = []
    sensitivity: dict[str, float] = {}
    if not passes(values):
        for i, name in enumerate(layers):
            alone = measure(keep_float(q, base, [name]))
            sensitivity[name] = primary.gain(values[primary.metric], alone[primary.metric])
            log(f"sensitivity {i + 1}/{len(layers)}: {name} float improves {primary.metric} by "
                f"{sensitivity[name]:+.5f}")
        order = sorted(layers, key=lambda n: -sensitivity[n])
        floats: list[str] = []
        for rank, name in enumerate(order, 1):
            floats.append(name)
            values = measure(keep_float(q, base, floats))
            kept.append({"node": name, "sensitivity": sensitivity[name], "rank": rank,
                         "value_after": values[primary.metric], "values_after": dict(values),
                         "reason": f"float activations and weights alone improve {primary.metric} by "
                                   f"{sensitivity[name]:.5f} (rank {rank} of {len(layers)}); gate {gate_text} "
                                   f"not met with it in int8"})
            log(f"kept {name} in float: {show(values)}")
            if passes(values):
                break
        if not passes(values):
            raise AccuracyGateError(f"INT8 accuracy gate {gate_text} cannot be met: best {show(values)} with every "
                                    f"layer in float", "loosen the gate or choose fp16")
        q = keep_float(q, base, floats)
    report.update({"gate": gate_text, "values_all_int8": base_values, "values": values, "passed": True,
                   "layers": len(layers), "kept_float": kept, "sensitivity": sensitivity,
                   "int8_layers": len(layers) - len(kept)})
    return q, report
