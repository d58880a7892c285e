"""Choose the model precision for a target (``--precision``, ``--fallback``)."""
from __future__ import annotations

from ..runtime.errors import PrecisionNotSupported
from ..targets import Target

FALLBACK_CHAIN = ("int4", "int8", "fp16", "fp32")


def choose_precision(target: Target, requested: str, fallback: bool = False) -> tuple[str, list[str]]:
    """(precision, notes). ``auto`` → the target's first preferred precision.

    Raises:
        PrecisionNotSupported: ``requested`` is not in ``target.precisions`` and ``fallback`` is off.
    """
    if requested == "auto":
        return target.precision_order[0], [f"auto chose {target.precision_order[0]} (first of {target.name}'s preference order)"]
    if target.supports(requested):
        return requested, []
    if fallback and requested in FALLBACK_CHAIN:
        for p in FALLBACK_CHAIN[FALLBACK_CHAIN.index(requested) + 1:]:
            if target.supports(p):
                return p, [f"{requested} is not supported on {target.name}; fell back to {p}"]
    raise PrecisionNotSupported(f"{target.name} does not support {requested}",
                                f"{target.name} supports: {', '.join(target.precisions)}; or pass --fallback")
