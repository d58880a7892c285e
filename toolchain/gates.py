"""Accuracy gates of ``dsedge build`` (``--accuracy-gate METRIC:THRESHOLD[,…]``): parsing, the test the measured
``auto`` choice applies to each candidate, the check of the shipped variant, and the build log's one-line summary."""
from __future__ import annotations

from typing import Any

from ..runtime.errors import AccuracyGateError, ConfigError

AUTO_MIN_COSINE = 0.98  # --precision auto keeps only variants at least this close to fp32 (cosine mean, held-out)


def build_gates(spec: str | None) -> list:
    """``--accuracy-gate`` parsed for ``dsedge build``, which measures the built-in metrics only (cosine,
    cosine-min, top1). Raises ConfigError for a bad spec or a metric that needs a caller's metric function."""
    if not spec:
        return []
    from .quantize.mixed import BUILTIN, parse_gates

    gates = parse_gates(spec)
    other = [g.metric for g in gates if g.metric not in BUILTIN]
    if other:
        raise ConfigError(f"dsedge build cannot measure {other[0]!r} for --accuracy-gate",
                          f"gates of dsedge build use {', '.join(BUILTIN)}; others need the Python API "
                          "(quantize_mixed(metric=...))")
    return gates


def qualifies(accuracy: dict[str, Any], gates: list) -> bool:
    """Auto's accuracy test: every ``--accuracy-gate`` gate passes, or without one cosine_mean >= AUTO_MIN_COSINE."""
    from .quantize.mixed import gate_values

    if not gates:
        return accuracy.get("cosine_mean", 0.0) >= AUTO_MIN_COSINE
    values = gate_values(accuracy)
    return all(g.metric in values and g.passes(values[g.metric]) for g in gates)


def gate_summary(details: dict[str, Any]) -> str:
    """One line on what an accuracy-gated compressor kept higher, for the build log ('' when nothing was gated)."""
    if not details.get("gate"):
        return ""
    v = details.get("values", {}).get("cosine")
    tail = f", cosine {v:.4f})" if v is not None else ")"
    if "int8_layers" in details:                      # INT8 gate: layers kept float
        return f" (gate {details['gate']}: {len(details['kept_float'])} of {details['layers']} layers kept float" + tail
    return f" (gate {details['gate']}: {len(details.get('raised', []))} layer raises" + tail


def check_shipped(gates: list, spec: str | None, precision: str, accuracy: dict[str, Any], finetuned: bool) -> dict:
    """The gate on the shipped (first) variant, for precisions without a gated search (e.g. dynamic INT8).

    Returns:
        the gate values measured (metric → value; empty when the variant is the reference itself).
    Raises:
        AccuracyGateError: a gate is not met, naming each failing metric and its value.
    """
    from .quantize.mixed import gate_values

    shipped = gate_values(accuracy) if accuracy.get("reference") != "self" else {}
    if gates and shipped:
        failing = [g for g in gates if g.metric in shipped and not g.passes(shipped[g.metric])]
        if failing:
            raise AccuracyGateError(
                f"accuracy gate {spec} not met by the {precision} variant: "
                + ", ".join(f"{g.metric} = {shipped[g.metric]:.5f}" for g in failing)
                + " vs the original model" + (" (the pruning/QAT cost included)" if finetuned else ""),
                "loosen the gate, or use int4 / TensorRT int8 (they keep sensitive layers higher until it "
                "passes)" + (", or prune less / train longer" if finetuned else ""))
    return shipped
