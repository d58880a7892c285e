"""The latency budget a request, a bench run or an exported server gets when none is given: one rule for all.

Order: the caller's own value (``submit(budget_ms=)``, ``load(budget_ms=)``, ``--budget-ms``), else the manifest's
``latency_budget_ms``, else the target profile's ``default_budget_ms`` as written in the manifest, else the profile
of that name on this machine (the caller looks it up: runtime does not import targets), else nothing.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import InputError

FALLBACK_BUDGET_MS = 50.0  # what a session serves with when neither the bundle nor a profile names a budget


def resolve_budget(requested_ms: float | None, manifest: Any,
                   target_default_ms: float | Callable[[], float | None] | None = None) -> tuple[float | None, str]:
    """The budget (ms) and where it came from.

    Args:
        requested_ms: the caller's budget (None: not given).
        manifest: a ``Manifest`` (``latency_budget_ms``, ``target``) or None.
        target_default_ms: the target profile's default, or a function returning it (called only when needed).
    Returns:
        (budget in ms or None, ``"option"`` | ``"manifest"`` | ``"target"`` | ``"none"``).
    Raises:
        InputError: a requested budget ≤ 0.
    """
    if requested_ms is not None:
        if requested_ms <= 0:
            raise InputError(f"latency budget {requested_ms} ms is not positive", "pass a budget in ms, e.g. 20")
        return float(requested_ms), "option"
    if getattr(manifest, "latency_budget_ms", None):
        return float(manifest.latency_budget_ms), "manifest"
    written = (getattr(manifest, "target", None) or {}).get("default_budget_ms")
    if written:
        return float(written), "target"
    default = target_default_ms() if callable(target_default_ms) else target_default_ms
    if default:
        return float(default), "target"
    return None, "none"
