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
# auto tries int4 only when the weights INT4 converts (MatMul/Gemm weight initializers, and word-embedding tables
# unless --no-embeddings) are at least this share of the model's float initializer bytes: INT4 is weight-only for
# GEMMs (TensorRT's too), Conv stays float. Measured on a small CNN (2 Conv + BN + Linear(32, 10), jetson): 5.9 %
# (1280 of 21672 bytes); its "int4" was 0.972x the fp32 size with both Convs fp32, INT8 Q/DQ 0.455x at cosine
# 0.99999. A 3-Gemm MLP is 99.4 %; a BERT ~100 % (its word-embedding table counts when INT4 converts it).
AUTO_INT4_MIN_WEIGHT_SHARE = 0.50


def int4_weight_share(path: Path, tables: bool) -> tuple[float, int, int]:
    """``(share, int4_bytes, float_bytes)`` of the ONNX model at ``path``: the bytes of the float32 initializers INT4
    would convert (``find_weight_sites``: MatMul/Gemm 2-D weights, with ``tables`` the word-embedding Gather tables),
    over the bytes of its float32 initializers (share 0.0 when it has none), lookup tables that only Gather nodes read
    and INT4 leaves float not counted (e.g. with ``--no-embeddings`` a BERT's tables: no compute runs on them).
    Reads no external data."""
    import onnx
    from onnx import TensorProto

    from ..quantize.int4 import find_weight_sites

    model = onnx.load(str(path), load_external_data=False)
    size = {t.name: 4 * int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer
            if t.data_type == TensorProto.FLOAT}
    sites = {s.name for s in find_weight_sites(model, embeddings=tables)}
    reads: dict[str, set[tuple[str, int]]] = {}
    for n in model.graph.node:
        for j, i in enumerate(n.input):
            reads.setdefault(i, set()).add((n.op_type, j))
    lookup = {name for name in size if name not in sites and reads.get(name) == {("Gather", 0)}}
    int4_bytes = sum(size[name] for name in sites if name in size)
    total = sum(b for name, b in size.items() if name not in lookup)
    return (int4_bytes / total if total else 0.0), int4_bytes, total


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
    quantized no layer of it (``check_converted``), is skipped and said; so is int4, unbuilt, when the weights it
    converts are under ``AUTO_INT4_MIN_WEIGHT_SHARE`` of the model's (``int4_weight_share``: e.g. a CNN's Convs).

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
        if p == "int4":
            share, int4_bytes, float_bytes = int4_weight_share(exported.path, opts.embeddings)
            if share < AUTO_INT4_MIN_WEIGHT_SHARE:
                why = (f"INT4 converts MatMul/Gemm weights{' and word-embedding tables' if opts.embeddings else ''} "
                       f"only, {share:.1%} of this model's float weight bytes ({int4_bytes} of {float_bytes}; "
                       f"auto needs >= {AUTO_INT4_MIN_WEIGHT_SHARE:.0%}): the rest (e.g. Conv) would stay float")
                skipped.append({"precision": p, "skipped": why, "int4_weight_share": round(share, 4)})
                log(f"auto candidate {p}: skipped ({why})")
                continue
        try:
            comp = check_converted(COMPRESSORS[p](exported, work, plan, source), source, asked=False)
            opset = fit_target(comp.path, target)
        except DsedgeError as e:
            skipped.append({"precision": p, "skipped": str(e)})
            log(f"auto candidate {p}: skipped ({e})")
            continue
        try:
            acc = compare_models(reference_onnx, comp.path, validation, task=source.task, output=opts.gate_output)
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
        log(f"auto candidate {p}: b1 p50 {first_latency(m.latency_ms)['p50']:.3g} ms, "
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
    """One line for the report, e.g. ``auto: fp32 (fp32 1.1 ms, int8 14.2 ms; …)``: 3 significant digits, so that
    the order it explains shows for a model timed in µs too."""
    timed = sorted((c for c in candidates if "b1_p50_ms" in c), key=lambda c: c["b1_p50_ms"])
    parts = [f"{c['precision']} {c['b1_p50_ms']:.3g} ms" + ("" if c["qualifies"] else
             f" (cosine {c['cosine_mean']} < {AUTO_MIN_COSINE}: not accurate)") for c in timed]
    skipped = [f"{c['precision']} not built: {c['skipped']}" for c in candidates if "skipped" in c]
    n = latency_threads(threads)
    on = f"{n} thread{'s' if n > 1 else ''}" + ("" if threads else " (one serving instance's here)")
    how = (f"b1 p50 on ORT CPU, {on}, timed side by side here" if target.auto_by_latency
           else "b1 p50 on ORT CPU here; chosen as the first accurate precision in the target's order")
    return f"auto: {chosen} ({', '.join(parts)}; {how})" + (f"; {'; '.join(skipped)}" if skipped else "")
