"""``--precision auto``: build, validate and time the target's candidate precisions and keep one by a stated rule
(part of the ``compress`` stage)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...runtime.bundle import first_latency
from ...targets import Target
from ..artifacts import Compressed, Measured
from ..config import BuildPlan
from ..evaluate import compare_models
from ..export import Exported
from ..gates import AUTO_MIN_COSINE, build_gates, qualifies
from .compressors import COMPRESSORS, check_converted
from ..sources import Source
from .fit import fit_target
from .measure import latency_threads, measure_latency, measure_latency_side_by_side

AUTO_MIN_SPEEDUP = 1.10  # ... and, choosing by latency, only compressed variants ≥ 10 % faster than fp32 at b1 p50


def choose_auto(plan: BuildPlan, exported: Exported, reference_onnx: Path, work: Path,
                source: Source, validation: dict[str, np.ndarray],
                log: Callable[[str], None]) -> tuple[str, dict[str, Measured], dict[str, Any]]:
    """``--precision auto``: walk the target's precision order (this version's compressors, then fp32), building and
    validating each candidate. A candidate is accurate when it passes ``--accuracy-gate`` or, without one, when its
    cosine mean vs fp32 on held-out inputs is at least ``AUTO_MIN_COSINE`` (fp32 always is). Targets with ``auto_by_latency`` (ORT CPU) build every candidate, time all
    of them side by side (interleaved, batch 1, on one serving instance's intra-op threads here:
    ``measure_latency_side_by_side``) and keep the fastest accurate one,
    a compressed one only when it is at least ``AUTO_MIN_SPEEDUP`` × faster than fp32 (within measurement noise the
    exact model wins; e.g. INT8 Q/DQ Conv3d runs slower than fp32 on ORT CPU, so a 3-D CNN stays fp32). Other
    targets keep the first accurate one in their order. A candidate whose compressor refuses the model, or that
    quantized no layer of it (``check_converted``), is skipped and said.

    Returns:
        (chosen precision, measured candidates by precision, the choice's record for report.json: rule, candidates
        with ``b1_p50_ms``, ``cosine_mean``, ``qualifies``, ``chosen`` and ``why``).
    """
    from ...runtime.errors import DsedgeError

    target, opts = plan.target, plan.config
    implemented = set(COMPRESSORS)
    order = [p for p in dict.fromkeys([*target.precision_order, "fp32"]) if p in implemented]
    built: dict[str, tuple[Compressed, int, dict[str, Any]]] = {}
    gates = build_gates(opts.accuracy_gate)
    accurate = (f"--accuracy-gate {opts.accuracy_gate}" if opts.accuracy_gate
                else f"cosine_mean >= {AUTO_MIN_COSINE}")
    if target.auto_by_latency:
        rule = (f"fastest b1 p50 (timed side by side) with {accurate}; a compressed variant "
                f"must be >= {AUTO_MIN_SPEEDUP:.2f}x faster than fp32")
    else:
        rule = f"first in the target's order with {accurate}"
    record: dict[str, Any] = {"rule": rule, "candidates": []}
    skipped: list[dict[str, Any]] = []
    for p in order:
        try:
            comp = check_converted(COMPRESSORS[p](exported, work, plan, source), source, asked=False)
            opset = fit_target(comp.path, target)
        except DsedgeError as e:
            skipped.append({"precision": p, "skipped": str(e)})
            log(f"auto candidate {p}: skipped ({e})")
            continue
        try:
            acc = compare_models(reference_onnx, comp.path, validation, task=source.task)
        except DsedgeError as e:  # e.g. BF16 Add has no ORT CPU kernel: it cannot be validated on this host
            skipped.append({"precision": p, "skipped": f"cannot be validated on ORT CPU here: {e}"})
            log(f"auto candidate {p}: skipped (cannot be validated on ORT CPU here: {e})")
            continue
        built[p] = (comp, opset, acc)
        if not target.auto_by_latency and (p == "fp32" or qualifies(acc, gates)):
            break
    if not built:  # every candidate, fp32 included, was refused (e.g. none fits the target's opset)
        from ...runtime.errors import TargetError

        said = "; ".join(f"{k['precision']}: {k['skipped']}" for k in skipped)
        raise TargetError(f"no precision of this model could be built for {target.name} ({said[:300]})",
                          "fix what the first reason names, or build for another target")
    if target.auto_by_latency:
        lats = measure_latency_side_by_side({p: b[0].path for p, b in built.items()}, exported,
                                            opts.latency_iterations, opts.threads, source.vocab_size)
    else:
        lats = {p: measure_latency(b[0].path, exported, opts.latency_iterations, opts.threads, source.vocab_size)
                for p, b in built.items()}
    measured = {p: Measured(b[0], b[1], b[2], lats[p]) for p, b in built.items()}
    for p, m in measured.items():
        ok = p == "fp32" or qualifies(m.accuracy, gates)
        record["candidates"].append({"precision": p, "b1_p50_ms": first_latency(m.latency_ms)["p50"],
                                     "cosine_mean": m.accuracy.get("cosine_mean"), "qualifies": ok})
        log(f"auto candidate {p}: b1 p50 {first_latency(m.latency_ms)['p50']:.2f} ms, "
            f"cosine mean {m.accuracy.get('cosine_mean')}")
    qualified = [c for c in record["candidates"] if c["qualifies"]]
    if target.auto_by_latency:
        fp32_ms = next(c["b1_p50_ms"] for c in qualified if c["precision"] == "fp32")
        fast = [c for c in qualified if c["precision"] == "fp32" or fp32_ms / c["b1_p50_ms"] >= AUTO_MIN_SPEEDUP]
        chosen = min(fast, key=lambda c: c["b1_p50_ms"])["precision"]
    else:
        chosen = qualified[-1]["precision"]
    record["candidates"] += skipped
    record["chosen"] = chosen
    record["why"] = _auto_why(chosen, record["candidates"], target, opts.threads)
    return chosen, measured, record


def _auto_why(chosen: str, candidates: list[dict[str, Any]], target: Target, threads: int | None) -> str:
    """One line for the report, e.g. ``auto: fp32 (int8 14.2 ms vs fp32 1.1 ms at batch 1, …)``."""
    timed = sorted((c for c in candidates if "b1_p50_ms" in c), key=lambda c: c["b1_p50_ms"])
    parts = [f"{c['precision']} {c['b1_p50_ms']:.2f} ms" + ("" if c["qualifies"] else
             f" (cosine {c['cosine_mean']} < {AUTO_MIN_COSINE}: not accurate)") for c in timed]
    skipped = [f"{c['precision']} not built: {c['skipped']}" for c in candidates if "skipped" in c]
    n = latency_threads(threads)
    on = f"{n} thread{'s' if n > 1 else ''}" + ("" if threads else " (one serving instance's here)")
    how = (f"b1 p50 on ORT CPU, {on}, timed side by side here" if target.auto_by_latency
           else "b1 p50 on ORT CPU here; chosen as the first accurate precision in the target's order")
    return f"auto: {chosen} ({', '.join(parts)}; {how})" + (f"; {'; '.join(skipped)}" if skipped else "")
