"""INT8 quantization: W8A8 explicit Q/DQ with calibration (static), and dynamic INT8 for the ORT CPU target.

Static W8A8 uses ONNX Runtime's ``quantize_static`` in QDQ format (a well-kept implementation): per-channel
symmetric INT8 weights, per-tensor INT8 activations calibrated with MinMax (default), Entropy (KL) or Percentile.
With ``symmetric_activations=True`` (default) activation zero points are 0, which TensorRT's explicit-quantization
mode needs; ``False`` gives asymmetric UINT8 activations (faster U8S8 kernels on x86 ORT CPU).

Dynamic INT8 (``quantize_dynamic``: weights INT8 per channel, activations quantized per batch at run time,
``MatMulInteger``/``DynamicQuantizeLinear``) needs no calibration and is the fastest form on ORT CPU; it is not a
Q/DQ graph, so it is only for ORT targets. ``fuse="bert"`` first applies ORT's transformer fusions (Attention,
SkipLayerNormalization, BiasGelu, EmbedLayerNormalization) so attention runs as one kernel.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from ...runtime.errors import CalibrationError, QuantizationError
from .calibration import Batch, CalibrationSource, load_calibration
from .graph import materialize_constants, name_nodes

METHODS = ("minmax", "entropy", "percentile")
DEFAULT_OP_TYPES = ("MatMul", "Gemm", "Conv")


class BatchReader:
    """``onnxruntime.quantization.CalibrationDataReader`` over checked batches (duck-typed: get_next/rewind)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.pos = 0

    def get_next(self) -> Batch | None:
        if self.pos >= len(self.batches):
            return None
        self.pos += 1
        return self.batches[self.pos - 1]

    def rewind(self) -> None:
        self.pos = 0

    def __len__(self) -> int:
        return len(self.batches)


def pad_to_common_shape(batches: list[Batch]) -> list[Batch]:
    """Zero-pad every input to the largest shape seen (e.g. token ids / attention mask to the longest sequence).

    ORT's histogram calibrators (Entropy, Percentile) stack a tensor's outputs over batches, which needs equal
    shapes; zero is the padding token and a masked position for transformer inputs.
    """
    names = batches[0].keys()
    target = {n: np.max([b[n].shape for b in batches], axis=0) for n in names}
    out = []
    for b in batches:
        fixed = {}
        for n in names:
            a = b[n]
            pad = [(0, int(t - s)) for s, t in zip(a.shape, target[n])]
            fixed[n] = np.pad(a, pad) if any(p for _, p in pad) else a
        out.append(fixed)
    return out


def activation_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of MatMul nodes whose inputs are both activations (no initializer or Constant operand)."""
    consts = {t.name for t in model.graph.initializer}
    consts |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and not any(i in consts for i in n.input[:2])]


def smooth_quant(model: onnx.ModelProto, batches: list[Batch], *, alpha: float = 0.5,
                 nodes: list[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """SmoothQuant (Xiao et al., arXiv:2211.10438): move activation outliers into the weights before W8A8.

    For each group of MatMul/Gemm layers reading the same activation ``X`` ``[rows, K]``, per input channel
    ``s_k = max|X_k|^alpha / max|W_k,:|^(1-alpha)``; the weights become ``diag(s) W`` and a ``Mul(X, 1/s)`` is
    inserted (the float function is unchanged), so per-tensor activation quantization no longer wastes its range on
    a few outlier channels. Returns (model at opset >= 13, its own if higher; report with the smoothed groups).
    """
    from .calibration import collect_activations
    from .graph import INT8_QDQ_OPSET, ensure_qdq_opset, insert_input_scale, select_layers, set_weight, weight_kn

    out = ensure_qdq_opset(name_nodes(_copy(model)), INT8_QDQ_OPSET)
    layers = select_layers(out, nodes)
    acts = collect_activations(out, batches, sorted({lay.activation for lay in layers}))
    groups: dict[str, list] = {}
    for lay in layers:
        groups.setdefault(lay.activation, []).append(lay)
    done = []
    for tensor, members in groups.items():
        x_max = np.abs(acts[tensor]).max(axis=0).astype(np.float64)
        ws = [weight_kn(out, m) for m in members]
        w_max = np.max([np.abs(w).max(axis=1) for w in ws], axis=0).astype(np.float64)
        s = np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
        s = np.clip(s, 1e-3, 1e3).astype(np.float32)
        for m, w in zip(members, ws):
            set_weight(out, m, w * s[:, None])
        insert_input_scale(out, members, 1.0 / s)
        done.append({"activation": tensor, "layers": [m.node for m in members],
                     "max_scale": float(s.max()), "min_scale": float(s.min())})
    return out, {"alpha": alpha, "groups": done}


class _PreprocessHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("Please consider")


@contextlib.contextmanager
def without_preprocess_hint() -> Iterator[None]:
    """Drop the root-logger warning ORT's quantizers print on every call ("Please consider pre-processing before
    quantization …": symbolic shape inference, which dsedge's exports do not need); other warnings pass."""
    hint = _PreprocessHint()
    root = logging.getLogger()
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)


def check_initializers_finite(model: onnx.ModelProto) -> None:
    """Raise QuantizationError naming the first float initializer that holds NaN/Inf (and the node reading it)."""
    readers = {i: n.name or n.op_type for n in model.graph.node for i in n.input}
    for t in model.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            a = onnx.numpy_helper.to_array(t)
            if a.size and not np.all(np.isfinite(a)):
                bad = int(a.size - np.count_nonzero(np.isfinite(a)))
                raise QuantizationError(f"initializer {t.name!r} (read by {readers.get(t.name, '?')!r}) holds {bad} "
                                        "NaN/Inf values", "fix or retrain the model; NaN/Inf weights cannot be quantized")


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _save(model: onnx.ModelProto, path: Path) -> None:
    big = model.ByteSize() > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=big, location=path.name + ".data" if big else None)


def quantize_int8_static(model: onnx.ModelProto, calibration: CalibrationSource | list, *, method: str = "minmax",
                         percentile: float = 99.999, per_channel: bool = True, symmetric_activations: bool = True,
                         op_types: tuple[str, ...] = DEFAULT_OP_TYPES, nodes_to_exclude: list[str] | None = None,
                         weights_only_matmul: bool = True, smooth_alpha: float | None = None,
                         quantize_bias: bool = True) -> tuple[onnx.ModelProto, dict]:
    """W8A8 Q/DQ model from an fp32 ONNX model and a calibration set.

    Args:
        calibration: iterable of ``{input: array}`` batches, a ``.npz``, or a directory of ``.npz`` files.
        method: ``minmax`` | ``entropy`` | ``percentile`` (activation range calibration).
        percentile: for ``percentile``, the kept percentile of ``|x|`` (e.g. 99.999).
        op_types: node types to quantize (MatMul, Gemm, Conv; Conv covers Conv2d and Conv3d).
        nodes_to_exclude: node names kept in float.
        smooth_alpha: apply :func:`smooth_quant` with this alpha first (0.5 in the paper; None = off).
        weights_only_matmul: keep MatMuls of two activations (attention scores, attention x V) in float; per-tensor
            INT8 there costs most of the accuracy of transformer encoders.
        quantize_bias: Conv/Gemm biases as INT32 DequantizeLinear (scale = input scale × weight scale), what ORT CPU
            needs to fuse DQ → Conv → Q into QLinearConv. False keeps them float32 initializers: TensorRT's ONNX
            parser refuses an INT32 DequantizeLinear input (only activation types may feed one; TensorRT adds the
            float bias after the INT8 GEMM/convolution itself), so every TensorRT target needs False.
    Returns:
        (quantized model, report with method, counts of QuantizeLinear/DequantizeLinear and the op types done).
    Raises:
        CalibrationError (empty / mismatched calibration data), QuantizationError (unknown method).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if method not in METHODS:
        raise QuantizationError(f"unknown calibration method {method!r}", f"choose one of {', '.join(METHODS)}")
    model = name_nodes(_copy(model))
    materialize_constants(model)
    check_initializers_finite(model)
    batches = load_calibration(model, calibration)
    if method != "minmax":
        batches = pad_to_common_shape(batches)
    smooth = None
    if smooth_alpha is not None:
        model, smooth = smooth_quant(model, batches, alpha=smooth_alpha)
    if weights_only_matmul:
        nodes_to_exclude = list(nodes_to_exclude or []) + activation_matmuls(model)
    cal = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
           "percentile": CalibrationMethod.Percentile}[method]
    # MatMul/Gemm: Q/DQ on their inputs only (TensorRT's explicit-quantization placement) and a dedicated pair per
    # consumer, so bias Adds, residual Adds and LayerNorms read float tensors (W8A8 MiniLM: cosine 0.85 -> 0.98).
    # Conv keeps its output Q/DQ: ORT CPU then fuses DQ -> Conv -> Q into QLinearConv.
    extra = {"ActivationSymmetric": symmetric_activations, "WeightSymmetric": True,
             "CalibMovingAverage": False, "DedicatedQDQPair": True, "QuantizeBias": quantize_bias,
             "OpTypesToExcludeOutputQuantization": [t for t in op_types if t in ("MatMul", "Gemm")]}
    if method == "percentile":
        extra["CalibPercentile"] = percentile
    if method == "entropy":
        extra["CalibNumBins"] = 2048
    with tempfile.TemporaryDirectory(prefix="dsedge-int8-") as tmp, without_preprocess_hint():
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        _save(model, src)
        try:
            quantize_static(
                str(src), str(dst), BatchReader(batches), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                activation_type=QuantType.QInt8 if symmetric_activations else QuantType.QUInt8,
                weight_type=QuantType.QInt8, calibrate_method=cal, op_types_to_quantize=list(op_types),
                nodes_to_exclude=list(nodes_to_exclude or []), extra_options=extra,
                calibration_providers=["CPUExecutionProvider"])
        except Exception as e:  # ValueError/IndexError, or ORT's own InvalidArgument/Fail running a batch
            if not (isinstance(e, (ValueError, IndexError)) or type(e).__module__.startswith("onnxruntime")):
                raise
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise CalibrationError(f"INT8 calibration failed: {first[:300]}",
                                   "check that the calibration batches match the model's inputs (names, shapes, "
                                   "and values the model accepts, e.g. token ids within its vocabulary)") from None
        out = onnx.load(str(dst))
    float_outputs = keep_outputs_float(out)
    counts = Counter(n.op_type for n in out.graph.node)
    report = {"precision": "int8", "mode": "static", "method": method, "per_channel": per_channel,
              "symmetric_activations": symmetric_activations, "calibration_batches": len(batches),
              "bias": "int32" if quantize_bias else "float",
              "quantize_linear": counts.get("QuantizeLinear", 0),
              "dequantize_linear": counts.get("DequantizeLinear", 0), "op_types": list(op_types),
              "excluded": list(nodes_to_exclude or []), "smooth_quant": smooth,
              "float_outputs": float_outputs}
    return out, report


SHAPE_OPS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")


def keep_outputs_float(model: onnx.ModelProto) -> list[str]:
    """Drop, in place, each QuantizeLinear → DequantizeLinear pair whose output reaches a graph output through
    shape-only ops (Reshape, Transpose, …; Shape/Size readers aside): the model's outputs (e.g. a CNN head's logits)
    stay float.

    Why: ORT (1.32) fails to load a graph whose last Conv output Q/DQ its QDQ propagation moves past a Reshape
    ("output_dtype INT8 does not match y_zero_point type UINT8"), and rounding the final logits to INT8 only costs
    accuracy. Returns the names of the tensors left float.
    """
    g = model.graph
    outputs = {o.name for o in g.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producer = {o: n for n in g.node for o in n.output}

    def reaches_output(t: str) -> bool:
        if t in outputs:
            return True
        users = [u for u in consumers.get(t, []) if u.op_type not in ("Shape", "Size")]  # read the shape only
        return bool(users) and all(u.op_type in SHAPE_OPS and reaches_output(u.output[0]) for u in users)

    pairs = [(producer[n.input[0]], n) for n in g.node if n.op_type == "DequantizeLinear"
             and n.input[0] in producer and producer[n.input[0]].op_type == "QuantizeLinear"
             and reaches_output(n.output[0])]
    kept = []
    for q, dq in pairs:
        for user in consumers.get(dq.output[0], []):
            for k, name in enumerate(user.input):
                if name == dq.output[0]:
                    user.input[k] = q.input[0]
        if dq.output[0] in outputs:      # the pair ends at the output itself: rename the float tensor
            for node in g.node:
                for k, name in enumerate(node.output):
                    if name == q.input[0]:
                        node.output[k] = dq.output[0]
            for user in consumers.get(q.input[0], []):
                for k, name in enumerate(user.input):
                    if name == q.input[0]:
                        user.input[k] = dq.output[0]
        g.node.remove(dq)
        if all(u is dq for u in consumers.get(q.output[0], [])):
            g.node.remove(q)
        kept.append(q.input[0])
    return kept


def fuse_transformer(model: onnx.ModelProto, *, model_type: str = "bert", num_heads: int = 0,
                     hidden_size: int = 0, attention: str = "Attention") -> tuple[onnx.ModelProto, dict]:
    """ORT's transformer graph fusions (``onnxruntime.transformers.optimizer``), for ORT CPU/CUDA targets only:
    the fused ops (Attention, SkipLayerNormalization …) are ORT contrib ops TensorRT does not read.
    ``num_heads``/``hidden_size`` 0 = detect from the graph. ``attention``: ``"Attention"`` (the Q, K and V
    projections inside the fused op, as one float GEMM) or ``"MultiHeadAttention"`` (the projections left as
    MatMul nodes that a quantizer can reach, the attention itself fused). Returns (model, {fused op: count}).

    Raises:
        ValueError: ``attention`` is neither.
    """
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    if attention not in ("Attention", "MultiHeadAttention"):
        raise ValueError(f"attention={attention!r}: pass 'Attention' or 'MultiHeadAttention'")
    options = FusionOptions(model_type)
    options.use_multi_head_attention = attention == "MultiHeadAttention"
    # keep the word-embedding Gather visible: EmbedLayerNormalization would hide the table from INT8 quantization
    options.enable_embed_layer_norm = False
    with tempfile.TemporaryDirectory(prefix="dsedge-fuse-") as tmp:
        src = Path(tmp) / "in.onnx"
        _save(model, src)
        opt = optimizer.optimize_model(str(src), model_type=model_type, num_heads=num_heads,
                                       hidden_size=hidden_size, opt_level=1, optimization_options=options)
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        return opt.model, stats


def quantize_int8_dynamic(model: onnx.ModelProto, *, per_channel: bool = True, fuse: str | None = "bert",
                          op_types: tuple[str, ...] = ("MatMul", "Gemm", "Attention", "Gather"),
                          nodes_to_exclude: list[str] | None = None,
                          weight_type: str = "int8") -> tuple[onnx.ModelProto, dict]:
    """Dynamic INT8 (W8, activations quantized at run time) for ORT CPU; optional transformer fusion first.

    Gather covers embedding tables (UINT8 rows dequantized at lookup). ``weight_type``: "int8", "uint8" or "int7"
    (INT8 with ORT's reduced range). Returns (model, report). Raises QuantizationError on NaN/Inf weights (naming
    the initializer).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    check_initializers_finite(model)
    fused: dict = {}
    if fuse:
        model, fused = fuse_transformer(model, model_type=fuse)
    with tempfile.TemporaryDirectory(prefix="dsedge-dyn-") as tmp, without_preprocess_hint():
        src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        _save(model, src)
        quantize_dynamic(str(src), str(dst), per_channel=per_channel, reduce_range=(weight_type == "int7"),
                         weight_type=QuantType.QUInt8 if weight_type == "uint8" else QuantType.QInt8,
                         op_types_to_quantize=list(op_types), nodes_to_exclude=list(nodes_to_exclude or []),
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        out = onnx.load(str(dst))
    counts = Counter(n.op_type for n in out.graph.node)
    report = {"precision": "int8", "mode": "dynamic", "per_channel": per_channel, "fused": fused,
              "batch_invariant": False,  # one activation scale per tensor: a row's answer depends on its batch
              "ops": {k: v for k, v in counts.items() if k in ("MatMulInteger", "DynamicQuantizeMatMul",
                                                                 "QAttention", "DynamicQuantizeLinear",
                                                                 "Attention", "QGemm")}}
    return out, report
