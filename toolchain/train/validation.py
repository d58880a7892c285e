"""Validation of a train/distill config (``TrainConfig``, toolchain/train/config.py): values that do not depend on
the world size (``validate``, at load) and the parallel layout for a world size (``check_world``, at launch). Every
failure is a one-line ConfigError naming the file and key."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...runtime.errors import ConfigError
from ...runtime.io import is_real

if TYPE_CHECKING:
    from .config import TrainConfig


MAX_STEPS = 10**9  # a billion optimizer steps: 12 days at 1 ms a step
MAX_EPOCHS = 10**6


def _choice(value: Any, allowed: tuple, key: str, source: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{source}: {key} = {value!r} is not one of {', '.join(map(repr, allowed))}",
                          f"use one of {', '.join(map(str, allowed))}")


def _positive(value: Any, key: str, source: str, allow_zero: bool = False, finite: bool = False) -> None:
    """ConfigError unless ``value`` is None or a number > 0 (>= 0 with ``allow_zero``; not inf with ``finite``);
    NaN never passes."""
    if value is not None and (math.isnan(value) or value < 0 or (value == 0 and not allow_zero)
                              or (finite and math.isinf(value))):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{source}: {key} must be {'a finite number ' if finite else ''}{bound}, got {value!r}",
                          "fix the value in the config file")


def _names(names: list, key: str, source: str, allow_empty: bool) -> None:
    """ConfigError unless ``names`` is a list of distinct non-empty strings (and not empty unless ``allow_empty``)."""
    if (not names and not allow_empty) or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names):
        raise ConfigError(f"{source}: {key} must be {'a list' if allow_empty else 'a non-empty list'} of distinct "
                          f"names (strings), got {names!r}", 'e.g. ["features"]')


def _class_weights(weights: list | None, source: str) -> None:
    """ConfigError unless ``[loss] class_weights`` is None or a non-empty list of finite numbers >= 0, not all 0.
    Its length (one weight per class) is checked against the model's logits at the first step (losses.py)."""
    if weights is None:
        return
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
    if not weights or not numbers or not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise ConfigError(f"{source}: [loss] class_weights must be finite numbers >= 0 (one per class, not all 0), "
                          f"got {weights!r}", "e.g. class_weights = [1.0, 4.0] for two classes")


def validate(cfg: TrainConfig, *, distill: bool = False) -> TrainConfig:
    """Check values that do not depend on the world size; raises ConfigError."""
    s = cfg.source
    if not cfg.out_dir:
        raise ConfigError(f"{s}: out_dir is missing", 'add out_dir = "runs/NAME" at the top level')
    if (cfg.steps is None) == (cfg.epochs is None):
        raise ConfigError(f"{s}: give exactly one of steps or epochs", "e.g. steps = 1000")
    _positive(cfg.steps, "steps", s)
    _positive(cfg.epochs, "epochs", s)
    for key, value, most in (("steps", cfg.steps, MAX_STEPS), ("epochs", cfg.epochs, MAX_EPOCHS)):
        if value is not None and value > most:  # a user's pass: steps = 1e19 ran (lr ~1e-17, still in warm-up)
            raise ConfigError(f"{s}: {key} = {value} is more than {most:,} (no run ends)",  # and wrote 9 GB
                              f"give the {key} the run needs, e.g. {key} = {1000 if key == 'steps' else 10}")
    for name, sec in (("model", cfg.model), ("data", cfg.data)):
        if not sec.factory or ":" not in sec.factory:
            raise ConfigError(f"{s}: [{name}] factory must be 'module:function', got {sec.factory!r}",
                              'e.g. factory = "samples.fraud.model:make_teacher"' if name == "model"
                              else 'e.g. factory = "samples.fraud.datasets:make_datasets"')
    _positive(cfg.data.batch_size, "[data] batch_size", s)
    _positive(cfg.data.num_workers, "[data] num_workers", s, allow_zero=True)
    if cfg.loss.kind not in ("cross_entropy", "bce_with_logits", "mse") and ":" not in cfg.loss.kind:
        raise ConfigError(f"{s}: [loss] kind = {cfg.loss.kind!r} is unknown",
                          "use cross_entropy, bce_with_logits, mse or 'module:function'")
    _class_weights(cfg.loss.class_weights, s)
    if cfg.loss.class_weights is not None and cfg.loss.kind != "cross_entropy":
        raise ConfigError(f"{s}: [loss] class_weights is for kind = 'cross_entropy', not {cfg.loss.kind!r}",
                          "use pos_weight with bce_with_logits, or remove class_weights")
    _positive(cfg.loss.pos_weight, "[loss] pos_weight", s, finite=True)
    if cfg.loss.pos_weight is not None and cfg.loss.kind != "bce_with_logits":  # else silently unused
        raise ConfigError(f"{s}: [loss] pos_weight is for kind = 'bce_with_logits', not {cfg.loss.kind!r}",
                          "use class_weights with cross_entropy, or remove pos_weight")
    _names(cfg.model.input_names, "[model] input_names", s, allow_empty=True)
    _names(cfg.model.output_names, "[model] output_names", s, allow_empty=False)
    d = cfg.data
    _positive(d.max_tokens, "[data] max_tokens", s)
    _positive(d.max_batch_size, "[data] max_batch_size", s)
    _positive(d.memory_limit_mb, "[data] memory_limit_mb", s, finite=True)
    _positive(d.bytes_per_token, "[data] bytes_per_token", s, finite=True)
    if len(cfg.optim.betas) != 2 or not all(is_real(b) and 0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"{s}: [optim] betas must be two numbers in [0, 1), got {cfg.optim.betas!r}",
                          "e.g. betas = [0.9, 0.98]")
    _positive(cfg.optim.lr, "[optim] lr", s, finite=True)
    _positive(cfg.optim.eps, "[optim] eps", s, finite=True)
    _positive(cfg.optim.weight_decay, "[optim] weight_decay", s, allow_zero=True, finite=True)
    _positive(cfg.optim.clip_grad_norm, "[optim] clip_grad_norm", s)
    if not 0 <= cfg.schedule.warmup_fraction < 1:
        raise ConfigError(f"{s}: [schedule] warmup_fraction must be in [0, 1), got {cfg.schedule.warmup_fraction}",
                          "e.g. warmup_fraction = 0.1")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        raise ConfigError(f"{s}: [schedule] min_lr_ratio must be in [0, 1], got {cfg.schedule.min_lr_ratio}",
                          "e.g. min_lr_ratio = 0.1 (the cosine ends at 10 % of lr)")
    _choice(cfg.precision.mode, ("fp32", "bf16", "fp16"), "[precision] mode", s)
    _positive(cfg.precision.initial_scale, "[precision] initial_scale", s, finite=True)
    _positive(cfg.precision.growth_interval, "[precision] growth_interval", s)
    _choice(cfg.device, ("auto", "cpu", "cuda"), "device", s)
    p = cfg.parallel
    _choice(p.data, ("ddp", "fsdp"), "[parallel] data", s)
    _choice(p.pipeline_schedule, ("gpipe", "1f1b"), "[parallel] pipeline_schedule", s)
    _choice(p.comm_hook, (None, "fp16", "bf16", "powersgd"), "[parallel] comm_hook", s)
    _positive(p.tensor, "[parallel] tensor", s)
    _positive(p.pipeline, "[parallel] pipeline", s)
    _positive(p.microbatches, "[parallel] microbatches", s)
    _positive(p.powersgd_rank, "[parallel] powersgd_rank", s)
    if p.comm_hook and p.data != "ddp":
        raise ConfigError(f"{s}: [parallel] comm_hook needs data = 'ddp'", "FSDP has no DDP comm hooks; remove it")
    _unused_settings(cfg)
    if p.pipeline > 1 and (cfg.precision.mode == "fp16" or distill):
        # checked here, not only by the ranks: under --nproc-per-node each rank printed it, then torchrun's traceback
        raise ConfigError(f"{s}: pipeline parallel supports fp32/bf16 training (no fp16, no distill)",
                          "set [parallel] pipeline = 1 or precision mode = 'bf16'")
    _positive(cfg.checkpoint.every, "[checkpoint] every", s)
    _positive(cfg.checkpoint.keep, "[checkpoint] keep", s)  # keep = 0 deleted every checkpoint, the last too
    _positive(cfg.health.max_nonfinite, "[health] max_nonfinite", s)
    _positive(cfg.health.max_rollbacks, "[health] max_rollbacks", s, allow_zero=True)
    if cfg.domains is not None:
        d = cfg.domains
        _choice(d.rule, ("threshold", "doremi"), "[domains] rule", s)
        _choice(d.metric, ("val_loss", "val_accuracy"), "[domains] metric", s)
        if not 0 < d.max_weight <= 1 or not 0 < d.step <= 1:
            raise ConfigError(f"{s}: [domains] step and max_weight must be in (0, 1], got {d.step}, {d.max_weight}",
                              "e.g. step = 0.1, max_weight = 0.5")
        if d.metric == "val_accuracy" and cfg.loss.kind != "cross_entropy":
            raise ConfigError(f"{s}: [domains] metric = 'val_accuracy' needs [loss] kind = 'cross_entropy'",
                              "use metric = 'val_loss' with this loss")
        _positive(d.eta, "[domains] eta", s, finite=True)
        if d.threshold is not None and not math.isfinite(d.threshold):
            raise ConfigError(f"{s}: [domains] threshold must be a finite number, got {d.threshold}",
                              "e.g. threshold = 0.9, or leave it out to keep the mixture fixed")
        if not all(is_real(w) and math.isfinite(w) and w >= 0 for w in d.weights.values()) or \
                (d.weights and not any(d.weights.values())):
            raise ConfigError(f"{s}: [domains] weights must be finite numbers >= 0, not all 0, got {d.weights!r}",
                              "e.g. weights = { web = 2, code = 1 }")
        if not 0 <= d.smoothing < 1:
            raise ConfigError(f"{s}: [domains] smoothing must be in [0, 1), got {d.smoothing}", "e.g. 1e-3")
    if cfg.augment is not None:
        a = cfg.augment
        if not a.levels or any(not is_real(x) or not math.isfinite(x) for x in a.levels) or \
                list(a.levels) != sorted(a.levels):
            raise ConfigError(f"{s}: [augment] levels must be increasing numbers, got {a.levels!r}",
                              "e.g. levels = [0.2, 0.4, 0.6]")
        _positive(a.patience, "[augment] patience", s)
        if not 0 <= a.min_improvement < 1:
            raise ConfigError(f"{s}: [augment] min_improvement must be in [0, 1), got {a.min_improvement}",
                              "e.g. 0.005 (0.5 %)")
    if distill:
        if cfg.distill is None or not cfg.distill.teacher:
            raise ConfigError(f"{s}: dsedge distill needs a [distill] section with teacher = RUN_DIR",
                              'add [distill] teacher = "runs/teacher"')
        if not 0 <= cfg.distill.alpha <= 1:
            raise ConfigError(f"{s}: [distill] alpha must be in [0, 1], got {cfg.distill.alpha}", "e.g. alpha = 0.7")
        _positive(cfg.distill.temperature, "[distill] temperature", s, finite=True)
        _positive(cfg.distill.feature_weight, "[distill] feature_weight", s, allow_zero=True, finite=True)
        feats = cfg.distill.features
        if not all(isinstance(v, str) and v for v in feats.values()):
            raise ConfigError(f"{s}: [distill] features must map student module names to teacher module names "
                              f"(strings), got {feats!r}", 'e.g. features = { "blocks.0" = "blocks.1" }')
        fw = cfg.distill.feature_weight
        if (feats and fw is None) or (fw and not feats):  # either alone trained without any feature loss, silently
            raise ConfigError(f"{s}: [distill] " + ("features needs feature_weight" if feats else
                                                    f"feature_weight = {fw} needs features"),
                              "set both (e.g. feature_weight = 1.0 with features = { student_module = "
                              "\"teacher_module\" }), or neither")
    return cfg


def _unused_settings(cfg: TrainConfig) -> None:
    """ConfigError for a setting that the rest of the config leaves without effect (it was silently unused): one
    given away from its default only."""
    s, p, pr = cfg.source, cfg.parallel, cfg.precision
    par_default, prec_default = type(p), type(pr)  # their class attributes are the defaults (config.py)
    if p.pipeline == 1 and p.microbatches != par_default.microbatches:
        raise ConfigError(f"{s}: [parallel] microbatches = {p.microbatches} has no effect with pipeline = 1 (only a "
                          "pipeline splits its batch into micro-batches)",
                          "remove microbatches, or set pipeline = 2 or more")
    if p.tensor == 1 and p.tensor_plan != par_default.tensor_plan:
        raise ConfigError(f"{s}: [parallel] tensor_plan has no effect with tensor = 1 (no module is sharded)",
                          "remove tensor_plan, or set tensor = 2 or more")
    if pr.mode != "fp16":  # only fp16 has a GradScaler
        for key in ("initial_scale", "growth_interval"):
            if getattr(pr, key) != getattr(prec_default, key):
                raise ConfigError(f"{s}: [precision] {key} = {getattr(pr, key)} has no effect with mode = "
                                  f"{pr.mode!r} (only fp16 has a loss scaler)",
                                  f"remove {key}, or set mode = 'fp16'")


def check_world(cfg: TrainConfig, world_size: int, device_type: str | None = None) -> int:
    """The data-parallel degree for ``world_size`` processes; ConfigError if the mesh cannot be laid out, if
    ``comm_hook`` is set with one data-parallel process (nothing to reduce), or (with ``device_type``, ``cpu`` or
    ``cuda``) if the data-parallel wrapper cannot run it. Checked by the launcher before
    any process starts and by every rank before the run directory is written."""
    p = cfg.parallel
    model_par = p.tensor * p.pipeline
    if world_size % model_par:
        raise ConfigError(
            f"{cfg.source}: tensor = {p.tensor} x pipeline = {p.pipeline} does not divide the world size {world_size}",
            f"launch a multiple of {model_par} processes (torchrun --nproc-per-node) or lower the degrees")
    dp = world_size // model_par
    if dp == 1 and p.comm_hook is not None:
        raise ConfigError(f"{cfg.source}: [parallel] comm_hook = {p.comm_hook!r} has no effect with one data-parallel "
                          f"process (world size {world_size}: no gradients to reduce)",
                          "remove comm_hook, or launch more processes (--nproc-per-node)")
    if cfg.data.batch_size % dp:
        raise ConfigError(f"{cfg.source}: [data] batch_size = {cfg.data.batch_size} is not divisible by the "
                          f"data-parallel degree {dp}", f"use a batch_size that is a multiple of {dp}")
    if dp > 1 and p.data == "ddp" and (p.tensor > 1 or p.pipeline > 1):
        # DDP's reducer asserts on several backward passes per step (pipeline micro-batches), measured
        raise ConfigError(f"{cfg.source}: data = 'ddp' cannot be combined with tensor or pipeline parallel",
                          "use data = 'fsdp' when tensor > 1 or pipeline > 1")
    if dp > 1 and p.data == "ddp" and p.comm_hook == "bf16" and device_type not in (None, "cuda"):
        raise ConfigError(f"{cfg.source}: [parallel] comm_hook = 'bf16' needs the NCCL backend (GPU); gloo cannot "
                          "reduce bf16", "use comm_hook = 'fp16' or 'powersgd' on CPU")
    mb = p.microbatches or p.pipeline
    if p.pipeline > 1 and (cfg.data.batch_size // dp) % mb:
        raise ConfigError(f"{cfg.source}: per-rank batch {cfg.data.batch_size // dp} is not divisible by "
                          f"microbatches = {mb}", "make batch_size / data-parallel degree a multiple of microbatches")
    return dp
