"""The compressors ``dsedge build`` calls per precision: (exported ONNX, work dir, build plan, source) → Compressed.
Each picks a preset (:mod:`..quantize.presets`) for the model and target and compresses through the one verb,
:func:`..quantize.compress.compress`.

- ``int4``: W4A16 weight-only (symmetric: TensorRT's INT4 needs it) with ``--algorithm`` (auto = gptq with
  calibration data, else rtn | rtn | awq | gptq | awq+gptq) and, with
  ``--accuracy-gate``, mixed precision (sensitive layers raised to INT8 / float until the gate passes on the
  held-out data); word-embedding tables INT4 too unless ``--no-embeddings``: for TensorRT targets symmetric (signed
  INT4, no zero point: TensorRT quantizes symmetrically, and its ONNX parser refuses a DequantizeLinear with a
  UINT4 input or a non-zero zero point, so an asymmetric table made the whole variant unparseable), for ONNX Runtime
  targets asymmetric (UINT4 + zero point; ORT gathers the 4-bit rows; measured on MiniLM: cosine cost of the table
  0.0008 vs 0.0012 symmetric). For TensorRT targets only weights whose K is a whole number of blocks (its INT4 is
  blockwise along K), the rest float and said; none fitting is refused (``weight_only.tensorrt_int4_plan``).
- ``int8``: CNNs (Conv) on every target: W8A8 explicit Q/DQ calibrated with MinMax (needs calibration data);
  other models on ORT targets (cpu) per-row dynamic INT8 after ORT's transformer fusions (batch-invariant);
  for TensorRT targets W8A8 explicit Q/DQ calibrated with MinMax after SmoothQuant (alpha 0.5); with held-out
  data, under an accuracy gate (``--accuracy-gate``, default ``cosine:0.99``): the layers whose INT8 costs the most
  stay float (:mod:`..quantize.int8_gate`). Needs calibration data; under ``--precision auto`` or ``--fallback`` without
  any, INT8 weight-only per-channel Q/DQ, said in the report.
- ``fp16`` / ``bf16``: 16-bit with FP32 islands.
Calibration data: ``source.calibration`` (the reference model's committed sentences, or ``--calib``).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from ...runtime.errors import CalibrationError, QuantizationError
from ..artifacts import Compressed
from ..quantize.compress import Calibration, compress
from ..quantize.presets import get_preset

if TYPE_CHECKING:  # annotations only
    from ...targets import Target
    from ..config import BuildPlan
    from ..export import Exported
    from ..sources import Source

DEFAULT_INT8_GATE = "cosine:0.99"   # W8A8 on TensorRT targets when held-out data exists and no --accuracy-gate


def _save(model: Any, path: Path) -> None:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, os.fspath(path))


def _calibration(source: Any, what: str) -> Any:
    if source.calibration is None:
        raise CalibrationError(f"{what} needs calibration data and this source has none",
                               "pass --calib DIR with .npz files of real inputs")
    return source.calibration


def _embedding_output(exported: Any, source: Any, gate_output: str | None = None) -> int | str:
    """The output the INT4/INT8 accuracy gates measure: ``gate_output`` (``--gate-output``) when given, else a
    sentence encoder's ``sentence_embedding``, else the first batched one (index 0: ``cosine_metric``). Raises
    ConfigError when the model has no output ``gate_output``."""
    from ..evaluate import check_gate_output

    names = [o.name for o in exported.outputs]
    if gate_output is not None:
        check_gate_output(gate_output, names, exported.path.name)
        return gate_output
    if source.task == "sentence-embedding" and "sentence_embedding" in names:
        return "sentence_embedding"
    return 0


def _top1(source: Any) -> str:
    """What a gate's ``top1`` means for ``source``: nearest-neighbour agreement of a sentence encoder's embeddings,
    else argmax agreement (a classifier's top-1), as the build's accuracy table reports it (``evaluate``)."""
    return "neighbour" if source.task == "sentence-embedding" else "argmax"


def _gate_reference(exported: Any, model: Any) -> Any:
    """The model accuracy gates compare with: the original export when the source was pruned / QAT-tuned first."""
    import onnx

    ref = getattr(exported, "reference", None)
    return onnx.load(os.fspath(ref)) if ref is not None else model


def compress_int4(exported: Exported, work: Path, plan: BuildPlan, source: Source) -> Compressed:
    """INT4 (W4A16) with the chosen algorithm, optional accuracy gate, and INT4 embedding tables."""
    import onnx

    from ..quantize.compress import compress_int4_with_tables

    opts = plan.config
    algorithm = opts.algorithm
    gate = opts.accuracy_gate
    model = onnx.load(os.fspath(exported.path))
    calib = source.calibration
    if algorithm == "auto":
        algorithm = "gptq" if calib is not None else "rtn"
    if calib is None and (algorithm != "rtn" or gate):
        calib = _calibration(source, f"INT4 {algorithm}" + (f" with --accuracy-gate {gate}" if gate else ""))
    preset = get_preset(f"int4-{algorithm}").replace(block_size=opts.block_size)
    # after QAT: absmax scales without clip search, the quantizer the fake-quant fine-tune trained for
    qat = not gate and opts.qat_steps > 0 and algorithm == "rtn"
    symmetric_tables = plan.target.backend == "tensorrt"  # TensorRT's parser takes INT4 with zero point 0 only
    with_tables, trt = opts.embeddings, None
    if plan.target.backend == "tensorrt":  # INT4 only where TensorRT's blocks along K fit: the rest stays float
        from ..quantize.weight_only import tensorrt_int4_plan

        nodes, with_tables, trt = tensorrt_int4_plan(model, opts.block_size, tables=with_tables,
                                                     target=plan.target.name, name=source.name,
                                                     offered=plan.target.precisions)
        preset = preset.replace(nodes=nodes)
    if gate:
        heldout = source.validation if source.validation is not None else source.example_inputs
        out = compress_int4_with_tables(
            model, preset.replace(accuracy_gate=gate),
            Calibration(calib, heldout=heldout, reference=_gate_reference(exported, model),
                        output=_embedding_output(exported, source, opts.gate_output), top1=_top1(source)),
            tables=with_tables, symmetric_tables=symmetric_tables)
    else:
        out = compress_int4_with_tables(model, preset.replace(clip_search=not qat), Calibration(calib),
                                        tables=with_tables, symmetric_tables=symmetric_tables)
    q, details = out.model, out.details
    if trt is not None:
        from ..quantize.int4 import per_channel_int4_as_blocks

        trt["one_block_layers"] = per_channel_int4_as_blocks(q)  # K == block: one block, not per-channel
        details["tensorrt_int4"] = trt
        if trt["float"]:
            details["float_reason"] = trt["note"]
    if gate:  # a variant named int4 holds INT4 layers
        from ..quantize.mixed import require_int4_left

        require_int4_left(details, source.name, plan.target.precisions)
    if qat:
        details["clip_search"] = False
    tables = details["embeddings"]
    if tables:
        per_block = 4.0 if symmetric_tables else 4.5  # fp32 scale (and a uint4 zero point) per block
        int4_bytes = sum(int(t["shape"][0] * t["shape"][1] // 2
                             + t["shape"][0] * (t["shape"][1] // opts.block_size) * per_block) for t in tables)
        details["embedding_tables"] = "int4 symmetric" if symmetric_tables else "uint4 + zero point"
        fp16_bytes = sum(t["shape"][0] * t["shape"][1] * 2 for t in tables)
        details["embedding_bytes"] = {"onnx_int4": int4_bytes, "tensorrt_fp16": fp16_bytes}
        details["tensorrt_embedding_note"] = (
            "TensorRT runs INT4 weights only in GEMMs: the INT4 embedding table's DequantizeLinear feeds a Gather, so "
            f"expect the engine to hold the table dequantized (FP16: {fp16_bytes / 1e6:.1f} MB) while the ONNX holds "
            f"{int4_bytes / 1e6:.1f} MB (check the engine size on the device); ORT gathers the INT4 rows directly.")
    details["algorithm"] = algorithm
    path = work / "models" / "int4.onnx"
    _save(q, path)
    return Compressed(path, "int4", details)


def fusable_export(exported: Any, source: Any, work: Path, tol: float = 1e-3) -> Path | None:
    """A TorchScript-exporter copy of a transformer encoder for ORT's fusions, or None.

    ORT's transformer optimizer matches the attention/GELU patterns of the TorchScript exporter (``dynamo=False``)
    and fuses them into Attention / BiasGelu / EmbedLayerNormalization kernels; on the dynamo export it fuses only
    the LayerNorms. Same input/output names and dynamic axes as ``exported``; kept only when its outputs match the
    dynamo export within ``tol`` on the source's example inputs.
    """
    if source.module is None or source.task != "sentence-embedding":
        return None
    import numpy as np
    import onnxruntime as ort
    import torch

    dest, failed = work / "fusable-fp32.onnx", work / "fusable-fp32.failed"
    if dest.exists():  # made and parity-checked for another variant of this build
        return dest
    if failed.exists():
        return None
    ins, outs = exported.inputs, exported.outputs
    example = {s.name: source.example_inputs[s.name] for s in ins}
    axes = {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in list(ins) + list(outs)}
    tmp = work / "fusable-fp32.tmp.onnx"
    try:
        with torch.inference_mode():
            torch.onnx.export(source.module, tuple(torch.from_numpy(example[s.name]) for s in ins), os.fspath(tmp),
                              input_names=[s.name for s in ins], output_names=[s.name for s in outs],
                              dynamic_axes=axes, opset_version=17, dynamo=False)
        a = ort.InferenceSession(os.fspath(tmp), providers=["CPUExecutionProvider"]).run(None, example)
        b = ort.InferenceSession(os.fspath(exported.path), providers=["CPUExecutionProvider"]).run(None, example)
        diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
    except Exception:  # the TorchScript exporter is optional here: fall back to the dynamo export
        diff = math.inf
    if diff > tol:
        tmp.unlink(missing_ok=True)
        failed.touch()
        return None
    os.replace(tmp, dest)
    return dest


def compress_fp32(exported: Exported, work: Path, plan: BuildPlan, source: Source) -> Compressed:
    """FP32 as the target's runtime runs it fastest, batch-invariant and exact within the parity check.

    On ONNX Runtime targets, a transformer encoder's TorchScript export (``fusable_export``, parity-checked against
    the dynamo export within 1e-3) with ORT's transformer fusions (Attention, SkipLayerNormalization, BiasGelu:
    ``fuse_transformer``); the cpu target picks its default by latency side by side, so an INT8 variant ships only
    when it beats this, not the unfused graph (on an AVX2 host without VNNI, INT8 MatMuls buy little over fused
    fp32). Elsewhere, and when the model cannot be fused, the export itself.
    """
    fused = fused_fp32(exported, source, work) if plan.target.backend == "onnxruntime" else None
    if fused is None:
        return Compressed(exported.path, "fp32", {})
    path, stats = fused
    return Compressed(path, "fp32", {"form": "fp32 with ONNX Runtime's transformer fusions",
                                     "fusion_export": "torchscript (parity-checked)", "fused_ops": stats,
                                     "batch_invariant": True})


def fused_fp32(exported: Exported, source: Source, work: Path,
               attention: str = "Attention") -> tuple[Path, dict[str, int]] | None:
    """``fusable_export`` with ORT's transformer fusions (``fuse_transformer``), made once per build and
    ``attention`` form: ``(work/models/fp32-fused.onnx, {fused op: count})`` for ``"Attention"`` (the fp32
    variant's graph), ``work/fp32-fused-mha.onnx`` for ``"MultiHeadAttention"`` (the graph the per-row INT8
    quantizes: its Q, K and V projections are MatMuls it can reach); None when the model has no fusable export."""
    import json

    mha = attention == "MultiHeadAttention"
    path = work / "fp32-fused-mha.onnx" if mha else work / "models" / "fp32-fused.onnx"
    stats_file = work / ("fp32-fused-mha.json" if mha else "fp32-fused.json")
    if stats_file.exists():  # written after the model: the model is complete
        return path, json.loads(stats_file.read_text())
    fusable = fusable_export(exported, source, work)
    if fusable is None:
        return None
    import onnx

    from ..quantize.int8 import fuse_transformer

    fused, stats = fuse_transformer(onnx.load(os.fspath(fusable)), attention=attention)
    _save(fused, path)  # a fine-tuned student's export is models/fp32.onnx: kept as it is
    stats_file.write_text(json.dumps(stats))
    return path, stats


def has_conv(model: Any) -> bool:
    """True when the ONNX graph holds a Conv node (Conv1d/2d/3d: a CNN)."""
    return any(n.op_type == "Conv" for n in model.graph.node)


def input_convs(model: Any) -> list[str]:
    """Names of the Conv nodes that read a graph input directly (a CNN's stem on the raw image)."""
    inputs = {i.name for i in model.graph.input}
    return [n.name for n in model.graph.node if n.op_type == "Conv" and n.input[0] in inputs]


INPUT_CONV_REASON = ("reads the model input directly: per-tensor INT8 steps on the raw image (e.g. 1/127 of a CT lung "
                     "window = 11 HU) cost most of the INT8 error while the stem is a small share of the MACs; "
                     "measured on the CT student: logit cosine 0.991 -> 0.9998 vs fp32 with it float")


def compress_int8(exported: Exported, work: Path, plan: BuildPlan, source: Source) -> Compressed:
    """INT8 for a target.

    - CNNs (any Conv node), every target: W8A8 explicit Q/DQ, per-channel weights (axis 0 = output channel),
      per-tensor symmetric activations calibrated with MinMax on ``source.calibration``, Q/DQ on the inputs and
      outputs of each Conv/Gemm (ORT CPU then runs QLinearConv; on TensorRT targets biases stay float, since its
      parser refuses INT32 DequantizeLinear inputs), the model's outputs kept float, and the Conv(s)
      reading the model input kept float (``INPUT_CONV_REASON``; listed in the report's layers). No SmoothQuant (it
      acts on MatMul/Gemm only). Calibration data is required (CalibrationError otherwise).
    - Other models on ORT targets (cpu): dynamic INT8 with per-row activation scales after ORT's transformer
      fusions, attention fused as MultiHeadAttention so its Q, K and V projections are quantized too
      (batch-invariant: a row's answer does not depend on its batch-mates; int8_rowwise.py).
    - Other models on TensorRT targets: W8A8 Q/DQ calibrated with MinMax after SmoothQuant (alpha 0.5), under the
      accuracy gate (``--accuracy-gate``, default ``cosine:0.99``) when there is held-out data; without
      calibration data under ``auto``/``--fallback``, INT8 weight-only per-channel Q/DQ (said in the report).
    """
    import onnx

    from ..quantize.graph import name_nodes

    opts, target = plan.config, plan.target
    model = onnx.load(os.fspath(exported.path))
    calib = source.calibration
    heldout = source.validation
    # TensorRT's ONNX parser refuses INT32 (quantized bias) DequantizeLinear inputs: float biases there
    float_bias = {"quantize_bias": False} if target.backend == "tensorrt" else {}
    if has_conv(model):
        name_nodes(model)
        stem = input_convs(model)
        out = compress(model, get_preset("int8-static").replace(exclude=tuple(stem), **float_bias),
                       Calibration(_calibration(source, "INT8 Q/DQ of a CNN (Conv)")))
        q, details = out.model, out.details
        details["form"] = "W8A8 explicit Q/DQ (CNN): per-channel weights, per-tensor activations, MinMax"
        details["layers"] = [{"node": n, "kept": "float", "why": INPUT_CONV_REASON} for n in stem]
    elif target.backend == "onnxruntime":
        # fused with MultiHeadAttention, not the fp32 variant's Attention: the Q, K and V projections stay MatMuls
        # and are quantized with the rest (inside a fused Attention they stayed a float GEMM: a quarter of MiniLM's
        # layer weights, over half their bytes). MiniLM, 1-thread b1 x 32 (a serving instance's run): 3.8-4.0 ms
        # against 4.9-5.3 (docs/streaming.md, Batch invariance)
        fused = fused_fp32(exported, source, work, attention="MultiHeadAttention")
        if fused is not None:
            model = onnx.load(os.fspath(fused[0]))
        out = compress(model, get_preset("int8-rowwise").replace(fuse=None))
        q, details = out.model, out.details
        if fused is not None:
            details["fused"] = fused[1]
        details["fusion_export"] = "torchscript (parity-checked)" if fused is not None else "none"
    elif calib is not None and heldout is not None:
        gate = opts.accuracy_gate or DEFAULT_INT8_GATE
        out = compress(model, get_preset("int8-smoothquant").replace(accuracy_gate=gate, **float_bias),
                       Calibration(calib, heldout=heldout, reference=_gate_reference(exported, model),
                                   output=_embedding_output(exported, source, opts.gate_output), top1=_top1(source)))
        q, details = out.model, out.details
    elif calib is not None:
        out = compress(model, get_preset("int8-smoothquant").replace(**float_bias), Calibration(calib))
        q, details = out.model, out.details
    elif plan.chosen_for_user("int8"):
        # int8 chosen for the user (auto, or --fallback from int4) and no calibration data:
        # INT8 weights only (per-channel DQ); said in the report
        out = compress(model, "int8-weight-only")
        q, details = out.model, out.details
        details["note"] = ("no calibration data: INT8 weight-only (W8A16 per-channel Q/DQ); pass --calib for "
                           "W8A8 with calibrated activations")
    else:
        out = compress(model, get_preset("int8-static").replace(**float_bias),
                       Calibration(_calibration(source, "INT8 W8A8")))
        q, details = out.model, out.details
    if source.calibration_kind:
        details["calibration"] = source.calibration_kind
    path = work / "models" / "int8.onnx"
    _save(q, path)
    return Compressed(path, "int8", details)


def _compress_float(dtype: str):
    def compress_float(exported: Exported, work: Path, plan: BuildPlan, source: Source) -> Compressed:
        import onnx

        out = compress(onnx.load(os.fspath(exported.path)), dtype)
        path = work / "models" / f"{dtype}.onnx"
        _save(out.model, path)
        return Compressed(path, dtype, out.details)

    compress_float.__doc__ = f"{dtype.upper()} with FP32 islands (LayerNorm, Softmax, reductions)."
    return compress_float


# what each quantizing precision converts (the float precisions convert every float tensor)
QUANTIZED_LAYERS = {"int4": "MatMul/Gemm weights and word-embedding tables", "int8": "MatMul/Gemm/Conv weights"}


def check_converted(comp: Compressed, source: Source, asked: bool, target: Target | None = None) -> Compressed:
    """Record in ``comp.details`` how much of the model a quantizing precision (int4, int8) converted:
    ``converted_layers`` and ``float_layers`` (op type → count of weight layers still float, e.g. ``{"Conv": 2}``
    after INT4 of a CNN). Returns ``comp``; other precisions pass through.

    Raises:
        QuantizationError: no layer was converted (e.g. a model without initializer weights): the file would be the
            fp32 graph under a quantized precision's name. ``asked``: the precision was named by the user (the hint
            differs from ``auto``'s, which skips the candidate); its hint names precisions ``target`` offers
            (without ``target``, fp32, which every target runs).
    """
    if comp.precision not in QUANTIZED_LAYERS:
        return comp
    import onnx

    from ..quantize.graph import layer_coverage

    converted, float_layers = layer_coverage(onnx.load(os.fspath(comp.path), load_external_data=False))
    kept, gate = comp.details.get("kept_float") or [], comp.details.get("gate")
    if converted == 0 and kept and gate:  # the model has layers; the accuracy gate raised every one back to float
        raise QuantizationError(
            f"{comp.precision} kept all {len(kept)} of {source.name}'s layers float to meet the accuracy gate "
            f"{gate}: no layer would run in {comp.precision}",
            "loosen --accuracy-gate, give more --calib/--heldout data, or build fp16" if asked else "")
    if converted == 0:
        still = ", ".join(f"{c} {op}" for op, c in sorted(float_layers.items()))
        raise QuantizationError(
            f"{comp.precision} quantized no layer of {source.name}: it converts {QUANTIZED_LAYERS[comp.precision]} "
            f"given as initializers, and the model has none" + (f" it can take (float: {still})" if still else ""),
            _unconverted_hint(comp.precision, float_layers, target) if asked else "")
    comp.details["converted_layers"] = converted
    comp.details["float_layers"] = float_layers
    return comp


def _unconverted_hint(precision: str, float_layers: dict[str, int], target: Target | None) -> str:
    """What to build instead of a quantizing ``precision`` that converted no layer: the float precisions ``target``
    offers (fp32 alone without a target: every target runs it), and int8 where it would convert the Conv layers
    int4 left float and the target offers it."""
    offered = target.precisions if target is not None else ("fp32",)
    floats = [p for p in ("fp16", "bf16", "fp32") if p in offered] or ["fp32"]
    hint = (f"build it as {' or '.join(floats)} (--precision {floats[0]}), or with --precision auto, which skips "
            "this precision")
    if precision == "int4" and "Conv" in float_layers and "int8" in offered:
        hint += "; --precision int8 converts Conv weights (W8A8: needs --calib data)"
    return hint


def float_layers_note(precision: str, details: dict[str, Any]) -> str | None:
    """``"int4: 1 layer converted, 2 stayed float (2 Conv; int4 converts MatMul/Gemm weights ...)"``, or None when
    every weight layer was converted (or the precision is not a quantizing one)."""
    float_layers = details.get("float_layers") or {}
    why = details.get("float_reason")  # e.g. int4 for TensorRT: what its INT4 blocks do not fit (compress_int4)
    if precision not in QUANTIZED_LAYERS or not (float_layers or why):
        return None
    if not float_layers:
        return f"{precision}: {why}"
    n = details.get("converted_layers", 0)
    kept = sum(float_layers.values())
    ops = ", ".join(f"{c} {op}" for op, c in sorted(float_layers.items()))
    what = f"{precision} converts {QUANTIZED_LAYERS[precision]}"
    if why:  # it explains float MatMul/Gemm layers; other ops (Conv) are float because int4 does not convert them
        what = why if set(float_layers) <= {"MatMul", "Gemm"} else f"{what}; {why}"
    return (f"{precision}: {n} layer{'s' if n != 1 else ''} converted, {kept} weight layer{'s' if kept != 1 else ''} "
            f"stayed float ({ops}; {what})")


COMPRESSORS = {"int4": compress_int4, "int8": compress_int8, "fp16": _compress_float("fp16"),
               "bf16": _compress_float("bf16"), "fp32": compress_fp32}
