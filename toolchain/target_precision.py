"""Choose the model precision a target really runs (``--precision auto|int4|int8|fp16|bf16|fp32 [--fallback]``),
and check the target-side options of a build (``--dla``)."""
from __future__ import annotations

from ..runtime.errors import PrecisionNotSupported, TargetError
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


def resolve_precision(target: Target, requested: str, fallback: bool) -> tuple[str, list[str]]:
    """The precision to build. ``auto`` takes the target's first preference this dsedge can build.

    Raises:
        PrecisionNotSupported: the target lacks it (see ``choose_precision``) or it is not implemented yet.
    """
    from .stages.compressors import COMPRESSORS

    implemented = set(COMPRESSORS) | {"fp32"}
    if requested == "auto":
        for p in target.precision_order:
            if p in implemented:
                skipped = [q for q in target.precision_order[:target.precision_order.index(p)]]
                note = f"auto chose {p} for {target.name}" + (f" ({', '.join(skipped)} not built by this version)" if skipped else "")
                return p, [note]
        return "fp32", [f"auto chose fp32 for {target.name}"]
    precision, notes = choose_precision(target, requested, fallback)
    while precision not in implemented and fallback:
        lower = [p for p in ("int4", "int8", "fp16", "fp32") if p != precision]
        chain = lower[lower.index(next(p for p in lower if _rank(p) > _rank(precision))):]
        nxt = next((p for p in chain if target.supports(p) or p == "fp32"), "fp32")
        notes.append(f"{precision} is not built by this version; fell back to {nxt}")
        precision = nxt
    if precision not in implemented:
        raise PrecisionNotSupported(f"precision {precision} is not yet supported by dsedge build",
                                    f"this version builds: {', '.join(sorted(implemented))} (or pass --fallback)")
    return precision, notes


def _rank(precision: str) -> int:
    return {"int4": 0, "int8": 1, "fp16": 2, "bf16": 2, "fp32": 3}[precision]


def check_dla(target: Target, dla_core: int | None) -> None:
    """Raises TargetError when ``--dla N`` names a DLA core the target does not have."""
    if dla_core is None:
        return
    if target.dla_cores == 0:
        raise TargetError(f"{target.name} has no DLA", "drop --dla; DLA exists on jetson-orin and jetson-xavier")
    if not 0 <= dla_core < target.dla_cores:
        raise TargetError(f"{target.name} has DLA cores 0–{target.dla_cores - 1}, not {dla_core}",
                          f"pass --dla 0 … {target.dla_cores - 1}")
