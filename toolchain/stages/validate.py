"""Stage ``validate``: accuracy of each variant against the original fp32 export on the held-out inputs, and the
``--accuracy-gate`` check of the shipped variant."""
from __future__ import annotations

from typing import Callable

from ..artifacts import Choice, Prepared, VariantDraft
from ..config import BuildPlan
from ..evaluate import compare_models
from ..gates import AUTO_MIN_COSINE, check_shipped


def validate(plan: BuildPlan, model: Prepared, choice: Choice, opsets: dict[str, int],
             log: Callable[[str], None]) -> tuple[list[VariantDraft], list[str]]:
    """The variants to ship (the chosen precision first, then fp32 unless ``--no-fp32``) with their accuracy, and
    warnings for the report (a fine-tune that did not recover the accuracy).

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
            acc = compare_models(model.reference, path, model.validation, task=model.source.task)
        notes = [f"size vs fp32: {path.stat().st_size / fp32_size:.3f}"]
        if finetuned:
            notes.append("from the pruned/QAT-tuned student, not the original model; accuracy is vs the original")
        if name == "bf16":
            notes.append("accuracy and host latency measured on its FP32 emulation (BF16 weights, BF16 rounding at "
                         "its casts, FP32 arithmetic): ONNX Runtime's CPU provider has no BF16 kernels; on the "
                         "device the error can be larger (toolchain/quantize/bf16_host.py)")
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
    return variants, warnings
