"""The training config (TOML or YAML): one file drives `dsedge train` and `dsedge distill`.

The contract is docs/train.md ("The config"; the samples follow it). Every section is a dataclass below; unknown keys, wrong
types and impossible settings raise :class:`~dsedge.runtime.errors.ConfigError` with the file, section and key in one
line and a hint (the closest known key, or what would work). Keys beyond the contract are optional and default to
the documented behaviour: ``device``; ``[data] num_workers, shuffle, max_tokens, max_batch_size, memory_limit_mb,
bytes_per_token``; ``[optim] lamb_threshold``; ``[schedule] min_lr_ratio``; ``[parallel] comm_hook, powersgd_rank,
tensor_plan``; ``[checkpoint] keep``; ``[health]``; ``[distill] features, feature_weight``; ``[domains]``
(multi-domain sampling, domains.py); ``[augment]`` (plateau-driven augmentation strength, plateau.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...runtime.errors import ConfigError
from .validation import validate


@dataclass
class ModelConfig:
    factory: str = ""
    kwargs: dict = field(default_factory=dict)
    input_names: list = field(default_factory=list)
    output_names: list = field(default_factory=lambda: ["logits"])


@dataclass
class DataConfig:
    factory: str = ""
    kwargs: dict = field(default_factory=dict)
    batch_size: int = 32  # global batch (all data-parallel ranks together), samples
    num_workers: int = 0
    shuffle: bool = True
    # token-budget sampler (variable-length sequences): any of these switches it on
    max_tokens: typing.Optional[int] = None
    max_batch_size: typing.Optional[int] = None
    memory_limit_mb: typing.Optional[float] = None
    bytes_per_token: typing.Optional[float] = None  # activation bytes per token, to turn memory_limit_mb into tokens


@dataclass
class LossConfig:
    kind: str = "cross_entropy"  # cross_entropy | bce_with_logits | mse | module:function(logits, target)
    pos_weight: typing.Optional[float] = None
    class_weights: typing.Optional[list] = None


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    lamb_threshold: int = 1024
    clip_grad_norm: typing.Optional[float] = 1.0


@dataclass
class ScheduleConfig:
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.0


@dataclass
class PrecisionConfig:
    mode: str = "fp32"  # fp32 | bf16 | fp16
    initial_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass
class ParallelConfig:
    data: str = "ddp"  # ddp | fsdp
    tensor: int = 1
    pipeline: int = 1
    pipeline_schedule: str = "gpipe"  # gpipe | 1f1b
    microbatches: typing.Optional[int] = None
    comm_hook: typing.Optional[str] = None  # DDP gradient compression: fp16 | bf16 | powersgd
    powersgd_rank: int = 1
    tensor_plan: typing.Optional[dict] = None  # module fqn (glob) -> "colwise" | "rowwise"


@dataclass
class CheckpointConfig:
    every: int = 100
    activation_checkpointing: bool = False
    keep: typing.Optional[int] = None  # keep the newest N complete checkpoints (None: all)


@dataclass
class HealthConfig:
    max_nonfinite: int = 3  # consecutive non-finite steps before rolling back to the last checkpoint
    max_rollbacks: int = 2
    progress: typing.Optional[bool] = None  # None: a bar when stderr is a terminal
    tensorboard: bool = False


@dataclass
class DistillConfig:
    teacher: str = ""
    temperature: float = 4.0
    alpha: float = 0.7
    features: dict = field(default_factory=dict)  # student module fqn -> teacher module fqn (same shape)
    feature_weight: typing.Optional[float] = None  # required with features (0 turns the matching off)


@dataclass
class DomainsConfig:
    rule: str = "threshold"  # threshold | doremi
    weights: dict = field(default_factory=dict)  # initial {domain: weight}; default uniform
    metric: str = "val_loss"  # val_loss | val_accuracy (threshold rule)
    threshold: typing.Optional[float] = None  # no threshold: the mixture stays fixed
    step: float = 0.1
    max_weight: float = 0.5
    eta: float = 1.0
    smoothing: float = 1e-3


@dataclass
class AugmentConfig:
    levels: list = field(default_factory=lambda: [0.2, 0.4])  # augmentation strengths, one step at a time
    min_improvement: float = 0.005  # fraction of the best validation loss
    patience: int = 3  # evaluations without that improvement before the next level


@dataclass
class TrainConfig:
    out_dir: str = ""
    seed: int = 0
    steps: typing.Optional[int] = None
    epochs: typing.Optional[int] = None
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    distill: typing.Optional[DistillConfig] = None
    domains: typing.Optional[DomainsConfig] = None
    augment: typing.Optional[AugmentConfig] = None
    source: str = field(default="<dict>", metadata={"internal": True})  # the file it came from

    def to_dict(self) -> dict:
        """Plain data (TOML-serialisable: ``None`` values dropped), the resolved config written to the run dir."""
        return _drop_none({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                           if not f.metadata.get("internal")})


def _drop_none(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_drop_none(x) for x in v]
    return v


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, coerced value) for the few types configs use; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return True, None
        return _type_ok(value, args[0])
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is str:
        return isinstance(value, str), value
    if tp is list:
        return isinstance(value, list), value
    if tp is dict:
        return isinstance(value, dict), value
    return True, value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return _type_name([a for a in typing.get_args(tp) if a is not type(None)][0])
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, where: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or 'the file'} must be a table, got {type(data).__name__}",
                          "see docs/train.md (The config) for the layout")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{source}: unknown key {key!r} in {where or 'the top level'}", hint)
        tp = hints[key]
        if dataclasses.is_dataclass(tp) or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                                            and dataclasses.is_dataclass(typing.get_args(tp)[0])):
            sub = tp if dataclasses.is_dataclass(tp) else typing.get_args(tp)[0]
            kwargs[key] = _build(sub, value, f"[{key}]", source)
            continue
        ok, coerced = _type_ok(value, tp)
        if not ok:
            raise ConfigError(f"{source}: {where + ' ' if where else ''}{key} must be {_type_name(tp)}, "
                              f"got {value!r}", "fix the value's type in the config file")
        kwargs[key] = coerced
    return cls(**kwargs)


def from_dict(data: dict, source: str = "<dict>", *, distill: bool = False) -> TrainConfig:
    """Build and validate a TrainConfig from plain data (a parsed TOML/YAML file)."""
    cfg = _build(TrainConfig, data, "", source)
    cfg.source = source
    return validate(cfg, distill=distill)


def load_config(path: str | Path, *, distill: bool = False) -> TrainConfig:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) training config.

    Raises ConfigError: missing file, parse error (with line), unknown key, wrong type, impossible value.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", "pass the path of a .toml or .yaml training config")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML", "pip install pyyaml, or write the config as TOML")
        try:
            data = yaml.load(text, Loader=_yaml_loader(yaml)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}", "fix the syntax") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}", "fix the syntax (or use .yaml for YAML)") from None
    return from_dict(data, str(path), distill=distill)


def _yaml_loader(yaml: Any) -> type:
    """PyYAML's SafeLoader, also reading ``1e-3`` and ``1.0e5`` as floats: PyYAML follows YAML 1.1, where a float
    needs a dot and a signed exponent, so ``lr: 1e-3`` (YAML 1.2, and every other config language) came back as the
    string '1e-3'. Quoted values stay strings."""
    import re

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


def dump_toml(data: dict) -> str:
    """Serialise plain config data as TOML (tables after scalars; inline tables for dict values)."""
    import json

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    lines, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict) and k in {f.name for f in dataclasses.fields(TrainConfig)}:
            tables.append((k, v))
        else:
            lines.append(f"{k} = {val(v)}")
    for k, v in tables:
        lines.append(f"\n[{k}]")
        lines.extend(f"{kk} = {val(vv)}" for kk, vv in v.items())
    return "\n".join(lines) + "\n"


def resolve_callable(spec: str, what: str) -> Callable:
    """Import ``module:function``; the working directory is importable (configs name e.g. ``samples.x:make``)."""
    module, _, attr = spec.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{what} {spec!r}: module {e.name!r} not found",
                          "run from the folder that contains the package, or install it") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {module} has no callable {attr!r}", "check the function name")
    return fn
