"""``dsedge build``: the ordered stages, each a function from artifact to artifact.

resolve source → export ONNX (+ parity) → [prune / fine-tune / QAT the torch source and re-export it
(``compensate``; only with ``--prune`` or ``--qat-steps``)] → compress (per precision) → fit the target's opset →
validate vs fp32 → measure CPU latency → write the bundle atomically (manifest, models/, build/trtexec.sh,
report.json).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..runtime.bundle import IOSpec, Variant, remove_stale_temp
from ..runtime.errors import AccuracyGateError, CalibrationError, ConfigError, PrecisionNotSupported, TargetError
from ..runtime.latency import time_calls
from ..targets import Target, get_target
from .bundle_writer import bundle_path, write_bundle
from .evaluate import compare_models
from .export import Exported, export_onnx
from .opset import convert_for_target, model_opset
from .precision import choose_precision
from .recipe import recipe_notes, trtexec_script
from .sources import Source, resolve_source

REPORT_SCHEMA = "dsedge.build-report/1"


@dataclass
class BuildOptions:
    """What ``dsedge build`` was asked for (CLI flags map one to one)."""

    model: str | None = None
    target: str = "jetson"
    out_dir: str = "out"
    precision: str = "auto"
    calib: str | None = None
    heldout: str | None = None              # .npz dir validating against fp32; with it, all of --calib calibrates
    fallback: bool = False
    block_size: int = 32
    algorithm: str = "auto"                 # INT4: auto (gptq with calibration data, else rtn) | rtn | awq | gptq | awq+gptq
    accuracy_gate: str | None = None        # e.g. "cosine:0.99": mixed precision until it passes on held-out data
    embeddings: bool = True
    keep_fp32: bool = True
    latency_iterations: int = 50
    threads: int | None = None
    dla_core: int | None = None
    engine: bool = False
    prune: str | None = None                # "channels:0.3" | "2:4": prune the torch source before export
    finetune_steps: int | None = None       # fine-tune after --prune (None = 500 for torch sources, 0 = none)
    qat_steps: int = 0                      # INT4 fake-quant fine-tune before export (0 = off; issue's default 500)


@dataclass
class BuildResult:
    bundle: Path
    report: dict[str, Any]


@dataclass
class Compressed:
    """A compressed ONNX file and what the compressor reported (layers, bytes, algorithm)."""

    path: Path
    precision: str
    details: dict[str, Any] = field(default_factory=dict)


def _compress_int4(exported: Exported, work: Path, opts: BuildOptions, source: Source) -> Compressed:
    import onnx

    from .quantize.int4 import quantize_int4

    model, details = quantize_int4(onnx.load(os.fspath(exported.path)), block_size=opts.block_size,
                                   embeddings=opts.embeddings)
    out = work / "models" / "int4.onnx"
    onnx.save(model, os.fspath(out))
    return Compressed(out, "int4", details)


# precision → compressor(exported, workdir, options, source). The compression toolchain registers more here.
COMPRESSORS: dict[str, Callable[[Exported, Path, BuildOptions, Source], Compressed]] = {"int4": _compress_int4}

# The compression toolchain's compressors: INT4 RTN/AWQ/GPTQ + accuracy gate, INT8, FP16/BF16 (issue 4).
from .quantize.compress import COMPRESSORS as TOOLCHAIN_COMPRESSORS  # noqa: E402

COMPRESSORS.update(TOOLCHAIN_COMPRESSORS)


def resolve_precision(target: Target, requested: str, fallback: bool) -> tuple[str, list[str]]:
    """The precision to build. ``auto`` takes the target's first preference this dsedge can build.

    Raises:
        PrecisionNotSupported: the target lacks it (see ``choose_precision``) or it is not implemented yet.
    """
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


def read_npz_dir(path: str | os.PathLike, specs: list[IOSpec], what: str = "calibration") -> dict[str, np.ndarray]:
    """Real inputs from the ``*.npz`` files of a directory (arrays named like the model's inputs, batch axis 0),
    concatenated in file order.

    Raises:
        CalibrationError: missing/empty directory, unreadable file, missing input names, dtypes or shapes that do
            not match the model's inputs, no sample at all.
    """
    from ..runtime.errors import InputError
    from ..runtime.io import validate_inputs

    input_names = [s.name for s in specs]
    d = Path(path)
    if not d.is_dir():
        raise CalibrationError(f"{what} directory {str(d)!r} does not exist", "pass a directory of .npz files")
    files = sorted(d.glob("*.npz"))
    if not files:
        raise CalibrationError(f"{what} directory {str(d)!r} has no .npz files",
                               f"save real inputs with np.savez(f, {', '.join(n + '=…' for n in input_names)})")
    parts: dict[str, list[np.ndarray]] = {n: [] for n in input_names}
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                missing = [n for n in input_names if n not in z.files]
                if missing:
                    raise CalibrationError(f"{f.name} lacks input {missing[0]!r}", f"each file needs: {', '.join(input_names)}")
                arrays = {n: z[n] for n in input_names}
                try:
                    validate_inputs(specs, arrays)
                except InputError as e:
                    raise CalibrationError(f"{f.name}: {e}", e.hint) from None
                for n in input_names:
                    parts[n].append(arrays[n])
        except (ValueError, OSError) as e:
            raise CalibrationError(f"{f.name} is not a readable .npz file ({e})", "write it with numpy.savez") from None
    data = {n: _concat_padded(n, v, what) for n, v in parts.items()}
    if len(next(iter(data.values()))) == 0:
        raise CalibrationError(f"{what} directory {str(d)!r} holds 0 samples", "save at least one sample per file")
    return data


def _concat_padded(name: str, arrays: list[np.ndarray], what: str) -> np.ndarray:
    """Concatenate along the batch axis; integer inputs (token ids, masks) of different lengths are zero-padded at
    the end to the longest, as a tokenizer's ``padding=True`` does (0 = padding id, masked position). Float inputs of
    different shapes raise CalibrationError: padding would change what they mean."""
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) == 1:
        return np.concatenate(arrays)
    if not all(np.issubdtype(a.dtype, np.integer) for a in arrays):
        raise CalibrationError(f"{what} input {name!r} has different shapes across files: {sorted(shapes)[:3]}",
                               "save every file with one shape (e.g. crop or pad to one size)")
    target = np.max([a.shape[1:] for a in arrays], axis=0)
    return np.concatenate([np.pad(a, [(0, 0)] + [(0, int(t - d)) for d, t in zip(a.shape[1:], target)])
                           for a in arrays])


def load_calibration_dir(path: str | os.PathLike, specs: list[IOSpec]) -> tuple[dict, dict]:
    """Real inputs from ``*.npz`` files (see ``read_npz_dir``) split in half: (calibration, validation).

    Raises:
        CalibrationError: as ``read_npz_dir``, or fewer than 2 samples.
    """
    data = read_npz_dir(path, specs)
    count = len(next(iter(data.values())))
    if count < 2:
        raise CalibrationError(f"calibration directory {str(path)!r} holds {count} sample(s)", "give at least 2 (more is better)")
    half = count // 2
    return {n: v[:half] for n, v in data.items()}, {n: v[half:] for n, v in data.items()}


def _count(arrays: dict[str, np.ndarray]) -> int:
    return int(len(next(iter(arrays.values()))))


def check_dla(target: Target, dla_core: int | None) -> None:
    """Raises TargetError when ``--dla N`` names a DLA core the target does not have."""
    if dla_core is None:
        return
    if target.dla_cores == 0:
        raise TargetError(f"{target.name} has no DLA", "drop --dla; DLA exists on jetson-orin and jetson-xavier")
    if not 0 <= dla_core < target.dla_cores:
        raise TargetError(f"{target.name} has DLA cores 0–{target.dla_cores - 1}, not {dla_core}",
                          f"pass --dla 0 … {target.dla_cores - 1}")


def fit_target(path: Path, target: Target) -> int:
    """Rewrite the ONNX file at ``path`` at an opset ``target`` reads (see ``convert_for_target``); returns the opset.

    Raises:
        TargetError: impossible for the target (e.g. INT4 block DequantizeLinear on an opset ≤ 17 target).
    """
    import onnx

    model = convert_for_target(onnx.load(os.fspath(path)), target)
    onnx.save(model, os.fspath(path))
    return model_opset(model)


def shape_ranges_for(exported: Exported, target: Target, source: Source) -> dict[str, dict[str, int]]:
    """min/opt/max per symbolic dim: the target profile's for ``batch``/``sequence``, else the example's size."""
    ranges: dict[str, dict[str, int]] = {}
    for spec in exported.inputs:
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str) and d not in ranges:
                if d in target.shapes:
                    ranges[d] = dict(target.shapes[d])
                else:
                    n = int(source.example_inputs[spec.name].shape[axis]) if spec.name in source.example_inputs else 1
                    ranges[d] = {"min": 1, "opt": n, "max": max(n, 1)}
    return ranges


def measure_latency(onnx_path: Path, exported: Exported, iterations: int, threads: int | None,
                    vocab_size: int | None = None) -> dict[str, Any]:
    """ORT CPU latency at batch 1 (sequence 32 for text), ms."""
    from ..runtime.backends.ort import OrtBackend
    from ..runtime.bench import synthetic_inputs

    backend = OrtBackend(onnx_path, providers=["CPUExecutionProvider"], threads=threads)
    feeds = synthetic_inputs(exported.inputs, batch=1, seq_len=32, vocab_size=vocab_size)
    stats = time_calls(lambda: backend.run(feeds), iterations=iterations, warmup=5)
    return {"1": {**stats, "shape": {k: list(v.shape) for k, v in feeds.items()}, "provider": backend.providers[0]}}


def measure_latency_side_by_side(paths: dict[str, Path], exported: Exported, iterations: int, threads: int | None,
                                 vocab_size: int | None = None) -> dict[str, dict[str, Any]]:
    """ORT CPU latency at batch 1 of several models, interleaved: each round calls every model once (rotating the
    order), so load from other processes falls on all candidates alike. Same record as ``measure_latency`` per
    precision, plus ``"side_by_side"``: the precisions timed together."""
    from ..runtime.backends.ort import OrtBackend
    from ..runtime.bench import latency_stats, synthetic_inputs

    backends = {p: OrtBackend(path, providers=["CPUExecutionProvider"], threads=threads) for p, path in paths.items()}
    feeds = synthetic_inputs(exported.inputs, batch=1, seq_len=32, vocab_size=vocab_size)
    for b in backends.values():
        for _ in range(5):
            b.run(feeds)
    names = list(backends)
    samples: dict[str, list[float]] = {p: [] for p in names}
    for r in range(max(iterations, 1)):
        for p in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter_ns()
            backends[p].run(feeds)
            samples[p].append((time.perf_counter_ns() - t0) / 1e6)
    shape = {k: list(v.shape) for k, v in feeds.items()}
    return {p: {"1": {**{k: round(v, 3) for k, v in latency_stats(np.asarray(samples[p])).items()},
                      "n": len(samples[p]), "shape": shape, "provider": backends[p].providers[0],
                      "side_by_side": names}} for p in names}


def _op_types(path: Path) -> list[str]:
    import onnx

    return sorted({n.op_type for n in onnx.load(os.fspath(path), load_external_data=False).graph.node})


def build_engines(work: Path, target: Target, exported: Exported, variants: list[Variant],
                  ranges: dict[str, dict[str, int]], name: str, dla_core: int | None) -> dict[str, bytes]:
    """``--engine``: build each variant's TensorRT engine on this machine (TensorRT and the target's GPU needed).

    Raises:
        BackendUnavailable: no TensorRT or no GPU here. TargetError: this GPU is not the target's.
    """
    from ..runtime.backends.tensorrt import build_engine_file
    from ..runtime.bundle import Manifest

    manifest = Manifest(name=name, target=target.to_dict(), inputs=exported.inputs, outputs=exported.outputs,
                        variants=variants, default_variant=variants[0].name, shape_ranges=ranges)
    out: dict[str, bytes] = {}
    for v in variants:
        path = build_engine_file(work, manifest, v, work / "engines", dla_core=dla_core)
        out[f"engines/{path.name}"] = path.read_bytes()
    return out


AUTO_MIN_COSINE = 0.98  # --precision auto keeps only variants at least this close to fp32 (cosine mean, held-out)
AUTO_MIN_SPEEDUP = 1.10  # ... and, choosing by latency, only compressed variants ≥ 10 % faster than fp32 at b1 p50


@dataclass
class Measured:
    """A candidate variant built, fitted, validated and timed during the measured ``auto`` choice."""

    compressed: Compressed
    opset: int
    accuracy: dict[str, Any]
    latency_ms: dict[str, Any]


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


def choose_auto(target: Target, exported: Exported, reference_onnx: Path, work: Path, opts: BuildOptions,
                source: Source, validation: dict[str, np.ndarray],
                log: Callable[[str], None]) -> tuple[str, dict[str, Measured], dict[str, Any]]:
    """``--precision auto``: walk the target's precision order (this version's compressors, then fp32), building and
    validating each candidate. A candidate is accurate when it passes ``--accuracy-gate`` or, without one, when its
    cosine mean vs fp32 on held-out inputs is at least ``AUTO_MIN_COSINE`` (fp32 always is). Targets with ``auto_by_latency`` (ORT CPU) build every candidate, time all
    of them side by side (interleaved, batch 1, ``measure_latency_side_by_side``) and keep the fastest accurate one,
    a compressed one only when it is at least ``AUTO_MIN_SPEEDUP`` × faster than fp32 (within measurement noise the
    exact model wins; e.g. INT8 Q/DQ Conv3d runs slower than fp32 on ORT CPU, so a 3-D CNN stays fp32). Other
    targets keep the first accurate one in their order. A candidate whose compressor refuses the model is skipped
    and said.

    Returns:
        (chosen precision, measured candidates by precision, the choice's record for report.json: rule, candidates
        with ``b1_p50_ms``, ``cosine_mean``, ``qualifies``, ``chosen`` and ``why``).
    """
    from ..runtime.errors import DsedgeError

    implemented = set(COMPRESSORS) | {"fp32"}
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
            comp = (Compressed(exported.path, "fp32", {}) if p == "fp32"
                    else COMPRESSORS[p](exported, work, opts, source))
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
    if target.auto_by_latency:
        lats = measure_latency_side_by_side({p: b[0].path for p, b in built.items()}, exported,
                                            opts.latency_iterations, opts.threads, source.vocab_size)
    else:
        lats = {p: measure_latency(b[0].path, exported, opts.latency_iterations, opts.threads, source.vocab_size)
                for p, b in built.items()}
    measured = {p: Measured(b[0], b[1], b[2], lats[p]) for p, b in built.items()}
    for p, m in measured.items():
        ok = p == "fp32" or qualifies(m.accuracy, gates)
        record["candidates"].append({"precision": p, "b1_p50_ms": m.latency_ms["1"]["p50"],
                                     "cosine_mean": m.accuracy.get("cosine_mean"), "qualifies": ok})
        log(f"auto candidate {p}: b1 p50 {m.latency_ms['1']['p50']:.2f} ms, "
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
    how = (f"b1 p50 on ORT CPU, {threads or 'default'} threads, timed side by side here" if target.auto_by_latency
           else "b1 p50 on ORT CPU here; chosen as the first accurate precision in the target's order")
    return f"auto: {chosen} ({', '.join(parts)}; {how})" + (f"; {'; '.join(skipped)}" if skipped else "")


def build(opts: BuildOptions, log: Callable[[str], None] = lambda s: None) -> BuildResult:
    """Run every stage and publish the bundle. Returns its path and the report (also in ``report.json``).

    Raises:
        TargetError / PrecisionNotSupported / SourceError / CalibrationError / QuantizationError: bad input, with
            nothing written to ``opts.out_dir`` except, at most, the empty directory itself.
    """
    t_start = time.perf_counter()
    target = get_target(opts.target)
    precision, notes = resolve_precision(target, opts.precision, opts.fallback)
    check_dla(target, opts.dla_core)
    from .compensate import check_options

    prune_spec, compensation_notes = check_options(opts, target)   # kept apart: auto rewrites `notes`
    gates = build_gates(opts.accuracy_gate)                          # bad specs fail before any work
    if opts.engine:  # fail before any work when this machine cannot build engines
        from ..runtime.backends.tensorrt import import_tensorrt

        import_tensorrt()
    log(f"target {target.name}: precision "
        + (precision if opts.precision != "auto" else f"auto (candidates measured below; {notes[0]})"))
    source = resolve_source(opts.model)
    log(f"source {source.kind}: {source.name}")
    compensating = prune_spec is not None or opts.qat_steps > 0
    if compensating and source.module is None:
        from .compensate import refuse_for_onnx

        refuse_for_onnx(opts)
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temp(out_dir)
    work = Path(tempfile.mkdtemp(prefix=f".dsedge-build-{os.getpid()}-", dir=out_dir))
    (work / "models").mkdir()
    try:
        timings: dict[str, float] = {}
        t = time.perf_counter()
        exported = export_onnx(source, work / "models" / "fp32.onnx")
        timings["export_s"] = time.perf_counter() - t
        log(f"exported ONNX ({exported.exporter}); parity max abs diff {exported.parity_max_abs_diff}")
        exported.inputs = [IOSpec(s.name, s.dtype, s.shape, source.value_ranges.get(s.name)) for s in exported.inputs]
        if opts.calib and opts.heldout:
            source.calibration = read_npz_dir(opts.calib, exported.inputs)
            source.validation = read_npz_dir(opts.heldout, exported.inputs, what="held-out")
            source.calibration_kind = f"--calib {opts.calib} ({_count(source.calibration)} samples)"
            source.validation_kind = (f"--heldout {opts.heldout} ({_count(source.validation)} samples, "
                                      "not calibrated on)")
        elif opts.calib:
            source.calibration, source.validation = load_calibration_dir(opts.calib, exported.inputs)
            source.calibration_kind = f"--calib {opts.calib} (first half, {_count(source.calibration)} samples)"
            source.validation_kind = f"--calib {opts.calib} (second half, not used for calibration)"
        elif opts.heldout:
            source.validation = read_npz_dir(opts.heldout, exported.inputs, what="held-out")
            source.validation_kind = f"--heldout {opts.heldout} ({_count(source.validation)} samples)"
        validation = source.validation if source.validation is not None else source.example_inputs

        reference_onnx = work / "reference-fp32.onnx"  # validation compares against the untouched export
        shutil.copyfile(exported.path, reference_onnx)
        compensation = None
        if compensating:
            t = time.perf_counter()
            if source.module is not None:
                from .compensate import compensate_torch

                compensation = compensate_torch(source, opts, prune_spec, log)
                exported = export_onnx(source, work / "models" / "fp32.onnx")   # the student
                exported.inputs = [IOSpec(s.name, s.dtype, s.shape, source.value_ranges.get(s.name))
                                   for s in exported.inputs]
                log(f"exported the fine-tuned student; parity max abs diff {exported.parity_max_abs_diff}")
            else:
                from .compensate import prune_onnx_source

                compensation = {"prune": prune_onnx_source(exported.path, prune_spec, source.calibration)}
                compensation_notes.append(f"ONNX source: --prune {prune_spec} applied to the ONNX graph without a "
                                          "fine-tune")
            if prune_spec is not None:
                compensation["prune"]["spec"] = str(prune_spec)
            if source.module is not None:
                compensation_notes.append("the fp32 variant is the " + ("pruned, fine-tuned" if prune_spec else
                                          "QAT-tuned") + " model; every variant's accuracy is measured against "
                                          "the original fp32 export")
            if prune_spec is not None and prune_spec.pattern == "2:4":
                compensation_notes.append("2:4: the engine recipe enables TensorRT's sparse tactics "
                                          "(--sparsity=enable), which run for FP16/INT8 GEMMs on sparse tensor cores")
            timings["compensate_s"] = time.perf_counter() - t
        if compensating:
            exported.reference = reference_onnx    # accuracy gates judge the shipped model against the original
        t = time.perf_counter()
        measured: dict[str, Measured] = {}
        choice = None
        if opts.precision == "auto":
            auto_reference = reference_onnx
            if compensating:  # a pruned/QAT student: auto judges the compression of the student itself
                auto_reference = work / "student-fp32.onnx"
                shutil.copyfile(exported.path, auto_reference)
            precision, measured, choice = choose_auto(target, exported, auto_reference, work, opts, source,
                                                      validation, log)
            if compensating:
                choice["rule"] += " vs the pruned/fine-tuned fp32 student (variants report accuracy vs the original)"
            how = "by measured latency" if target.auto_by_latency else "as the first accurate precision"
            skipped = [c["precision"] for c in choice["candidates"] if not c.get("qualifies")]
            notes = [f"auto chose {precision} for {target.name} {how} ({choice['rule']})"
                     + (f"; rejected: {', '.join(skipped)}" if skipped else "")]
            if target.auto_by_latency:                 # the measured timings that decided it
                notes.append(choice["why"])
            compressed = measured[precision].compressed
        else:
            compressed = (COMPRESSORS[precision](exported, work, opts, source) if precision != "fp32"
                          else Compressed(exported.path, "fp32", {}))
        timings["compress_s"] = time.perf_counter() - t
        if precision != "fp32":
            log(f"compressed to {precision}" + gate_summary(compressed.details))
        opsets = {p: m.opset for p, m in measured.items()}
        if precision not in opsets:
            opsets[precision] = fit_target(compressed.path, target)
        if opts.keep_fp32 and "fp32" not in opsets:
            opsets["fp32"] = fit_target(exported.path, target)
        log(f"fitted to {target.name}: opset {opsets[precision]}")

        t = time.perf_counter()
        variants: list[Variant] = []
        models: dict[str, Path] = {}
        candidates = [(precision, compressed.path)]
        if opts.keep_fp32 and precision != "fp32":
            candidates.append(("fp32", exported.path))
        fp32_size = reference_onnx.stat().st_size
        for name, path in candidates:
            if name in measured:  # already validated and timed by the measured auto choice
                lat = measured[name].latency_ms
                acc = (measured[name].accuracy if not compensating else
                       compare_models(reference_onnx, path, validation, task=source.task))
            else:
                acc = ({"reference": "self"} if name == "fp32" and opsets["fp32"] == 21 and not compensating else
                       compare_models(reference_onnx, path, validation, task=source.task))
                lat = measure_latency(path, exported, opts.latency_iterations, opts.threads, source.vocab_size)
            rel = f"models/{name}.onnx"
            models[rel] = path
            vnotes = [f"size vs fp32: {path.stat().st_size / fp32_size:.3f}"]
            if compensating:
                vnotes.append("from the pruned/QAT-tuned student, not the original model; accuracy is vs the original")
            invariant = compressed.details.get("batch_invariant") if name == precision else None
            variants.append(Variant(name=name, precision=name, file=rel, accuracy=acc, latency_ms=lat, notes=vnotes,
                                    batch_invariant=invariant))
        timings["validate_s"] = time.perf_counter() - t
        from .quantize.mixed import gate_values

        shipped = gate_values(variants[0].accuracy) if variants[0].accuracy.get("reference") != "self" else {}
        if gates and shipped:
            failing = [g for g in gates if g.metric in shipped and not g.passes(shipped[g.metric])]
            if failing:
                raise AccuracyGateError(
                    f"accuracy gate {opts.accuracy_gate} not met by the {precision} variant: "
                    + ", ".join(f"{g.metric} = {shipped[g.metric]:.5f}" for g in failing)
                    + " vs the original model" + (" (the pruning/QAT cost included)" if compensating else ""),
                    "loosen the gate, or use int4 / TensorRT int8 (they keep sensitive layers higher until it "
                    "passes)" + (", or prune less / train longer" if compensating else ""))
        if compensating and shipped.get("cosine", 1.0) < AUTO_MIN_COSINE:
            warning = (f"warning: the {precision} variant is at cosine {shipped['cosine']:.4f} vs the original model "
                       f"(below {AUTO_MIN_COSINE}): the pruning/QAT fine-tune did not recover it")
            log(warning)
            compensation_notes.append(warning)

        ranges = shape_ranges_for(exported, target, source)
        sparse = {"sparsity": "2:4"} if prune_spec is not None and prune_spec.pattern == "2:4" else {}
        vdicts = [{"name": v.name, "precision": v.precision, "file": v.file, "ops": _op_types(models[v.file]),
                   **sparse} for v in variants]
        io = [s.to_dict() for s in exported.inputs]
        recipe = trtexec_script(target, vdicts, io, ranges, dla_core=opts.dla_core)
        engine_notes = recipe_notes(target, vdicts, io, ranges, dla_core=opts.dla_core)
        dest = bundle_path(out_dir, source.name, target.name)
        report = {
            "schema": REPORT_SCHEMA, "bundle": dest.name, "target": target.name, "precision": precision,
            "notes": notes + compensation_notes + source.notes,
            "source": {"kind": source.kind, "ref": source.ref, "sha256": source.fingerprint,
                       **({"vocab_size": source.vocab_size} if source.vocab_size else {})},
            "export": {"exporter": exported.exporter, "opset": opsets[precision],
                       "parity_max_abs_diff": exported.parity_max_abs_diff},
            "engine_recipe": engine_notes,
            **({"precision_choice": choice} if choice else {}),
            **({"compensation": compensation} if compensation else {}),
            "compression": {k: v for k, v in compressed.details.items() if k != "layers"},
            "layers": compressed.details.get("layers", []),
            "validation": {"inputs": source.validation_kind,
                           "samples": int(len(next(iter(validation.values()))))},
            "variants": [{"name": v.name, "precision": v.precision, "size_bytes": int(models[v.file].stat().st_size),
                          "size_vs_fp32": round(models[v.file].stat().st_size / fp32_size, 4),
                          "accuracy": v.accuracy, "latency_ms": v.latency_ms} for v in variants],
            "fp32_size_bytes": fp32_size,
            "timings_s": {k: round(v, 2) for k, v in timings.items()},
        }
        extra: dict[str, str | bytes] = {"build/trtexec.sh": recipe}
        if opts.engine:
            extra.update(build_engines(work, target, exported, variants, ranges, source.name, opts.dla_core))
            report["engines"] = sorted(k for k in extra if k.startswith("engines/"))
        report["wall_time_s"] = round(time.perf_counter() - t_start, 2)
        write_bundle(dest, name=source.name, target=target.to_dict(), inputs=exported.inputs,
                     outputs=exported.outputs, models=models, variants=variants, default_variant=precision,
                     shape_ranges=ranges, latency_budget_ms=target.default_budget_ms,
                     source=report["source"], report=report, extra_files=extra)
        log(f"wrote {dest}")
        return BuildResult(dest, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
