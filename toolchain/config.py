"""What ``dsedge build`` is asked for: a typed, immutable ``BuildConfig`` (CLI flags or a ``build.toml``; flags
override the file) and ``plan_build``, which validates it once, up front, into a ``BuildPlan``.

Every incompatibility is refused in ``plan_build`` before any work is done (the torchtune habit: reject bad
combinations in one place): unknown target, a precision the target lacks (without ``fallback``), a DLA core the
target does not have, a bad ``--prune`` / ``--accuracy-gate`` spec, QAT without INT4, an INT4 algorithm that would
undo the fine-tune, ``--engine`` on a machine without TensorRT, a ``--gate-output`` an ONNX file lacks.

A ``build.toml`` holds the same keys as ``BuildConfig`` (``[build]`` table or top level)::

    [build]
    model = "model.onnx"
    target = "jetson"
    precision = "int4"
    block_size = 32
"""
from __future__ import annotations

import difflib

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..runtime.build_settings import INT4_BLOCKS
from ..runtime.errors import ConfigError
from ..runtime.io import MAX_BUDGET_MS
from ..targets import Target, get_target

ALGORITHM_CHOICES = ("auto", "rtn", "awq", "gptq", "awq+gptq")
PRECISION_CHOICES = ("auto", "int4", "int8", "fp16", "bf16", "fp32")
BLOCK_SIZES = (16, 32, 64, 128)
# TensorRT's INT4 is per-block with block sizes 64 or 128 only (build_settings.INT4_BLOCKS); the default there is
# 64, the more accurate of the two (MiniLM jetson int4: cosine 0.9835 at 64; 0.9869 at 32, which TensorRT refuses)
DEFAULT_BLOCK_SIZE = {"tensorrt": 64, "onnxruntime": 32}


MAX_LATENCY_ITERATIONS = 100_000  # timed runs per variant at build (default 50): 17 min at 10 ms a run

@dataclass(frozen=True)
class BuildConfig:
    """What ``dsedge build`` was asked for (CLI flags map one to one; ``dsedge build --help`` says each)."""

    model: str | None = None
    target: str = "jetson"
    out_dir: str = "out"
    precision: str = "auto"
    calib: str | None = None
    heldout: str | None = None              # .npz dir validating against fp32; with it, all of --calib calibrates
    fallback: bool = False
    block_size: int | None = None           # INT4 weights per scale; None: 32 on ONNX Runtime targets, 64 on TensorRT ones
    algorithm: str = "auto"                 # INT4: auto (gptq with calibration data, else rtn) | rtn | awq | gptq | awq+gptq
    accuracy_gate: str | None = None        # e.g. "cosine:0.99": mixed precision until it passes on held-out data
    embeddings: bool = True
    keep_fp32: bool = True
    latency_iterations: int = 50
    budget_ms: float | None = None          # the bundle's default latency budget, ms (None: the target's)
    threads: int | None = None
    dla_core: int | None = None
    engine: bool = False
    prune: str | None = None                # "channels:0.3" | "2:4": prune the torch source before export
    finetune_steps: int | None = None       # fine-tune after --prune (None = 500 for torch sources, 0 = none)
    qat_steps: int = 0                      # INT4 fake-quant fine-tune before export (0 = off)
    gate_output: str | None = None          # the output accuracy is judged on (None: sentence_embedding / the first batched)

    def replace(self, **changes: Any) -> "BuildConfig":
        """A copy with ``changes`` (the config itself never changes)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the keys of a ``build.toml``'s ``[build]`` table), None values left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


FIELD_NAMES = tuple(f.name for f in fields(BuildConfig))


def config_from_mapping(data: Mapping[str, Any], what: str = "build config") -> BuildConfig:
    """A ``BuildConfig`` from plain data (``-`` and ``_`` both accepted in keys).

    Raises:
        ConfigError: an unknown key or a value of the wrong type.
    """
    clean: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(BuildConfig)}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = {"out": "out_dir", "dla": "dla_core"}.get(name, name)
        if name not in types:
            close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
            raise ConfigError(f"{what}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                              f"known keys: {', '.join(FIELD_NAMES)}")
        want = types[name]
        ok = (value is None and "None" in want) or (
            isinstance(value, bool) if want.startswith("bool") else
            isinstance(value, int) and not isinstance(value, bool) if want.startswith("int") else
            isinstance(value, (int, float)) and not isinstance(value, bool) if want.startswith("float") else
            isinstance(value, str))
        if not ok:
            kind = {"bool": "true or false", "int": "an integer", "float": "a number",
                    "str": "a string"}[want.split()[0]]
            raise ConfigError(f"{what}: {key} = {value!r} is not {kind}", f"write {key} as {kind}")
        if name == "threads" and value is not None and value < 1:
            raise ConfigError(f"{what}: threads = {value!r} is not an integer >= 1", "write threads = 2, or leave it out")
        if name == "latency_iterations" and not 1 <= value <= MAX_LATENCY_ITERATIONS:
            # 0 or -3 timed one run and shipped it as the p50/p99; 10**20 ran until killed
            raise ConfigError(f"{what}: latency_iterations = {value!r} is not an integer from 1 to "
                              f"{MAX_LATENCY_ITERATIONS}", "write latency_iterations = 50, or leave it out")
        clean[name] = value
    return BuildConfig(**clean)


def read_config_file(path: str | os.PathLike) -> BuildConfig:
    """``--config build.toml``: the ``[build]`` table (or the top level) as a ``BuildConfig``.

    Raises:
        ConfigError: missing or unreadable file, TOML syntax error, unknown key, wrong type.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"build config {str(p)!r} not found", "pass the path of a build.toml")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid TOML ({e})", "see docs/architecture.md for a build.toml example") from None
    table = data.get("build", data)
    if not isinstance(table, dict):  # `build = 3` crashed with an AttributeError traceback
        raise ConfigError(f"{p}: build = {table!r:.40} is not a table",
                          "write the options under a [build] table (see docs/architecture.md)")
    if "build" in data and len(data) > 1:  # `target = "cpu"` above [build] was dropped without a word
        other = next(k for k in data if k != "build")
        where = "table" if isinstance(data[other], dict) else "key"
        raise ConfigError(f"{p}: {where} {other!r} is outside [build], and only [build] is read",
                          f"move {other!r} under [build] (keys above the first [table] header belong to no table)"
                          if where == "key" else f"remove [{other}]; a build.toml holds one [build] table")
    return config_from_mapping(table, what=str(p))


def dump_config(config: BuildConfig) -> str:
    """``config`` as a ``build.toml`` text that ``read_config_file`` reads back to an equal config."""
    lines = ["[build]"]
    for key, value in config.to_dict().items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class BuildPlan:
    """A validated ``BuildConfig`` and what validating it decided.

    Attributes:
        config: the config as it will run (``algorithm`` may be ``rtn`` where ``auto`` would undo a fine-tune).
        target: the resolved target profile.
        precision: the precision to build (``auto`` stays ``auto``: candidates are measured later).
        notes: what was decided about the precision and why (report.json ``notes``).
        prune: the parsed ``--prune`` (a ``PruneSpec``) or None.
        finetune_notes: what validating ``--prune`` / ``--qat-steps`` decided (report.json ``notes``).
        gates: the parsed ``--accuracy-gate`` (list of ``Gate``).
    """

    config: BuildConfig
    target: Target
    precision: str
    notes: tuple[str, ...] = ()
    prune: Any = None
    finetune_notes: tuple[str, ...] = ()
    gates: tuple = field(default_factory=tuple)

    def chosen_for_user(self, precision: str) -> bool:
        """True when ``precision`` is built because dsedge chose it (``auto``, or ``--fallback`` stepping down),
        not because it was asked for by name."""
        return self.config.precision != precision or self.config.fallback

    @property
    def finetuning(self) -> bool:
        """True when the torch source is pruned and/or QAT-tuned before compression."""
        return self.prune is not None or self.config.qat_steps > 0


def _block_size(config: BuildConfig, target: Any) -> int:
    """The INT4 block size: the one given, else the target backend's default. TensorRT takes INT4 per block of 64
    or 128 only (TensorRT "Quantization Schemes"): another size for a TensorRT target is refused."""
    if config.block_size is None:
        return DEFAULT_BLOCK_SIZE.get(target.backend, 32)
    if target.backend == "tensorrt" and config.block_size not in INT4_BLOCKS and config.precision in ("auto", "int4"):
        raise ConfigError(f"--block-size {config.block_size} on {target.name}: TensorRT's INT4 takes blocks of "
                          f"{' or '.join(map(str, INT4_BLOCKS))} only",
                          f"pass --block-size {DEFAULT_BLOCK_SIZE['tensorrt']} (or 128), or leave it out")
    return config.block_size


def _check_int4_options(config: BuildConfig) -> None:
    """INT4-only options on a build that asked for another precision would be ignored without a word: refused."""
    if config.precision in ("auto", "int4"):
        return
    given = [flag for flag, on in (("--block-size", config.block_size != BuildConfig.block_size),
                                   ("--algorithm", config.algorithm != BuildConfig.algorithm),
                                   ("--no-embeddings", config.embeddings != BuildConfig.embeddings)) if on]
    if given:
        raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to INT4 weight-only "
                          f"quantization, and this build's precision is {config.precision}",
                          f"drop {', '.join(given)}, or pass --precision int4 (or auto)")


def _check_input_dirs(config: BuildConfig) -> None:
    """``calib`` / ``heldout`` from a build.toml (the CLI checks its flags itself) were only found missing after
    the export."""
    from ..runtime.errors import CalibrationError

    for key, value in (("calib", config.calib), ("heldout", config.heldout)):
        what = "calibration" if key == "calib" else "held-out"
        if value is not None and not Path(value).exists():
            raise CalibrationError(f"{what} directory {value!r} does not exist", "pass a directory of .npz files")
        if value is not None and not Path(value).is_dir():  # a file passed here failed after the export, "missing"
            raise CalibrationError(f"{key} = {value!r} is a file, not a {what} directory",
                                   "pass the directory that holds the .npz files")


def _check_heldout_is_not_calibration(config: BuildConfig) -> None:
    check_heldout_is_not_calibration(config.calib, config.heldout, ", or only --calib (its second half then validates)")


def check_heldout_is_not_calibration(calib_path: str | os.PathLike | None,
                                     heldout_path: str | os.PathLike | None, alternative: str = "") -> None:
    """``--heldout`` validates on data the model was not calibrated on (the report says so): the same folder, or
    the same files, as ``--calib`` would measure accuracy on the calibration data itself (``dsedge build`` and
    ``dsedge quantize``)."""
    if not (calib_path and heldout_path):
        return
    calib, held = Path(calib_path), Path(heldout_path)

    def files(p: Path) -> set[Path]:
        if p.is_dir():
            return {f.resolve() for f in p.glob("*.npz")}
        return {p.resolve()} if p.exists() else set()

    shared = files(calib) & files(held)
    if calib.resolve() == held.resolve() or shared:
        what = "is the same as" if calib.resolve() == held.resolve() else f"shares {len(shared)} file(s) with"
        raise ConfigError(f"--heldout {heldout_path} {what} --calib {calib_path}: accuracy would be measured "
                          "on the calibration data", f"pass held-out data the model is not calibrated on{alternative}")


def _check_gate_output(config: BuildConfig) -> None:
    """An ONNX file's outputs are known before any work: a ``--gate-output`` it lacks is refused here (other sources
    are checked once exported, where the accuracy is first measured)."""
    if config.gate_output is None or config.model is None:
        return
    path = Path(config.model)
    if path.suffix.lower() != ".onnx" or not path.is_file():
        return
    import onnx

    from .evaluate import check_gate_output

    try:
        graph = onnx.load(os.fspath(path), load_external_data=False).graph
    except Exception:  # not a readable ONNX file: resolving the source says so, with its own message
        return
    check_gate_output(config.gate_output, [o.name for o in graph.output], path.name)


def plan_build(config: BuildConfig) -> BuildPlan:
    """Validate ``config`` against itself, the target and this machine, before any work.

    Raises:
        TargetError / PrecisionNotSupported / ConfigError / BackendUnavailable: a bad combination, with nothing
            written.
    """
    from .student import check_options
    from .gates import build_gates
    from .target_precision import check_dla, resolve_precision

    if config.precision not in PRECISION_CHOICES:
        raise ConfigError(f"precision {config.precision!r} is not one of {', '.join(PRECISION_CHOICES)}",
                          "pass --precision auto, int4, int8, fp16, bf16 or fp32")
    if config.algorithm not in ALGORITHM_CHOICES:
        raise ConfigError(f"INT4 algorithm {config.algorithm!r} is not one of {', '.join(ALGORITHM_CHOICES)}",
                          "pass --algorithm auto, rtn, awq, gptq or awq+gptq")
    if config.block_size is not None and config.block_size not in BLOCK_SIZES:
        raise ConfigError(f"block size {config.block_size} is not one of {', '.join(map(str, BLOCK_SIZES))}",
                          "pass --block-size 32 (or 16, 64, 128)")
    if config.budget_ms is not None and not (math.isfinite(config.budget_ms) and 0 < config.budget_ms <= MAX_BUDGET_MS):
        raise ConfigError(f"budget {config.budget_ms!r} ms is not a number in (0, {MAX_BUDGET_MS:g}]",
                          "pass --budget-ms 20 (the default request budget the bundle serves with), or leave it out")
    _check_int4_options(config)
    _check_heldout_is_not_calibration(config)
    _check_input_dirs(config)
    _check_gate_output(config)
    from .bundle_writer import check_out_dir

    check_out_dir(config.out_dir)
    target = get_target(config.target)
    config = config.replace(block_size=_block_size(config, target))
    precision, notes = resolve_precision(target, config.precision, config.fallback)
    check_dla(target, config.dla_core)
    prune_spec, finetune_notes, algorithm = check_options(config, target)
    gates = build_gates(config.accuracy_gate)
    if config.engine:  # fail before any work when this machine cannot build engines
        from ..runtime.backends.tensorrt import import_tensorrt

        import_tensorrt()
    return BuildPlan(config=config.replace(algorithm=algorithm), target=target, precision=precision,
                     notes=tuple(notes), prune=prune_spec, finetune_notes=tuple(finetune_notes), gates=tuple(gates))
