"""Mixed precision under an accuracy gate: raise the most sensitive layers (INT4 → INT8 → float) until it passes.

1. Quantize every weight layer at the base precision (INT4 with RTN/AWQ/GPTQ) and measure the gate metric on
   held-out data against the fp32 model. If the gate passes, stop.
2. Sensitivity of each layer = how much the metric improves when that layer alone is raised one rung (INT4 → INT8)
   in the otherwise all-base model (measured on the held-out data, one ORT session per layer).
3. Raise layers greedily, most sensitive first, one rung at a time (INT4 → INT8, then INT8 → float), re-measuring
   after each, until the gate passes. If every layer is float and the gate still fails, raise AccuracyGateError
   saying the best value reached.
INT4 word-embedding tables already in the model (``tables``) are candidates too: a table's sensitivity is the gain
of raising it alone to float (its only other rung), and it is raised in the first pass when its turn comes, placed
among the layers (ranked by gain) before the first one whose gain per byte added is lower than the table's (on a
2-layer BERT the INT4 table alone held the cosine at 0.9987 with every layer float; on MiniLM the table is 2.3x the
whole INT4 model in float, so it comes after every layer that helps).

The report lists every raised layer, its rung, its measured sensitivity and rank, and the metric after the raise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from ...runtime.errors import AccuracyGateError, ConfigError, QuantizationError
from ..evaluate import judged_output, top1_neighbour_agreement
from .bf16_host import has_bf16, host_twin
from .calibration import CalibrationSource, check_batches, load_calibration, ort_session, read_batches
from .graph import drop_unused_initializer, ensure_qdq_opset, name_nodes, select_layers
from .weight_only import QuantizedLayer, assemble, layer_activations, quantize_layers

# metric → higher is better. cosine / cosine-min / top1 have a built-in measure on held-out data (vs fp32);
# drops (auc-drop, accuracy-drop) need a caller-supplied metric function.
METRICS = {"cosine": True, "cosine-min": True, "top1": True, "auc-drop": False, "accuracy-drop": False}
BUILTIN = ("cosine", "cosine-min", "top1")
RANGES = {"cosine": (-1.0, 1.0), "cosine-min": (-1.0, 1.0), "top1": (0.0, 1.0)}   # values a metric can take
# thresholds a gate accepts: higher-is-better in (0, 1] (at or below 0 every model passes); drops, as fractions of
# the original's score, in [0, 1) (a negative drop asks the compressed model to beat the original, 1 passes all)
THRESHOLDS = {"cosine": "(0, 1]", "cosine-min": "(0, 1]", "top1": "(0, 1]", "auc-drop": "[0, 1)",
              "accuracy-drop": "[0, 1)"}
LADDER = (4, 8, 32)
RUNG_NAMES = {4: "int4", 8: "int8", 32: "float"}


@dataclass(frozen=True)
class AccuracyGate:
    """``METRIC:THRESHOLD``. Higher-is-better metrics (cosine) pass at ``value >= threshold``; drops (auc-drop)
    pass at ``value <= threshold``."""

    metric: str
    threshold: float

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric]

    def passes(self, value: float) -> bool:
        return value >= self.threshold if self.higher_is_better else value <= self.threshold

    def gain(self, before: float, after: float) -> float:
        """Improvement from ``before`` to ``after`` (positive = better), whatever the metric's direction."""
        return (after - before) if self.higher_is_better else (before - after)

    def __str__(self) -> str:
        return f"{self.metric}:{self.threshold:g}"


def parse_gate(spec: str) -> AccuracyGate:
    """``"cosine:0.99"`` → AccuracyGate. Raises ConfigError on an unknown metric, a bad number, or a threshold
    outside ``THRESHOLDS`` (cosine, cosine-min, top1 in (0, 1]; auc-drop, accuracy-drop in [0, 1))."""
    metric, sep, value = spec.partition(":")
    metric = metric.strip().lower()
    if not sep or metric not in METRICS:
        raise ConfigError(f"accuracy gate {spec!r} is not METRIC:THRESHOLD with a known metric",
                          f"e.g. cosine:0.99; metrics: {', '.join(METRICS)}")
    try:
        threshold = float(value)
    except ValueError:
        raise ConfigError(f"accuracy gate {spec!r}: {value!r} is not a number", "e.g. cosine:0.99") from None
    check_threshold(spec, metric, threshold)
    return AccuracyGate(metric, threshold)


def check_threshold(spec: str, metric: str, threshold: float) -> None:
    """Refuse a threshold outside ``THRESHOLDS[metric]`` (NaN and infinities too) with a ConfigError."""
    if not np.isfinite(threshold):
        raise ConfigError(f"accuracy gate {spec!r}: the threshold is not a finite number", "e.g. cosine:0.99")
    lo, hi = RANGES.get(metric, (-np.inf, np.inf))
    if threshold > hi:
        raise ConfigError(f"accuracy gate {spec!r} can never be judged: {metric} lies in [{lo:g}, {hi:g}]",
                          "e.g. cosine:0.99, top1:0.95")
    if METRICS[metric]:
        if threshold <= 0:
            raise ConfigError(f"accuracy gate {spec!r}: a {metric} threshold must be in {THRESHOLDS[metric]}",
                              f"a {metric} gate at or below 0 passes almost any model; e.g. {metric}:0.99")
    elif not 0 <= threshold < 1:
        raise ConfigError(f"accuracy gate {spec!r}: a {metric} threshold must be in {THRESHOLDS[metric]}",
                          f"the largest drop allowed, as a fraction: e.g. {metric}:0.01 (one point); "
                          "0 = no drop at all")


def parse_gates(spec: str) -> list[AccuracyGate]:
    """``"cosine:0.99,top1:1.0"`` → every gate must pass; the first one drives the sensitivity ranking."""
    gates = [parse_gate(part) for part in spec.split(",") if part.strip()]
    if not gates:
        raise ConfigError("empty accuracy gate", "e.g. cosine:0.99")
    return gates


def cosine_metric(reference: onnx.ModelProto, heldout: CalibrationSource | list, *, output: int | str = 0,
                  reduce: str | None = None, top1: str = "argmax"
                  ) -> Callable[[onnx.ModelProto], dict[str, float] | float]:
    """Metric ``model -> {"cosine", "cosine-min", "top1"}`` of output ``output`` (index or name) per sample vs
    the fp32 ``reference`` on held-out batches. ``output=0`` (the default) is the first batched output: a rank-0 one
    (a loss, a count: one value per call, no samples) is skipped; a rank-0 output named (or indexed, past 0) is a
    ConfigError (``evaluate.judged_output``).

    Each sample's output (flattened) is compared with the reference's (cosine mean and min over samples).
    ``top1``: ``"argmax"`` (default) = the fraction of positions (every index but the last axis) whose argmax over
    the last axis is the reference's, as a classifier's top-1 agrees, the build report's ``argmax_agreement``;
    ``"neighbour"`` = the fraction of samples whose nearest other sample (cosine) is the same as under the
    reference, for embedding outputs (the report's ``top1_agreement`` of a sentence encoder). ``reduce="mean"|"min"``
    returns that one float instead. Reference outputs are computed once.
    """
    if top1 not in ("argmax", "neighbour"):
        raise ConfigError(f"top1 must be 'argmax' or 'neighbour', got {top1!r}", "argmax for classifiers")
    batches = check_batches(reference, read_batches(heldout, "held-out"), what="held-out")
    sess = ort_session(reference)
    names = [o.name for o in sess.get_outputs()]
    if isinstance(output, str) and output not in names:
        raise ConfigError(f"the model has no output {output!r}", f"outputs: {', '.join(names)}")
    first = sess.run(None, batches[0])
    asked = output if isinstance(output, str) else (names[output] if output else None)
    output = names.index(judged_output({n: np.ndim(a) for n, a in zip(names, first)}, asked, "the model"))
    refs = [first[output]] + [sess.run(None, b)[output] for b in batches[1:]]

    def metric(model: onnx.ModelProto) -> dict[str, float] | float:
        s = ort_session(host_twin(model) if has_bf16(model) else model)  # ORT CPU has no BF16 kernels
        ys, rs, cs, agree = [], [], [], []
        for b, r in zip(batches, refs):
            y = s.run(None, b)[output]
            if r.ndim >= 2 and r.shape[-1] > 1:
                agree.append((y.argmax(-1) == r.argmax(-1)).reshape(-1))
            y = y.reshape(r.shape[0], -1).astype(np.float64)
            r = r.reshape(r.shape[0], -1).astype(np.float64)
            cs.append((y * r).sum(1) / (np.linalg.norm(y, axis=1) * np.linalg.norm(r, axis=1) + 1e-30))
            ys.append(y)
            rs.append(r)
        c = np.concatenate(cs)          # per sample, so batches of different sequence lengths are fine
        if reduce is not None:
            return float(c.mean() if reduce == "mean" else c.min())
        if top1 == "argmax":
            agreement = float(np.concatenate(agree).mean()) if agree else float("nan")
        else:  # compares rows with each other: one width only
            same_width = len({y.shape[1] for y in ys}) == 1
            agreement = (top1_neighbour_agreement(np.concatenate(rs), np.concatenate(ys)) if same_width
                         else float("nan"))
        return {"cosine": float(c.mean()), "cosine-min": float(c.min()), "top1": agreement}

    return metric


def gate_values(accuracy: dict) -> dict[str, float]:
    """The built-in gate metrics from a validation record of :func:`dsedge.toolchain.evaluate.compare_models`
    (``cosine_mean`` → cosine, ``cosine_min`` → cosine-min, ``top1_agreement`` or ``argmax_agreement`` → top1)."""
    keys = {"cosine": "cosine_mean", "cosine-min": "cosine_min", "top1": "top1_agreement"}
    out = {m: float(accuracy[k]) for m, k in keys.items() if accuracy.get(k) is not None}
    if "top1" not in out and accuracy.get("argmax_agreement") is not None:
        out["top1"] = float(accuracy["argmax_agreement"])
    return out


class GateCheck:
    """Gate(s) plus the metric that measures them: ``measure(model) -> {metric: value}``, ``passes``, ``show``.

    ``metric`` None = the built-in :func:`cosine_metric` of ``output`` vs ``reference`` on ``heldout`` (then every
    gate must be a built-in metric). Raises ConfigError when a gate needs a metric function that is not given.
    """

    def __init__(self, gate: AccuracyGate | list[AccuracyGate] | str, *,
                 metric: Callable[[onnx.ModelProto], float | dict[str, float]] | None,
                 heldout: CalibrationSource | list | None, reference: onnx.ModelProto,
                 output: int | str = 0, top1: str = "argmax") -> None:
        self.gates = (parse_gates(gate) if isinstance(gate, str)
                      else [gate] if isinstance(gate, AccuracyGate) else list(gate))
        self.primary = self.gates[0]
        self.text = ",".join(str(g) for g in self.gates)
        if metric is None:
            custom = [g.metric for g in self.gates if g.metric not in BUILTIN]
            if custom or heldout is None:
                raise ConfigError(f"accuracy gate {self.text} needs held-out data and a metric for "
                                  f"{(custom or [self.primary.metric])[0]!r}",
                                  "pass held-out batches (cosine, top1) or a metric function")
            metric = cosine_metric(reference, heldout, output=output, top1=top1)
        self.metric = metric

    def measure(self, model: onnx.ModelProto) -> dict[str, float]:
        v = self.metric(model)
        values = dict(v) if isinstance(v, dict) else {self.primary.metric: float(v)}
        for g in self.gates:  # NaN fails every threshold: a gate that can never pass is a mistake, said as one
            if g.metric in values and values[g.metric] != values[g.metric]:
                raise ConfigError(f"accuracy gate {g}: {g.metric} is undefined for the gated output (top1 needs a "
                                  "class axis of 2 or more; neighbour agreement, one width of embedding)",
                                  "gate on cosine, or name another output")
        return values

    def passes(self, values: dict[str, float]) -> bool:
        return all(g.passes(values[g.metric]) for g in self.gates)

    def show(self, values: dict[str, float]) -> str:
        return ", ".join(f"{g.metric} = {values[g.metric]:.5f}" for g in self.gates)


def _float_table(model: onnx.ModelProto, table: onnx.TensorProto) -> None:
    """In place: the INT4 table ``table.name`` (a DequantizeLinear output) back to the float initializer ``table``,
    its codes, scales and zero points dropped."""
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and list(n.output) == [table.name])
    model.graph.node.remove(dq)
    for name in dq.input:
        drop_unused_initializer(model, name)
    model.graph.initializer.append(table)


def quantize_mixed(model: onnx.ModelProto, calibration: CalibrationSource | list, *,
                   gate: AccuracyGate | list[AccuracyGate] | str,
                   metric: Callable[[onnx.ModelProto], float | dict[str, float]] | None = None,
                   heldout: CalibrationSource | list | None = None, algorithm: str = "gptq",
                   block_size: int = 32, symmetric: bool = True, nodes: list[str] | None = None,
                   act_order: bool = True, on_step: Callable[[str], None] | None = None,
                   output: int | str = 0, max_probe: int | None = None,
                   reference: onnx.ModelProto | None = None, top1: str = "argmax",
                   tables: dict[str, onnx.TensorProto] | None = None) -> tuple[onnx.ModelProto, dict]:
    """INT4 weight-only model whose most sensitive layers are raised until ``gate`` passes.

    Args:
        calibration: data for AWQ/GPTQ (batches, ``.npz`` or directory).
        gate: AccuracyGate, a list of them, or ``"cosine:0.99"`` / ``"cosine:0.99,top1:1.0"`` (all must pass; the
            first drives the sensitivity ranking).
        metric: ``model -> value`` (or ``{metric: value}``) of the gate's metric(s); default for cosine /
            cosine-min / top1: :func:`cosine_metric` of ``output`` vs the fp32 model on ``heldout`` (required then).
            ``auc-drop`` etc. need a caller-supplied metric.
        on_step: called with a one-line progress message after each measurement.
        output: the output (index or name) the default cosine metric compares (0: the first batched output).
        top1: what the default metric's ``top1`` means: ``"argmax"`` or ``"neighbour"`` (:func:`cosine_metric`).
        reference: the fp32 model the default metric compares with (default ``model``); pass the original when
            ``model`` already has other parts quantized (e.g. INT4 embedding tables), so the gate sees the final
            model.
        max_probe: layers whose sensitivity is measured (one ORT evaluation each; default all): the ``max_probe``
            with the largest relative output error ||X(Wq-W)||²/||XW||² on calibration data, the others follow in
            that order. On MiniLM that proxy ranked the most sensitive layer (the last FFN output) 22nd of 36, so
            measuring every layer is the default.
        tables: the float32 initializers, by name, of word-embedding tables that are INT4 in ``model`` (a
            DequantizeLinear whose output keeps the table's name, as ``weight_only.quantize_embedding_tables``
            writes them): each a candidate the gate may raise to float (always probed).
    Returns:
        (model, report) — report["raised"] lists ``{node, from, to, sensitivity, rank, value_after, reason}`` (a
        table's ``node`` is its name, with ``"table": True``); report["tables"]: table name → ``"int4"``/``"float"``.
    Raises:
        AccuracyGateError when even all-float (tables included) fails (message says the best reached); ConfigError
        for a gate metric without a metric function; CalibrationError / QuantizationError as in
        :func:`quantize_weight_only`.
    """
    check = GateCheck(gate, metric=metric, heldout=heldout, reference=reference if reference is not None else model,
                      output=output, top1=top1)
    primary, gate_text = check.primary, check.text
    measure, passes, show = check.measure, check.passes, check.show
    log = on_step or (lambda msg: None)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    work = ensure_qdq_opset(name_nodes(work))               # once, not at every trial build
    layers = select_layers(work, nodes)
    load_calibration(work, calibration)                      # clear errors before the long part
    acts = layer_activations(work, calibration, layers)
    q: dict[int, dict[str, QuantizedLayer]] = {
        4: quantize_layers(work, layers, acts, bits=4, algorithm=algorithm, block_size=block_size,
                           symmetric=symmetric, act_order=act_order),
        8: quantize_layers(work, layers, acts, bits=8, symmetric=symmetric),
    }
    rung = {layer.node: 4 for layer in layers}
    tables = dict(tables or {})
    table_rung = {name: 4 for name in tables}

    def build(assign: dict[str, int], table_assign: dict[str, int] | None = None) -> onnx.ModelProto:
        out = assemble(work, [q[b][layer.node] for layer in layers if (b := assign[layer.node]) in q])
        for name, b in (table_assign or table_rung).items():
            if b == 32:
                _float_table(out, tables[name])
        return out

    values = measure(build(rung))
    base_values = dict(values)
    log(f"all int4 ({algorithm}, block {block_size}): {show(values)}")
    raised: list[dict] = []
    sensitivity: dict[str, float | None] = {}
    table_gain: dict[str, float] = {}
    if not passes(values):
        proxy = {lay.node: q[4][lay.node].result.rel_error or 0.0 for lay in layers}
        by_proxy = sorted(layers, key=lambda lay: -proxy[lay.node])
        probed = by_proxy if max_probe is None else by_proxy[:max_probe]
        n_probes = len(probed) + len(tables)               # the tables are candidates too, counted as the ranks are
        for i, layer in enumerate(probed):
            trial = dict(rung)
            trial[layer.node] = 8
            sensitivity[layer.node] = primary.gain(values[primary.metric], measure(build(trial))[primary.metric])
            log(f"sensitivity {i + 1}/{n_probes}: {layer.node} int4 -> int8 improves {primary.metric} by "
                f"{sensitivity[layer.node]:+.5f}")
        for i, name in enumerate(tables, len(probed) + 1):  # a table's next rung is float
            table_gain[name] = primary.gain(values[primary.metric],
                                            measure(build(rung, {**table_rung, name: 32}))[primary.metric])
            log(f"sensitivity {i}/{n_probes}: embedding table {name} int4 -> float improves {primary.metric} by "
                f"{table_gain[name]:+.5f}")
        rest = by_proxy[len(probed):]
        # (is a table, name), most sensitive first; the unprobed layers follow by their relative output error
        ranked = [(False, lay.node) for lay in sorted(probed, key=lambda lay: -sensitivity[lay.node])]
        # a table goes before the first layer whose gain per byte added is lower than its own: raising a table to
        # float adds 28 bits per entry (MiniLM's: ~41 MB, 2.3x the whole INT4 model), a layer to INT8 4 bits per
        # weight, so ranked by gain alone the table was raised first and the gated jetson MiniLM grew from 0.176 to
        # 0.605 of fp32 for the same gate (the greedy knapsack rule: value per unit of size)
        per_byte = {lay.node: sensitivity[lay.node] / max(lay.k * lay.n / 2, 1) for lay in probed}
        for name in sorted(tables, key=lambda t: -table_gain[t]):
            score = table_gain[name] / max(3.5 * float(np.prod(tables[name].dims)), 1)
            at = next((i for i, (is_table, u) in enumerate(ranked) if not is_table and per_byte[u] < score),
                      len(ranked))
            ranked.insert(at, (True, name))
        order = ranked + [(False, lay.node) for lay in rest]
        for lay in rest:
            sensitivity[lay.node] = None                   # not probed: ranked by its relative output error
        ranks = {u: i + 1 for i, u in enumerate(order)}
        for target in LADDER[1:]:
            for unit in order:
                if passes(values):
                    break
                is_table, name = unit
                if is_table:
                    if table_rung[name] == 32:
                        continue
                    before, to, gain = 4, 32, table_gain[name]
                    table_rung[name] = 32
                else:
                    if rung[name] >= target:
                        continue
                    before, to, gain = rung[name], target, sensitivity[name]
                    rung[name] = target
                values = measure(build(rung))
                raised.append({
                    "node": name, **({"table": True} if is_table else {}), "from": RUNG_NAMES[before],
                    "to": RUNG_NAMES[to], "sensitivity": gain, "rank": ranks[unit],
                    "value_after": values[primary.metric], "values_after": dict(values),
                    "rel_error_int4": None if is_table else proxy[name],
                    "reason": (f"raising it alone to {'float' if is_table else 'int8'} improves {primary.metric} by "
                               f"{gain:.5f} " if gain is not None else
                               f"relative output error at int4 {proxy[name]:.4f} ")
                              + f"(rank {ranks[unit]} of {len(order)}); gate {gate_text} not met at "
                                f"{RUNG_NAMES[before]}"})
                log(f"raised {'embedding table ' if is_table else ''}{name} {RUNG_NAMES[before]} -> "
                    f"{RUNG_NAMES[to]}: {show(values)}")
            if passes(values):
                break
        if not passes(values):
            every = "every weight layer" + (" and embedding table" if tables else "")
            raise AccuracyGateError(
                f"accuracy gate {gate_text} cannot be met: best {show(values)} with {every} in float",
                "loosen the gate, keep other parts (e.g. embeddings) in float, or check the held-out data")
    report = {
        "gate": gate_text, "algorithm": algorithm, "block_size": block_size, "symmetric": symmetric,
        "value_all_int4": base_values[primary.metric], "value": values[primary.metric],
        "values_all_int4": base_values, "values": values, "passed": True,
        "precision_by_layer": {layer.node: RUNG_NAMES[rung[layer.node]] for layer in layers},
        "layers": [dict(q[rung[lay.node]][lay.node].result.__dict__) if rung[lay.node] in q
                   else {"node": lay.node, "bits": 32, "algorithm": "float"} for lay in layers],
        "counts": {name: sum(1 for r in rung.values() if RUNG_NAMES[r] == name) for name in RUNG_NAMES.values()},
        "raised": raised, "sensitivity": sensitivity,
        "tables": {name: RUNG_NAMES[b] for name, b in table_rung.items()}, "table_sensitivity": table_gain,
        "int4_layers": [q[4][layer.node].result.__dict__ for layer in layers],
    }
    return build(rung), report


def require_int4_left(report: dict, name: str, offered: tuple[str, ...] = ()) -> None:
    """A gated search (``quantize_mixed``'s ``report``) whose gate raised every layer to INT8 or float left no INT4
    layer: a variant named int4 would be INT8 weight-only (or float). Raises QuantizationError saying the mix and,
    from ``offered`` (the target's precisions), what to build instead; ``name`` is the model's."""
    counts = report.get("counts") or {}
    n = sum(counts.values())
    if not n or counts.get("int4", 0):
        return
    tables = [t for t, p in (report.get("tables") or {}).items() if p == "int4"]
    raise QuantizationError(
        f"int4 kept none of {name}'s {n} layers INT4 to meet the accuracy gate {report.get('gate')}: "
        f"{counts.get('int8', 0)} INT8, {counts.get('float', 0)} float"
        + (f" (only the embedding table{'s' if len(tables) > 1 else ''} stayed INT4)" if tables else ""),
        "loosen --accuracy-gate, or build --precision "
        + " or ".join([p for p in ("int8", "fp16") if p in offered] or ["fp32"]))
