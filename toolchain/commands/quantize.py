"""``dsedge quantize``: ONNX in, ONNX out — INT4 weight-only (RTN/AWQ/GPTQ), INT8 (static Q/DQ or dynamic),
FP16/BF16 with FP32 islands, or INT4 / INT8 mixed precision under an accuracy gate."""
from __future__ import annotations

import json
import re
from pathlib import Path

import click
from click.core import ParameterSource

from ...runtime.errors import ConfigError, QuantizationError, SourceError
from ...runtime.files import atomic_path, check_output_file, check_report_file, write_text_atomic
from ...runtime.params import FiniteFloat


def _load(path: Path):
    from ..sources import load_onnx_source

    if not path.is_file():
        raise SourceError(f"ONNX model {str(path)!r} not found", "pass the path of an .onnx file")
    return load_onnx_source(path)


def save_model_atomic(model, dest: Path, check=None) -> None:  # type: ignore[no-untyped-def]
    """Write ``model`` to ``dest`` via a temporary file and a rename (external data when over 1.8 GB).
    ``check(tmp_path)``, when given, runs on the written temporary file before the rename: if it raises, ``dest`` is
    left as it was. Always binary protobuf, whatever ``dest``'s suffix (onnx would pick JSON for ``.json``)."""
    import onnx

    big = model.ByteSize() > 1_800_000_000
    with atomic_path(dest) as tmp:
        onnx.save_model(model, str(tmp), format="protobuf", save_as_external_data=big,
                        location=dest.name + ".data" if big else None)
        if check is not None:
            check(tmp)


def check_loads_in_ort(path: Path, what: str, hint: str | None = None) -> None:
    """The model file at ``path`` must load in ONNX Runtime (an ``InferenceSession`` on the CPU provider): a
    converter that wrote a graph ORT rejects (e.g. mismatched types inside an If/Loop body) is caught here, not
    by whoever loads ``--output`` later. A kernel this host's CPU provider lacks (``NOT_IMPLEMENTED``, e.g. BF16
    Gemm) is not a broken model: the graph was read and type-checked before that, and a GPU runtime has it.

    Raises:
        QuantizationError: ORT refuses the model (its first line of reason); ``what`` names the model.
    """
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own Fail / InvalidGraph / InvalidArgument / RuntimeException classes
        if type(e).__name__ == "NotImplemented":
            return
        reason = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        # without ORT's code prefix and the temporary file's name ("Load model from /x/.out.onnx.tmp-… failed:")
        reason = re.sub(r"Load model from .*? failed:\s*", "", re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "",
                                                                     reason))[:300]
        raise QuantizationError(f"{what} does not load in ONNX Runtime ({reason}); nothing was written",
                                hint or "this is a dsedge bug for this model: report it with the model, and try "
                                "another --precision meanwhile") from None


def model_files_size(path: Path, format: str | None = None) -> int:
    """Bytes of the ONNX file at ``path`` plus the external data files it references (each file once, resolved
    beside the model as ONNX does; a missing one counts 0). ``format``: onnx's (``"protobuf"`` for a file
    ``save_model_atomic`` wrote, whatever its suffix); None lets onnx pick it from the suffix, as the source was
    read."""
    import onnx

    from ...runtime.external_data import external_locations

    model = onnx.load(str(path), format=format, load_external_data=False)
    files = {(path.parent / loc).resolve() for loc in external_locations(model) if loc}
    return path.stat().st_size + sum(f.stat().st_size for f in files if f.is_file())


@click.command("quantize")
@click.argument("model", type=click.Path(path_type=Path), required=False)
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Output .onnx path; MODEL itself is allowed (replaced only once the new model is complete).")
@click.option("--preset", default=None, help="A named compression preset (see --list-presets); the flags below "
              "given on the command line override its fields. Default: from --precision/--algorithm/--int8-mode.")
@click.option("--list-presets", is_flag=True, help="List the compression presets and exit.")
@click.option("--precision", type=click.Choice(["int4", "int8", "fp16", "bf16"]), default="int4", show_default=True)
@click.option("--algorithm", type=click.Choice(["auto", "rtn", "awq", "gptq", "awq+gptq"]), default="auto",
              show_default=True, help="INT4 algorithm (AWQ arXiv:2306.00978, GPTQ arXiv:2210.17323); auto = gptq "
              "with --calib data, else rtn (as dsedge build).")
@click.option("--block-size", type=click.IntRange(8, 4096), default=32, show_default=True,
              help="INT4 weights per scale along the input dimension.")
@click.option("--asymmetric", is_flag=True, help="INT4 weights with zero points (ONNX Runtime; not for TensorRT).")
@click.option("--calib", type=click.Path(path_type=Path), help="Calibration data: a .npz or a directory of .npz.")
@click.option("--heldout", type=click.Path(path_type=Path), help="Held-out data for --accuracy-gate (.npz or dir).")
@click.option("--accuracy-gate", "gate", help="METRIC:THRESHOLD[,…], e.g. cosine:0.99 or cosine:0.99,top1:1 "
              "(INT4: raise sensitive layers until all pass; INT8 static: keep the most sensitive layers float). "
              "Measured on --gate-output: cosine per sample, top1 = argmax agreement over its last axis.")
@click.option("--gate-output", "gate_output", default=None,
              help="The output --accuracy-gate measures (default: the model's first batched output; e.g. "
              "sentence_embedding for a sentence encoder whose first output is per-token).")
@click.option("--method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="INT8 activation calibration.")
@click.option("--int8-mode", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="static = W8A8 Q/DQ (TensorRT and ORT); dynamic = ORT CPU only.")
@click.option("--smooth-alpha", type=FiniteFloat(0, 1), default=None,
              help="INT8 static: SmoothQuant (arXiv:2211.10438) with this alpha first (e.g. 0.5).")
@click.option("--float-bias", is_flag=True,
              help="INT8 static: keep Conv/Gemm biases float, as TensorRT's ONNX parser needs (it refuses the INT32 "
              "bias DequantizeLinear written by default, which ORT CPU fuses into QLinearConv); dsedge build does "
              "this for TensorRT targets.")
@click.option("--nodes", help="Comma-separated node names to quantize (default: all MatMul/Gemm weights).")
@click.option("--embeddings/--no-embeddings", default=None,
              help="INT4: word-embedding tables (Gather tables of 1024+ rows) INT4 too, blockwise along the hidden "
              "dim, as dsedge build does, symmetric like the weights unless --asymmetric. Default: on, unless --nodes "
              "picks the layers.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), help="Write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout (last thing printed).")
@click.pass_context
def quantize(ctx: click.Context, model: Path | None, output: Path | None, preset: str | None, list_presets: bool,
             precision: str, algorithm: str, block_size: int, asymmetric: bool, calib: Path | None,
             heldout: Path | None, gate: str | None, method: str, int8_mode: str, smooth_alpha: float | None,
             float_bias: bool, nodes: str | None, embeddings: bool | None, gate_output: str | None, report_path: Path | None,
             as_json: bool) -> None:
    """Quantize an ONNX MODEL and write the result to --output (written atomically)."""
    from ..config import check_heldout_is_not_calibration
    from ..evaluate import check_gate_output
    from ..quantize.calibration import npz_files
    from ..quantize.compress import Calibration, compress, compress_int4_with_tables

    if list_presets:
        _print_presets(as_json)
        return
    if model is None or output is None:
        raise ConfigError(f"dsedge quantize needs {'MODEL and ' if model is None else ''}-o/--output",
                          "dsedge quantize MODEL -o OUT.onnx [--precision int4|int8|fp16|bf16], or "
                          "dsedge quantize --list-presets")
    check_output_file(output)
    if report_path:
        check_report_file(report_path, output, model)
    if algorithm == "auto":  # as dsedge build: GPTQ needs calibration data, RTN none
        algorithm = "gptq" if calib is not None else "rtn"
    chosen = _preset_from_flags(ctx, preset, precision=precision, algorithm=algorithm, block_size=block_size,
                                asymmetric=asymmetric, gate=gate, method=method, int8_mode=int8_mode,
                                smooth_alpha=smooth_alpha, nodes=nodes, float_bias=float_bias)
    _check_flags_apply(ctx, chosen)
    tables_too = chosen.precision == "int4" and (embeddings if embeddings is not None else chosen.nodes is None)
    if chosen.nodes is not None and chosen.precision != "int4":
        raise ConfigError(f"--nodes selects the layers of INT4 weight-only quantization; {chosen.precision} "
                          f"({chosen.algorithm}) converts every layer it supports",
                          "drop --nodes, or quantize those layers with --precision int4")
    if chosen.accuracy_gate:
        from ..quantize.mixed import parse_gates

        parse_gates(chosen.accuracy_gate)  # a bad spec is refused before any work, for every precision
        if heldout is None:
            raise SourceError("--accuracy-gate needs --heldout data", "pass --heldout DIR_OR_NPZ")
        check_heldout_is_not_calibration(calib, heldout)
        npz_files(heldout, "held-out")  # missing, or a directory without .npz: said before any work, as held-out
    m = _load(model)
    outputs = [o.name for o in m.graph.output]
    if gate_output is not None and not chosen.accuracy_gate:
        raise ConfigError("--gate-output names what --accuracy-gate measures, and no gate was given",
                          "add --accuracy-gate, or drop --gate-output")
    check_gate_output(gate_output, outputs, model.name)
    if chosen.precision == "int4":
        _refuse_nothing_for_int4(m, model, tables_too)
    gated = gate_output if gate_output is not None else 0
    source_size = model_files_size(model)  # before writing: -o may be MODEL itself; external data files included
    # INT4 and INT8 static search for the layers to keep higher; every other precision is checked once, after
    searched = chosen.accuracy_gate and (chosen.precision == "int4" or chosen.algorithm == "static")
    say = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    on_step = (lambda msg: click.echo(f"  {msg}", err=True)) if searched else None
    calibration = Calibration(calib, heldout=heldout, on_step=on_step, output=gated)
    # tables as the weights: symmetric (signed INT4, no zero points: what TensorRT's parser takes) unless
    # --asymmetric (or the preset) chose zero points
    out = (compress_int4_with_tables(m, chosen, calibration, tables=tables_too, symmetric_tables=chosen.symmetric)
           if chosen.precision == "int4"
           else compress(m, chosen, calibration))
    checked = _check_gate(m, out.model, chosen, heldout, gated) if chosen.accuracy_gate and not searched else {}
    if chosen.precision in ("int4", "int8"):
        from ..quantize.graph import quantized_nodes

        if not quantized_nodes(out.model):  # nothing it converts (no MatMul/Gemm weights, or --nodes none of them)
            click.echo(f"warning: no layer of {model} was quantized: it has none that {chosen.precision} "
                       f"({chosen.algorithm}) converts; it is written unquantized", err=True)
    if out.details.get("fp32_untyped_note"):  # e.g. BF16 Conv below opset 22: the file stays nearly fp32
        click.echo(f"warning: {out.details['fp32_untyped_note']}", err=True)
    save_model_atomic(out.model, output,
                      check=lambda tmp: check_loads_in_ort(tmp, f"the {chosen.precision} model made from {model}"))
    report = {"source": str(model), "output": str(output), "precision": chosen.precision,
              "size_bytes": model_files_size(output, format="protobuf"),  # binary whatever its suffix (.json)
              "source_size_bytes": source_size, **out.details, **checked}
    if chosen.precision == "int4":  # what it really is: a gate may have raised layers (and tables) above INT4
        report["layer_precisions"], report["int4_summary"] = int4_mix(out.details)
    if report_path:
        write_text_atomic(report_path, json.dumps(report, indent=2, default=float) + "\n")
    ratio = report["size_bytes"] / max(report["source_size_bytes"], 1)
    what = f"{report['int4_summary']};" if "int4_summary" in report else f"{chosen.precision},"
    say(f"wrote {output} ({what} {report['size_bytes'] / 1e6:.2f} MB, {ratio:.1%} of the source)")
    for r in report.get("raised", []):
        say(f"  kept {r['to']}: {r['node']} — {r['reason']}")
    for r in report.get("kept_float", []):
        if isinstance(r, dict):                       # the INT8 gate's records (INT4 lists bare node names)
            say(f"  kept float: {r['node']} — {r['reason']}")
    if as_json:
        click.echo(json.dumps(report, default=float))


def int4_mix(details: dict) -> tuple[dict[str, int], str]:
    """What an INT4 run made of the layers and word-embedding tables, from its report: (``{"int4", "int8",
    "float"}`` layer counts, one phrase for the output line), e.g. ``"int4: 0 of 12 layers INT4, 12 INT8, table
    float"`` when an accuracy gate raised everything, ``"int4: 12 of 12 layers INT4, table INT4"``."""
    if "precision_by_layer" in details:                   # the gated search (mixed.quantize_mixed)
        rungs = list(details["precision_by_layer"].values())
    else:                                                 # weight_only.quantize_weight_only
        rungs = [("int4" if r.get("bits") == 4 else "int8") for r in details.get("layers", [])]
        rungs += ["float"] * len([k for k in details.get("kept_float") or [] if isinstance(k, str)])
    counts = {p: rungs.count(p) for p in ("int4", "int8", "float")}
    higher = ", ".join(f"{counts[p]} {p.upper() if p == 'int8' else p}" for p in ("int8", "float") if counts[p])
    text = f"int4: {counts['int4']} of {len(rungs)} layer{'s' if len(rungs) != 1 else ''} INT4" + (
        f", {higher}" if higher else "")
    tables = dict(details.get("tables") or {})            # the gate's say, else the tables written INT4
    tables.update({t["name"]: "int4" for t in details.get("embeddings") or [] if t["name"] not in tables})
    if tables:
        each = sorted(set(tables.values()))
        text += (f", table {each[0].upper() if each[0] == 'int4' else each[0]}" if len(tables) == 1 else
                 f", tables: " + ", ".join(f"{list(tables.values()).count(p)} {p.upper() if p == 'int4' else p}"
                                           for p in each))
    return counts, text


def _refuse_nothing_for_int4(m, model: Path, tables: bool) -> None:  # type: ignore[no-untyped-def]
    """INT4 converts float MatMul/Gemm weight initializers and, with ``tables``, word-embedding tables (Gather tables
    of 1024+ rows); a model with neither (a pure CNN) would be written unquantized under the name "int4".

    Raises:
        QuantizationError: nothing INT4 converts (a quantized or fp16 model has its own message, first).
    """
    from ..quantize.graph import layer_coverage, refuse_quantized
    from ..quantize.int4 import find_weight_sites

    refuse_quantized(m)  # as compress would: "already quantized" is the reason then
    if find_weight_sites(m, embeddings=tables):
        return
    _, float_layers = layer_coverage(m)
    still = ", ".join(f"{c} {op}" for op, c in sorted(float_layers.items()))
    raise QuantizationError(
        f"int4 has nothing to quantize in {model.name}: it converts MatMul/Gemm weights"
        + (" and word-embedding tables" if tables else "") + " given as float initializers, and the model has none"
        + (f" (its weight layers: {still})" if still else ""),
        "quantize a CNN (Conv layers) with --precision int8 (W8A8, needs --calib data), or use --precision fp16")


def _check_gate(source, compressed, preset, heldout: Path, output: int | str = 0) -> dict:  # type: ignore[no-untyped-def]
    """``--accuracy-gate`` on a precision without a gated search (FP16/BF16, dynamic/row-wise/weight-only INT8):
    the compressed model vs the source on the held-out inputs. Returns ``{"gate", "gate_values"}``.

    Raises:
        AccuracyGateError: a gate is not met (nothing is written), with the values reached.
    """
    from ...runtime.errors import AccuracyGateError
    from ..quantize.mixed import GateCheck

    check = GateCheck(preset.accuracy_gate, metric=None, heldout=heldout, reference=source, output=output)
    values = check.measure(compressed)
    failing = [g for g in check.gates if not g.passes(values[g.metric])]
    if failing:  # enough digits that a value just under a tight threshold does not print as the threshold
        shown = ", ".join(f"{g.metric} = {values[g.metric]:.10g}" for g in failing)
        raise AccuracyGateError(f"accuracy gate {preset.accuracy_gate} not met by the {preset.precision} "
                                f"({preset.algorithm}) model: {shown} vs the source on --heldout",
                                "loosen the gate, or use int4 / int8 static: they keep the most sensitive layers "
                                "higher until it passes")
    return {"gate": preset.accuracy_gate, "gate_values": values}


def _check_flags_apply(ctx: click.Context, chosen) -> None:  # type: ignore[no-untyped-def]
    """Refuse flags given on the command line that the chosen preset would ignore without a word (``--nodes`` has
    its own message): ConfigError naming the flag."""
    static8 = chosen.precision == "int8" and chosen.algorithm == "static"
    if chosen.accuracy_gate is None and ctx.get_parameter_source("heldout") in (ParameterSource.COMMANDLINE,
                                                                                 ParameterSource.ENVIRONMENT):
        raise ConfigError("--heldout is the data --accuracy-gate measures, and no gate was given: it would not be read",
                          "add --accuracy-gate (e.g. cosine:0.99), or drop --heldout")
    applies = {"block_size": ("INT4", chosen.precision == "int4"),
               "algorithm": ("INT4", chosen.precision == "int4"),
               "smooth_alpha": ("INT8 static", static8), "method": ("INT8 static", static8),
               "float_bias": ("INT8 static", static8),
               "int8_mode": ("INT8", chosen.precision == "int8"),
               # INT8's quantizers write symmetric weights (zero points 0) whatever the flag: INT4 only
               "asymmetric": ("INT4", chosen.precision == "int4"),
               "embeddings": ("INT4", chosen.precision == "int4"),
               # INT8 dynamic/row-wise scale activations at run time, INT8 weight-only and FP16/BF16 read no data
               "calib": ("INT4 and INT8 static", chosen.precision == "int4" or static8)}
    why = {"calib": ": it reads no calibration data"}
    # the algorithm only where a precision has several ("bf16 (bf16 float16)" named the converter's registry key)
    run = chosen.precision + (f" {chosen.algorithm}" if chosen.precision in ("int4", "int8") else "")
    for param, (what, ok) in applies.items():
        if not ok and ctx.get_parameter_source(param) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            flag = "--" + ("no-" if ctx.params.get(param) is False and param == "embeddings" else "") \
                + param.replace("_", "-")
            raise ConfigError(f"{flag} applies to {what} quantization, and this run is {chosen.name} ({run})"
                              + why.get(param, ""),
                              f"drop {flag}, or pick a preset or --precision it applies to "
                              "(dsedge quantize --list-presets)")


def _preset_from_flags(ctx: click.Context, name: str | None, *, precision: str, algorithm: str, block_size: int,
                       asymmetric: bool, gate: str | None, method: str, int8_mode: str, smooth_alpha: float | None,
                       nodes: str | None, float_bias: bool = False):  # type: ignore[no-untyped-def]
    """The preset to run: ``--preset NAME`` with the flags given on the command line over it, or, without
    ``--preset``, the preset the flags name (``int4-ALGORITHM``, ``int8-static``, ``int8-dynamic``, ``fp16``,
    ``bf16``) with every flag applied."""
    from ..quantize.presets import get_preset

    def given(param: str) -> bool:
        return name is None or ctx.get_parameter_source(param) in (ParameterSource.COMMANDLINE,
                                                                    ParameterSource.ENVIRONMENT)

    if name is None:
        name = {"int4": f"int4-{algorithm}", "int8": f"int8-{int8_mode}"}.get(precision, precision)
        base = get_preset(name)
    else:
        base = get_preset(name)
        if given("precision") and precision != base.precision:
            raise ConfigError(f"--precision {precision} contradicts --preset {name} ({base.precision})",
                              "drop --precision or pick a preset of that precision")
        if given("algorithm") and base.precision == "int4":
            base = base.replace(algorithm=algorithm)
    changes: dict = {}
    if given("block_size"):
        changes["block_size"] = block_size
    if given("asymmetric"):
        changes["symmetric"] = not asymmetric
    if given("gate"):
        changes["accuracy_gate"] = gate
    if given("method"):
        changes["method"] = method
    if given("smooth_alpha"):
        changes["smooth_alpha"] = smooth_alpha
    if given("float_bias") and float_bias:
        changes["quantize_bias"] = False
    if given("nodes"):
        changes["nodes"] = tuple(n.strip() for n in nodes.split(",") if n.strip()) if nodes else None
    return base.replace(**changes)


def _print_presets(as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..quantize.algorithms import get_algorithm
    from ..quantize.presets import list_presets

    presets = list_presets()
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in presets]))
        return
    t = Table(title="compression presets (dsedge quantize --preset NAME)")
    for col in ("preset", "precision", "algorithm", "block size", "calibration data", "what"):
        t.add_column(col)
    for p in presets:
        needs = get_algorithm(p.precision, p.algorithm).needs_calibration
        t.add_row(p.name, p.precision, p.algorithm, str(p.block_size) if p.precision == "int4" else "—",
                  "needed" if needs else "optional", p.description)
    Console().print(t)
