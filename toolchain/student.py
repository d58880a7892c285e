"""The student of ``dsedge build --prune / --finetune-steps / --qat-steps`` (report.json ``compensation``): prune
and/or fine-tune the torch source before it is exported and compressed, and measure held-out accuracy before and
after (the ``finetune`` stage, ``stages/finetune.py``).

Order: structured channel pruning (``prune_torch.prune_ffn_channels``) or 2:4 masks (``prune_torch.mask_2_4``) →
distillation fine-tune to the untouched teacher (``finetune.distill_finetune``, ``--finetune-steps``; for text
sources 1 - cosine on the sentence embedding plus the token states, on token-replaced calibration sentences) → INT4
fake-quant QAT (``qat.qat_finetune``, ``--qat-steps``). Training uses the source's calibration inputs only; the
before/after figures are student vs teacher in torch on the held-out inputs (the build's validation set). The
bundle's fp32 variant is then the pruned/fine-tuned model, and every variant's accuracy is measured against the
*teacher's* export.

ONNX sources cannot be fine-tuned: ``--prune`` applies the ONNX-side pruning (``toolchain.prune``) without a
fine-tune, and ``--qat-steps`` / ``--finetune-steps N>0`` are refused.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.errors import ConfigError, SourceError, TargetError

if TYPE_CHECKING:  # annotations only
    from ..targets import Target
    from .config import BuildConfig
    from .sources import Source

DEFAULT_FINETUNE_STEPS = 500   # --finetune-steps when not given
FINETUNE_LR = 1e-4             # pruned student: all weights but the embedding tables
QAT_LR = 1e-5                  # QAT: small moves across INT4 rounding boundaries
TRAIN_BATCH = 8
TOKEN_REPLACEMENT = 0.15       # text sources: share of tokens replaced per training step (augmentation)


@dataclass(frozen=True)
class PruneSpec:
    """``--prune``: ``channels`` with a global ``sparsity`` in (0, 1), or ``2:4`` (sparsity 0.5 per group)."""

    pattern: str
    sparsity: float

    def __str__(self) -> str:
        return "2:4" if self.pattern == "2:4" else f"channels:{self.sparsity:g}"


def parse_prune(spec: str) -> PruneSpec:
    """``"channels:0.3"`` → PruneSpec("channels", 0.3); ``"2:4"`` → PruneSpec("2:4", 0.5). Raises ConfigError."""
    text = spec.strip().lower()
    if text == "2:4":
        return PruneSpec("2:4", 0.5)
    kind, _, value = text.partition(":")
    if kind == "channels":
        try:
            sparsity = float(value)
        except ValueError:
            sparsity = -1.0
        if 0.0 < sparsity < 1.0:
            return PruneSpec("channels", sparsity)
        raise ConfigError(f"--prune {spec!r}: the channel sparsity must be a number in (0, 1)",
                          "e.g. --prune channels:0.3 (remove 30 % of the FFN hidden channels)")
    raise ConfigError(f"--prune {spec!r} is not a pruning spec", "use --prune channels:0.3 or --prune 2:4")


def check_options(opts: BuildConfig, target: Target) -> tuple[PruneSpec | None, list[str], str]:
    """Validate ``--prune`` / ``--finetune-steps`` / ``--qat-steps`` against each other and the target, before any
    work. With QAT or 2:4, ``--algorithm auto`` becomes ``rtn`` (said in the returned notes).

    Returns:
        (the parsed ``--prune`` or None, notes for the report, the INT4 algorithm to use).

    Raises:
        ConfigError: a bad spec, negative steps, ``--finetune-steps`` without ``--prune``, ``--qat-steps`` without
            ``--precision int4``, an INT4 algorithm that would undo the fine-tune (GPTQ/AWQ after QAT, GPTQ after 2:4).
        TargetError: ``--prune 2:4`` on a target without sparse tensor cores (its profile lacks ``sparsity``).
    """
    qat, ft = opts.qat_steps, opts.finetune_steps
    if qat < 0:
        raise ConfigError(f"--qat-steps must be >= 0, got {qat}", "e.g. --qat-steps 500; 0 turns QAT off")
    if ft is not None and ft < 0:
        raise ConfigError(f"--finetune-steps must be >= 0, got {ft}", "e.g. --finetune-steps 500; 0 = prune only")
    spec = parse_prune(opts.prune) if opts.prune else None
    if spec is None and ft is not None:
        raise ConfigError("--finetune-steps fine-tunes a pruned model and needs --prune",
                          "add --prune channels:0.3 or --prune 2:4 (QAT has its own --qat-steps)")
    if spec is not None and spec.pattern == "2:4" and "sparsity" not in target.engine_flags:
        from ..targets import list_targets

        sparse = ", ".join(t.name for t in list_targets() if "sparsity" in t.engine_flags)
        raise TargetError(f"{target.name} has no 2:4 sparse tensor cores, so --prune 2:4 would only cost accuracy",
                          f"use --prune channels:0.3, or a target with 2:4 sparsity ({sparse})")
    if qat and opts.precision != "int4":
        raise ConfigError(f"--qat-steps fine-tunes for INT4 and the build's precision is {opts.precision}",
                          "pass --precision int4 with --qat-steps")
    undo = {"gptq", "awq+gptq"} | ({"awq"} if qat else set())
    if (qat or (spec and spec.pattern == "2:4")) and opts.algorithm in undo:
        why = "QAT trains for RTN codes" if qat else "GPTQ's updates refill the pruned zeros"
        raise ConfigError(f"--algorithm {opts.algorithm} does not fit here: {why}",
                          "use --algorithm rtn (or auto) with --qat-steps / --prune 2:4")
    notes = []
    algorithm = opts.algorithm
    if (qat or (spec and spec.pattern == "2:4")) and opts.algorithm == "auto":
        algorithm = "rtn"
        notes.append("INT4 algorithm rtn (if INT4 is built): " + ("QAT trains for the RTN codes (absmax scales, no clip search)" if qat
                                               else "GPTQ would refill the 2:4 zeros"))
    return spec, notes, algorithm


def _trainable(model: Any) -> list:
    """Every parameter except embedding tables: a few calibration sentences touch few of their rows, and MiniLM's
    steps ran ~1.2x faster without the 30k-row table's optimizer update (1.24 vs 1.48 s, loaded 2-core box)."""
    import torch

    frozen = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in frozen]


def _output_index(source: Any) -> int:
    names = source.output_names or []
    return names.index("sentence_embedding") if source.task == "sentence-embedding" and \
        "sentence_embedding" in names else 0


def text_finetune_settings(source: Any, fwd: Callable) -> tuple[Callable, float, Callable | None]:
    """(training forward, feature weight, augmentation) for the pruning fine-tune. Text sources match the token
    states too (weight 1) and train on token-replaced calibration sentences labelled by the teacher on the fly —
    measured on MiniLM channels:0.3: 150 such steps beat 300 plain ones on held-out cosine (docs/compression.md).
    Other sources: the main output only, plain batches."""
    from .finetune import output_forward, token_replacement

    if source.task != "sentence-embedding" or not {"input_ids", "attention_mask"} <= set(source.calibration):
        return fwd, 0.0, None
    out_i = _output_index(source)
    two = len(source.output_names or []) == 2
    return (output_forward(out_i, 1 - out_i) if two else fwd, 1.0 if two else 0.0,
            token_replacement(list(source.calibration), TOKEN_REPLACEMENT))


def make_student(source: Source, opts: BuildConfig, spec: PruneSpec | None,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Prune / fine-tune / QAT ``source.module`` (replaced by the student; the teacher is kept unchanged).

    Returns:
        the report section: ``{"train": …, "heldout": …, "prune": {…, "finetune", "heldout_before",
        "heldout_after"}, "qat": {…, "heldout_before", "heldout_after"}}`` (keys present as requested).
    Raises:
        CalibrationError: the source has no calibration inputs to train on. QuantizationError: nothing to prune.
    """
    from ..runtime.errors import CalibrationError
    from .finetune import distill_finetune, heldout_metrics, output_forward, torch_batches
    from .prune_torch import mask_2_4, prune_ffn_channels
    from .qat import qat_finetune, unwrap_linears, wrap_linears

    if source.calibration is None:
        raise CalibrationError("pruning and QAT fine-tunes need calibration inputs and this source has none",
                               "pass --calib DIR with .npz files of real inputs")
    heldout = source.validation if source.validation is not None else source.example_inputs
    out_i = _output_index(source)
    fwd = output_forward(out_i)
    teacher = source.module.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = copy.deepcopy(teacher)
    for p in student.parameters():
        p.requires_grad_(True)
    batches = torch_batches(source.calibration, TRAIN_BATCH)
    n_train = len(next(iter(source.calibration.values())))
    section: dict[str, Any] = {
        "train": f"calibration inputs ({n_train} samples, batch {TRAIN_BATCH})",
        "heldout": f"{source.validation_kind} ({len(next(iter(heldout.values())))} samples): student vs the "
                   f"untouched fp32 teacher in torch, output "
                   f"{source.output_names[out_i] if source.output_names else 0!r}",
    }

    def metrics() -> dict[str, Any]:
        return heldout_metrics(student, teacher, heldout, output=out_i, task=source.task)

    masks = None
    if spec is not None:
        t0 = time.perf_counter()
        if spec.pattern == "channels":
            rep = prune_ffn_channels(student, spec.sparsity, batches, forward=fwd)
            log(f"pruned {rep['sparsity']:.1%} of FFN hidden channels in {len(rep['blocks'])} blocks "
                f"({rep['params_before']:,} → {rep['params_after']:,} parameters)")
        else:
            masks, rep = mask_2_4(student, batches, forward=fwd)
            log(f"2:4 sparsity on {len(rep['layers'])} Linear layers")
        rep["prune_s"] = round(time.perf_counter() - t0, 2)
        rep["heldout_before"] = metrics()
        steps = DEFAULT_FINETUNE_STEPS if opts.finetune_steps is None else int(opts.finetune_steps)
        train_fwd, feature_weight, augment = text_finetune_settings(source, fwd)
        rep["finetune"] = distill_finetune(student, teacher, batches, forward=train_fwd, steps=steps,
                                           lr=FINETUNE_LR, params=_trainable(student), masks=masks,
                                           feature_weight=feature_weight, augment=augment, log=log)
        rep["finetune"].update(feature_weight=feature_weight,
                               augment=f"token replacement p={TOKEN_REPLACEMENT}" if augment else None)
        rep["heldout_after"] = metrics()
        _log_change(log, f"fine-tune ({steps} steps, {rep['finetune']['time_s']:.0f} s)", rep)
        section["prune"] = rep
    qat = opts.qat_steps
    if qat:
        wrap_linears(student, opts.block_size)
        before = metrics()
        unwrap_linears(student)
        rep = qat_finetune(student, batches, forward=fwd, steps=qat, lr=QAT_LR, block_size=opts.block_size,
                           masks=masks, teacher=teacher, log=log)
        wrap_linears(student, opts.block_size)
        after = metrics()
        unwrap_linears(student)
        rep.update(layers=len(rep["layers"]), heldout_before=before, heldout_after=after,
                   what=f"nn.Linear and attention input-projection weights fake-quantized to INT4 (block "
                        f"{opts.block_size}, symmetric, the RTN quantizer the export uses); embedding tables not")
        _log_change(log, f"QAT ({qat} steps, {rep['time_s']:.0f} s)", rep)
        section["qat"] = rep
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    source.module = student
    return section


def _log_change(log: Callable[[str], None], what: str, rep: dict[str, Any]) -> None:
    b, a = rep["heldout_before"], rep["heldout_after"]
    top1 = "top1_agreement" if "top1_agreement" in b else "argmax_agreement"
    extra = f", {top1.split('_')[0]} {b[top1]:.3f} → {a[top1]:.3f}" if top1 in b else ""
    log(f"{what}: held-out cosine mean {b['cosine_mean']:.4f} → {a['cosine_mean']:.4f}{extra}")


def prune_onnx_source(path: Any, spec: PruneSpec, calibration: Any) -> dict[str, Any]:
    """ONNX source: prune the exported file at ``path`` in place (no fine-tune), activation-aware with calibration
    inputs when there are any. Returns the pruning report."""
    import os

    import onnx

    from .prune import prune_onnx

    out, rep = prune_onnx(onnx.load(os.fspath(path)), spec.pattern, spec.sparsity,
                          [calibration] if calibration is not None else None)
    onnx.save(out, os.fspath(path))
    rep["finetune"] = None
    return rep


def refuse_for_onnx(opts: BuildConfig) -> None:
    """Raises SourceError when an ONNX source is asked for a fine-tune (QAT or pruning fine-tune)."""
    asked = [o for o, on in (("--qat-steps", opts.qat_steps > 0),
                             ("--finetune-steps", (opts.finetune_steps or 0) > 0)) if on]
    if asked:
        raise SourceError(f"{' and '.join(asked)} train{'s' if len(asked) == 1 else ''} in torch and the source is "
                          "an ONNX file",
                          "pass the torch model (HF directory, run directory or module:function); for an ONNX "
                          "file, --prune without --finetune-steps prunes without a fine-tune")
