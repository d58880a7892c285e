"""Triton's dynamic-batcher settings derived from a bundle: batch sizes, queue delay and queue policy per variant.

Triton's dynamic batcher (one model instance) holds a request at most ``max_queue_delay`` waiting for a preferred
batch, and a request that arrives while a batch runs also waits for that batch. So the worst latency of a batch of
``b`` is about ``delay + run(b) [the batch in flight] + run_p99(b) [its own]``. For CPU bundles ``run`` comes from
the variant's measured latency (``Variant.latency_ms``, through :class:`~dsedge.runtime.latency_profile.LatencyProfile`:
p50, and p99 as the tail); the largest power-of-two batch for which that sum fits the budget is the largest preferred
size, and the queue delay is what is left (at most a quarter of the budget). GPU bundles carry no GPU latency: the
preferred sizes are those up to the optimization profile's ``opt`` batch (the size TensorRT tunes kernels for) and the
delay is 10 % of the budget; re-derive from ``perf_analyzer`` on the server.

Requests are REJECTed (HTTP 503 / gRPC UNAVAILABLE) when still queued at the latest start that can meet the budget
(budget − p50 run time of the largest preferred batch; the budget itself where nothing was measured), and at admission
once the queue holds more than one budget's worth of batches. Clients may pass a shorter per-request timeout (their
own budget): ``allow_timeout_override``. Two priority levels: dsedge ``priority ≥ 1`` → Triton level 1 (served first),
priority 0 → level 2 (the default).
"""
from __future__ import annotations

from ...runtime.budget import resolve_budget

import math
from dataclasses import dataclass, field
from typing import Any

from ...runtime.batching import BatchLayout
from ...runtime.bundle import Manifest, Variant
from ...runtime.instances import recorded_threads
from ...runtime.latency_profile import LatencyProfile

PRIORITY_LEVELS = 2
DEFAULT_PRIORITY_LEVEL = 2
from ...runtime.budget import FALLBACK_BUDGET_MS as _FALLBACK_BUDGET_MS  # noqa: E402
_FALLBACK_MAX_BATCH = 32
_MAX_PREFERRED = 4  # Triton users list a few sizes, the engine's tuned ones; more only slows the batcher's search


@dataclass(frozen=True)
class BatchingPolicy:
    """Dynamic-batching and queue settings for one Triton model.

    Attributes:
        max_batch_size: rows per batch Triton may form (the bundle's batch range max); 0 = the model has no batch
            axis (no dynamic batching).
        preferred_batch_sizes: sizes the batcher forms when it can (ascending).
        max_queue_delay_us: longest hold of a request waiting for a preferred batch, µs.
        timeout_us: queue timeout after which a request is REJECTed, µs.
        max_queue_size: queued requests beyond which new ones are rejected at once (0 = unbounded).
        budget_ms: the latency budget the settings are derived for, ms.
        derived_from: one line each, what each figure came from (written into config.pbtxt as comments).
    """

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    timeout_us: int = 0
    max_queue_size: int = 0
    budget_ms: float = _FALLBACK_BUDGET_MS
    priority_levels: int = PRIORITY_LEVELS
    default_priority_level: int = DEFAULT_PRIORITY_LEVEL
    derived_from: tuple[str, ...] = field(default_factory=tuple)


def budget_of(manifest: Manifest) -> float:
    """The bundle's latency budget (ms): the manifest's, else the target profile's default, else 50."""
    return budget_source(manifest)[0]


def budget_source(manifest: Manifest) -> tuple[float, str]:
    """(budget in ms, where it comes from, in words for config.pbtxt's comments)."""
    budget, source = resolve_budget(None, manifest)
    if budget is None:
        return _FALLBACK_BUDGET_MS, "dsedge's default: the bundle names none, nor does its target profile"
    return budget, ("the bundle's latency_budget_ms" if source == "manifest"
                    else f"target {manifest.target.get('name')}'s default_budget_ms in the bundle")


def batch_range(manifest: Manifest, layout: BatchLayout) -> dict[str, int]:
    """``{"min", "opt", "max"}`` of the batch axis (the manifest's shape range, else the target's shapes)."""
    return _batch_range(manifest, layout)[0]


def _batch_range(manifest: Manifest, layout: BatchLayout) -> tuple[dict[str, int], dict[str, str]]:
    """The batch range and, per figure, where it came from (in words)."""
    sym = layout.batch_symbol or "batch"
    if manifest.shape_ranges.get(sym):
        rng, where = manifest.shape_ranges[sym], f"the bundle's shape range of {sym!r}"
    elif (manifest.target.get("shapes") or {}).get(sym):
        rng, where = manifest.target["shapes"][sym], f"target {manifest.target.get('name')}'s shapes of {sym!r}"
    else:
        rng, where = {}, f"the bundle gives {sym!r} no range"
    hi = int(rng.get("max", _FALLBACK_MAX_BATCH))
    src = {"max": f"{where} (max)" if "max" in rng else f"dsedge's default {_FALLBACK_MAX_BATCH}: {where}",
           "opt": f"{where} (opt)" if "opt" in rng else
           f"dsedge's default min(8, max batch): {where}{' has no opt' if rng else ''}"}
    return {"min": int(rng.get("min", 1)), "opt": int(rng.get("opt", min(8, hi))), "max": hi}, src


def measured_seq(variant: Variant) -> int | None:
    """The sequence length the variant's build-time latency was measured at (None when not recorded)."""
    for val in (variant.latency_ms or {}).values():
        shapes = [s for s in ((val or {}).get("shape") or {}).values() if isinstance(s, list) and len(s) == 2] \
            if isinstance(val, dict) else []
        if shapes:
            return int(shapes[0][1])
    return None


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(max(0, int(limit)).bit_length()) if (1 << i) <= limit]


def derive_policy(manifest: Manifest, variant: Variant, gpu: bool) -> BatchingPolicy:
    """Batching settings for ``variant`` so that the bundle's budget holds (see the module docstring)."""
    layout = BatchLayout.of(manifest.inputs, manifest.outputs)
    budget, budget_from = budget_source(manifest)
    if not layout.dynamic:
        return BatchingPolicy(max_batch_size=0, budget_ms=budget,
                              derived_from=("no shared symbolic batch axis in the IO: max_batch_size 0, no batching",))
    rng, rng_from = _batch_range(manifest, layout)
    max_bs = rng["max"]
    prof = LatencyProfile.from_variant(variant)
    notes = [f"max_batch_size {max_bs}: {rng_from['max']}",
             f"latency budget {budget:g} ms: {budget_from}"]
    if gpu or prof.empty:
        opt = max(1, min(rng["opt"], max_bs))
        preferred = _powers_of_two(opt)[-_MAX_PREFERRED:]
        if preferred[-1] != opt:
            preferred.append(opt)
        delay_us = int(budget * 100)  # 10 % of the budget, in µs
        why = "no GPU latency in the bundle" if gpu else "no latency measured for this variant"
        notes += [f"{why}: preferred sizes up to the opt batch {opt} ({rng_from['opt']}), max_queue_delay 10 % "
                  "of the budget; re-derive from perf_analyzer on the server",
                  "queue timeout = the budget (REJECT)"]
        return BatchingPolicy(max_bs, tuple(preferred), delay_us, int(budget * 1000), 0, budget,
                              derived_from=tuple(notes))
    seq = measured_seq(variant)
    fits = [b for b in _powers_of_two(max_bs) if prof.predict(b, seq, k_dev=0) + prof.predict(b, seq) <= budget]
    if not fits:
        p50, p99 = prof.predict(1, seq, k_dev=0), prof.predict(1, seq)
        queue = max(1, math.floor(budget / max(p50, 1e-3)))
        notes += [f"measured batch 1: p50 {p50:.2f} ms, p99 {p99:.2f} ms (at {seq} tokens): one request in flight "
                  "plus one's own run already exceed the budget; batching off (preferred 1, no delay)",
                  f"queue timeout = the budget (REJECT); max_queue_size {queue}: one budget's worth of runs"]
        return BatchingPolicy(max_bs, (1,), 0, int(budget * 1000), queue, budget, derived_from=tuple(notes))
    top = fits[-1]
    run_p50, run_p99 = prof.predict(top, seq, k_dev=0), prof.predict(top, seq)
    delay_ms = min(budget - run_p50 - run_p99, budget / 4)
    timeout_ms = budget - run_p50
    queue = max(top, math.floor(budget / max(run_p50, 1e-3)) * top)
    threads = recorded_threads(variant.latency_ms)
    on = f"{threads} intra-op thread{'s' if threads > 1 else ''}, " if threads else ""
    notes += [f"measured latency (build machine, {on}{seq} tokens): batch {top} p50 {run_p50:.2f} ms / p99 "
              f"{run_p99:.2f} ms; in flight + own p99 + delay ≤ budget",
              f"max_queue_delay {delay_ms:.2f} ms: the budget left (at most a quarter of it)",
              f"queue timeout {timeout_ms:.2f} ms (budget − p50 of batch {top}: the latest start that can finish "
              f"within the budget), REJECT; max_queue_size {queue}: one budget's worth of batches"]
    return BatchingPolicy(max_bs, tuple(fits[-_MAX_PREFERRED:]), int(delay_ms * 1000), int(timeout_ms * 1000),
                          int(queue), budget, derived_from=tuple(notes))


def dynamic_batching(policy: BatchingPolicy) -> dict[str, Any] | None:
    """The ``dynamic_batching`` message for ``policy`` (None without batching)."""
    if policy.max_batch_size <= 0:
        return None
    return {
        "preferred_batch_size": list(policy.preferred_batch_sizes),
        "max_queue_delay_microseconds": policy.max_queue_delay_us,
        "priority_levels": policy.priority_levels,
        "default_priority_level": policy.default_priority_level,
        "default_queue_policy": {
            "timeout_action": _enum("REJECT"),
            "default_timeout_microseconds": policy.timeout_us,
            "allow_timeout_override": True,
            "max_queue_size": policy.max_queue_size,
        },
    }


def _enum(v: str) -> Any:
    from .pbtxt import Enum

    return Enum(v)
