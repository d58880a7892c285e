"""Choose the model precision a target really runs (``--precision auto|int4|int8|fp16|bf16|fp32 [--fallback]``)."""
from __future__ import annotations

from ..runtime.errors import PrecisionNotSupported
from ..targets import ENGINE_FLAGS, MODEL_PRECISIONS, Target

# What a precision falls back to, in order, when the target lacks it and --fallback is given.
FALLBACK_CHAIN: dict[str, tuple[str, ...]] = {
    "int4": ("int8", "fp16", "fp32"),
    "int8": ("fp16", "fp32"),
    "bf16": ("fp16", "fp32"),
    "fp16": ("fp32",),
    "fp32": (),
}


def choose_precision(target: Target, requested: str, fallback: bool = False) -> tuple[str, list[str]]:
    """Resolve ``requested`` against ``target.precisions``.

    Args:
        target: the target profile.
        requested: ``"auto"`` (the first of ``target.precision_order``) or one of int4, int8, fp16, bf16, fp32.
        fallback: when the target lacks ``requested``, step down int4 → int8 → fp16 → fp32 (bf16 → fp16 → fp32)
            to the first precision it has, instead of failing.
    Returns:
        ``(precision, notes)``; notes say what was decided and why, for report.json (empty when nothing changed).
    Raises:
        PrecisionNotSupported: unknown precision, an engine-build flag (tf32, fp8) given as a precision, or a
            precision the target lacks without ``fallback``; the message names the target's precisions.
    """
    req = (requested or "auto").strip().lower()
    have = ", ".join(target.precisions)
    if req == "auto":
        choice = target.precision_order[0] if target.precision_order else target.precisions[0]
        return choice, [f"--precision auto chose {choice} for {target.name} "
                        f"(preference order: {' > '.join(target.precision_order)})"]
    if req in ENGINE_FLAGS:
        raise PrecisionNotSupported(
            f"{req} is a TensorRT engine-build mode, not a model precision",
            f"choose a model precision ({', '.join(MODEL_PRECISIONS)}); {target.name} builds with "
            f"{', '.join(target.engine_flags) or 'no extra modes'}")
    if req not in MODEL_PRECISIONS:
        raise PrecisionNotSupported(f"unknown precision {requested!r}",
                                    f"use auto or one of {', '.join(MODEL_PRECISIONS)}")
    if target.supports(req):
        return req, []
    if not fallback:
        chain = " → ".join((req,) + FALLBACK_CHAIN[req])
        raise PrecisionNotSupported(
            f"target {target.name} does not support {req} (it supports: {have})",
            f"pick one of {have}, or pass --fallback to step down {chain}")
    for alt in FALLBACK_CHAIN[req]:
        if target.supports(alt):
            return alt, [f"{req} is not supported on {target.name} (supports: {have}); fell back to {alt} (--fallback)"]
    raise PrecisionNotSupported(f"target {target.name} supports none of {req} or its fallbacks",
                                f"it supports: {have}")
