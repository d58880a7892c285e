"""Stage ``validate``: accuracy of each variant against the original fp32 export on the held-out inputs, and the
``--accuracy-gate`` check of the shipped variant."""
from __future__ import annotations

from typing import Callable

from ...runtime.golden import count_rows
from ..artifacts import Choice, Prepared, VariantDraft
from ..config import BuildPlan
from ..evaluate import compare_models
from ..gates import AUTO_MIN_COSINE, check_shipped
from .compressors import float_layers_note

MIN_ARGMAX_AGREEMENT = 0.9  # below this on a classifier output, the shipped variant's top-1 changes too often to pass
                            # in silence (a user's pass: auto kept int4 at argmax agreement 0.00 on 2 example inputs)


def validate(plan: BuildPlan, model: Prepared, choice: Choice, opsets: dict[str, int],
             log: Callable[[str], None]) -> tuple[list[VariantDraft], list[str]]:
    """The variants to ship (the chosen precision first, then fp32 unless ``--no-fp32``) with their accuracy, and
    warnings for the report, each also logged: a fine-tune that did not recover the accuracy; a compressed variant
    judged only on the source's example inputs (no ``--calib``/``--heldout``: synthetic for an ONNX file); a
    compressed variant whose argmax agreement with fp32 (a classifier's top-1) is below ``MIN_ARGMAX_AGREEMENT`` (not
    for a sentence encoder: no output of it holds class scores). The shipped variant's notes also say which nodes a
    float precision left FP32 because ONNX has no 16-bit type for them at the model's opset (also logged).

    Raises:
        AccuracyGateError: the shipped variant misses ``--accuracy-gate`` (nothing is written).
    """
    finetuned = plan.finetuning
    candidates = [(choice.precision, choice.compressed.path)]
    if plan.config.keep_fp32 and choice.precision != "fp32":  # as measured by auto (fused on ORT), else the export
        fp32 = choice.measured.get("fp32")
        candidates.append(("fp32", fp32.compressed.path if fp32 is not None else model.exported.path))
    fp32_size = model.reference.stat().st_size
    variants = []
    for name, path in candidates:
        if name in choice.measured and not finetuned:  # already validated by the measured auto choice
            acc = choice.measured[name].accuracy
        elif name == "fp32" and path == model.exported.path and opsets["fp32"] == 21 and not finetuned:
            acc = {"reference": "self"}
        else:
            acc = compare_models(model.reference, path, model.validation, task=model.source.task,
                                 output=plan.config.gate_output)
        notes = [f"size vs fp32: {path.stat().st_size / fp32_size:.3f}"]
        if finetuned:
            notes.append("from the pruned/QAT-tuned student, not the original model; accuracy is vs the original")
        if name == "bf16":
            notes.append("accuracy and host latency measured on its FP32 emulation (BF16 weights, BF16 rounding at "
                         "its casts, FP32 arithmetic): ONNX Runtime's CPU provider has no BF16 kernels; on the "
                         "device the error can be larger (toolchain/quantize/bf16_host.py)")
        partial = float_layers_note(name, choice.compressed.details) if name == choice.precision else None
        if partial:
            notes.append(partial)
        untyped = choice.compressed.details.get("fp32_untyped_note") if name == choice.precision else None
        if untyped:  # e.g. bf16 of a CNN below opset 22: every Conv FP32, the file ~fp32's size
            notes.append(untyped)
            log(untyped)
        invariant = choice.compressed.details.get("batch_invariant") if name == choice.precision else None
        variants.append(VariantDraft(name=name, path=path, accuracy=acc, notes=notes, batch_invariant=invariant))
    shipped = check_shipped(list(plan.gates), plan.config.accuracy_gate, choice.precision, variants[0].accuracy,
                            finetuned)
    warnings = []
    if finetuned and shipped.get("cosine", 1.0) < AUTO_MIN_COSINE:
        why = ("the pruning/QAT fine-tune did not recover it" if model.source.module is not None else
               "pruned without a fine-tune (an ONNX source has no weights to train): build from the torch model "
               "to fine-tune, or prune less")
        warning = (f"warning: the {choice.precision} variant is at cosine {shipped['cosine']:.4f} vs the original "
                   f"model (below {AUTO_MIN_COSINE}): {why}")
        log(warning)
        warnings.append(warning)
    for warning in _judged_warnings(plan, model, choice, variants[0].accuracy):
        log(warning)
        warnings.append(warning)
    return variants, warnings


def _judged_warnings(plan: BuildPlan, model: Prepared, choice: Choice, accuracy: dict) -> list[str]:
    """What a user must see about how the shipped compressed variant was judged: on example inputs only (auto's
    rule stands, but its evidence is weak), and an argmax agreement below ``MIN_ARGMAX_AGREEMENT``."""
    if choice.precision == "fp32" or accuracy.get("reference") == "self":
        return []
    source, p = model.source, choice.precision
    n = count_rows(model.validation)  # a rank-0 input (one value) holds no samples
    judged = (f"auto chose {p} judging accuracy" if plan.config.precision == "auto"
              else f"the {p} variant's accuracy was measured")
    out = []
    if source.validation_kind == "example inputs":
        what = "synthetic random inputs" if source.kind == "onnx" else "the inputs the source gave as its example"
        out.append(f"warning: {judged} on {n} example input{'s' if n != 1 else ''} only ({what}), not on real data: "
                   "pass --calib DIR or --heldout DIR of real inputs")
    agree = accuracy.get("argmax_agreement")
    # a sentence encoder's outputs are embeddings, no class scores: its top-1 is nearest-neighbour agreement
    if agree is not None and agree < MIN_ARGMAX_AGREEMENT and source.task != "sentence-embedding":
        out.append(f"warning: the {p} variant's argmax (top-1 class, if {accuracy.get('output', 'the output')!r} "
                   f"holds a classifier's scores) agrees with fp32 on {agree:.2f} of {accuracy.get('n', n)} samples "
                   f"(below {MIN_ARGMAX_AGREEMENT}): check it on real data, add --accuracy-gate top1:0.99, or build "
                   f"--precision fp32")
    return out
