"""The training recipe: one config in, one run directory out (torchtune-style: read it top to bottom).

    set up processes and mesh → build model and data → precision, checkpointing, parallelism → hybrid optimizer
    → resume from the latest complete checkpoint → loop (forward/backward, unscale, clip, skip non-finite, step,
    log, evaluate (per domain) → move the domain mixture / raise augmentation on a plateau → checkpoint, roll back
    after K non-finite steps) → write ``final/`` (safetensors + model.json)

Run in one process (``dsedge train CONFIG``) or under torchrun (``torchrun --nproc-per-node N -m dsedge.cli train
CONFIG``); the distill recipe (distill.py) reuses this loop with its own ``forward_loss``.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...runtime.errors import ConfigError, TrainingError
from . import parallel as par
from .checkpoint import Checkpointer
from .config import DomainsConfig, TrainConfig, dump_toml, resolve_callable
from .domains import DomainBatchSampler, DomainWeights, MultiDomain
from .losses import make_loss
from .metrics import MetricsLog
from .optim import HybridOptimizer, WarmupCosine
from .plateau import PlateauMonitor
from .precision import PrecisionPolicy
from .sampler import ShardedBatchSampler, TokenBudgetBatchSampler, pad_collate

# forward_loss(model, inputs: tuple[Tensor, ...], target) -> scalar loss; runs inside the precision autocast
ForwardLoss = Callable[[torch.nn.Module, tuple, Any], torch.Tensor]


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    final_loss: float


# ------------------------------------------------------------------------------------------------------ components
def to_device(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x):
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def as_inputs(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def call_factory(cfg: TrainConfig, section: str, spec: str, kwargs: dict) -> Any:
    """Call the config's ``[section] factory`` (``module:function``) with its kwargs; ConfigError on a bad call."""
    factory = resolve_callable(spec, f"[{section}] factory")
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{cfg.source}: [{section}] factory {spec!r} failed: {e}",
                          f"check [{section}] kwargs against the function's parameters") from None


def build_data(cfg: TrainConfig) -> tuple[Any, Any]:
    """``(train_dataset, val_dataset | None)`` from the data factory; ConfigError when it returns something else.
    ``{name: dataset}`` dicts become ``MultiDomain`` (multi-domain sampling)."""
    out = call_factory(cfg, "data", cfg.data.factory, cfg.data.kwargs)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ConfigError(f"[data] factory {cfg.data.factory!r} must return (train_dataset, val_dataset or None)",
                          "return a 2-tuple")
    train_ds, val_ds = (MultiDomain(x) if isinstance(x, dict) else x for x in out)
    if cfg.domains is not None and not isinstance(train_ds, MultiDomain):
        raise ConfigError(f"{cfg.source}: [domains] needs multi-domain data", "make the [data] factory return "
                          "({name: train_dataset, ...}, {name: val_dataset, ...} or None)")
    if isinstance(train_ds, MultiDomain) and isinstance(val_ds, MultiDomain) and val_ds.names != train_ds.names:
        raise ConfigError(f"validation domains {val_ds.names} differ from the training domains {train_ds.names}",
                          "give both the same names in the same order")
    return train_ds, val_ds


def build_domain_weights(cfg: TrainConfig, dataset: MultiDomain) -> DomainWeights:
    d = cfg.domains or DomainsConfig()
    return DomainWeights(dataset.names, d.rule, d.weights, d.metric, d.threshold, d.step, d.max_weight, d.eta,
                         d.smoothing)


def build_sampler(cfg: TrainConfig, dataset: Any, env: par.DistEnv, weights: DomainWeights | None = None) -> Any:
    d = cfg.data
    if weights is not None:
        return DomainBatchSampler(dataset, weights, d.batch_size, env.dp_rank, env.dp, cfg.seed)
    if d.max_tokens is None and d.memory_limit_mb is None and d.max_batch_size is None:
        return ShardedBatchSampler(len(dataset), d.batch_size, env.dp_rank, env.dp, cfg.seed, d.shuffle)
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [as_inputs(dataset[i][0])[0].shape[0] for i in range(len(dataset))]
    return TokenBudgetBatchSampler(lengths, d.max_tokens, d.max_batch_size, d.memory_limit_mb, d.bytes_per_token,
                                   env.dp_rank, env.dp, cfg.seed, d.shuffle)


def grad_norm(params: list[torch.nn.Parameter], env: par.DistEnv) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32 scalar): DTensor shards reduced over their mesh, pipeline stages summed."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(g)
    sq = torch.zeros((), dtype=torch.float32, device=env.device)
    for key, grads in groups.items():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        sq = sq + n.float() ** 2
    if env.pp > 1:
        dist.all_reduce(sq, group=env.group("pp"))
    return sq.sqrt()


def clip_(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def global_loss(loss: torch.Tensor | None, env: par.DistEnv) -> float:
    """Mean of the data-parallel ranks' losses (each already a batch mean); only last-stage, tp-rank-0 ranks hold one."""
    has = loss is not None and env.is_last_stage and env.tp_rank == 0
    t = torch.tensor([float(loss.detach()) if has else 0.0, 1.0 if has else 0.0], dtype=torch.float64)
    if env.distributed:
        t = t.to(env.device)
        dist.all_reduce(t)
    return float(t[0] / t[1]) if float(t[1]) > 0 else float("nan")


def model_state_for_export(model: torch.nn.Module, env: par.DistEnv) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 state dict on CPU, gathered from every pipeline stage; complete on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload keeps the full dict on global rank 0 only: pipeline stages need it on each stage's first rank
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=env.pp == 1))
    sd = {k: v.detach().to("cpu").clone().contiguous() for k, v in sd.items()}
    if env.pp > 1:
        parts: list[Any] = [None] * env.world_size
        dist.all_gather_object(parts, sd if env.dp_rank == 0 and env.tp_rank == 0 else {})
        sd = {k: v for part in parts for k, v in part.items()}
    return sd


def write_final(run_dir: Path, cfg: TrainConfig, state: dict[str, torch.Tensor], example: tuple, step: int) -> Path:
    """``final/model.safetensors`` + ``final/model.json`` (factory, kwargs, io names, example shapes/dtypes), atomic."""
    from safetensors.torch import save_file

    from ...runtime.bundle import atomic_directory

    names = list(cfg.model.input_names) or [f"input_{i}" for i in range(len(example))]
    meta = {
        "format": "dsedge-trained-model", "version": 1, "step": step,
        "factory": cfg.model.factory, "kwargs": cfg.model.kwargs,
        "input_names": names, "output_names": list(cfg.model.output_names),
        "example_inputs": {n: {"shape": [1, *t.shape], "dtype": str(t.dtype).removeprefix("torch.")}
                           for n, t in zip(names, example)},
        "precision": cfg.precision.mode,
    }
    with atomic_directory(run_dir / "final") as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.json").write_text(json.dumps(meta, indent=2))
    return run_dir / "final"


def write_resolved_config(run_dir: Path, cfg: TrainConfig) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.toml.tmp"
    tmp.write_text(dump_toml(cfg.to_dict()))
    os.replace(tmp, run_dir / "config.toml")


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Any, cfg: TrainConfig, env: par.DistEnv, policy: PrecisionPolicy,
             loss_fn: Callable, schedule: Any = None) -> dict[str, float]:
    """Mean loss (and accuracy for cross_entropy, without pipeline) over the validation set; every rank runs the same
    batches (so FSDP/TP/pipeline collectives match). With a pipeline ``schedule`` the last stage computes the loss
    (``schedule.eval``), the tail that does not fill the micro-batches is left out, and the mean is shared."""
    from torch.utils.data import DataLoader

    model.eval()
    total, n, correct = 0.0, 0, 0
    loader = DataLoader(dataset, batch_size=max(1, cfg.data.batch_size // env.dp), shuffle=False,
                        drop_last=schedule is not None)
    for x, y in loader:
        x, y = to_device(as_inputs(x), env.device), to_device(y, env.device)
        with policy.autocast():
            if schedule is not None:
                losses: list = []
                if env.is_first_stage:
                    schedule.eval(*x, target=y if env.is_last_stage else None, losses=losses)
                else:
                    schedule.eval(target=y if env.is_last_stage else None, losses=losses)
                if losses:
                    total += float(torch.stack([v.float() for v in losses]).mean()) * len(y)
                n += len(y)
                continue
            out = model(*x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        total += float(loss_fn(out, y)) * len(y)
        n += len(y)
        if cfg.loss.kind == "cross_entropy":
            correct += int((out.argmax(-1) == y).sum())
    model.train()
    if schedule is not None:
        return {"val_loss": global_loss(torch.tensor(total / max(n, 1)), env)}
    res = {"val_loss": total / max(n, 1)}
    if cfg.loss.kind == "cross_entropy":
        res["val_accuracy"] = correct / max(n, 1)
    return res


def evaluate_domains(model: torch.nn.Module, dataset: MultiDomain, cfg: TrainConfig, env: par.DistEnv,
                     policy: PrecisionPolicy, loss_fn: Callable, schedule: Any = None) -> dict[str, Any]:
    """``evaluate`` per domain: ``domain_val_loss`` (and ``domain_val_accuracy``) {name: value}, and the
    sample-weighted overall ``val_loss`` (``val_accuracy``)."""
    per = {n: evaluate(model, dataset.domain(n), cfg, env, policy, loss_fn, schedule) for n in dataset.names}
    sizes = dict(zip(dataset.names, dataset.sizes))
    out: dict[str, Any] = {}
    for key in per[dataset.names[0]]:
        out[key] = sum(per[n][key] * sizes[n] for n in per) / sum(sizes.values())
        out[f"domain_{key}"] = {n: per[n][key] for n in per}
    return out


# ----------------------------------------------------------------------------------------------------------- recipe
def run(cfg: TrainConfig, forward_loss: Callable[[Callable], ForwardLoss] | None = None,
        setup_extra: Callable[[par.DistEnv, PrecisionPolicy], None] | None = None) -> RunResult:
    """Train per ``cfg`` (collective under torchrun). ``forward_loss(hard_loss) -> ForwardLoss`` replaces the plain
    ``loss(model(*inputs), target)`` (the distill recipe's teacher + KD loss); ``setup_extra(env, policy)`` runs
    after the process group is up (e.g. to load a teacher). Raises ConfigError / TrainingError."""
    env = par.init_distributed(cfg)
    ok = False
    try:
        if setup_extra is not None:
            setup_extra(env, PrecisionPolicy(cfg.precision.mode, env.device.type))
        result = _train(cfg, env, forward_loss)
        ok = True
        return result
    finally:
        if ok:
            par.teardown(env)
        elif env.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, env: par.DistEnv, forward_loss_factory: Callable | None) -> RunResult:
    run_dir = Path(cfg.out_dir)
    if env.rank == 0:
        write_resolved_config(run_dir, cfg)
    log = MetricsLog(run_dir / "metrics.jsonl", env.rank, progress=cfg.health.progress,
                     tensorboard=cfg.health.tensorboard)

    # model and data: same seed on every rank, so every rank builds the same initial weights
    torch.manual_seed(cfg.seed)
    model = call_factory(cfg, "model", cfg.model.factory, cfg.model.kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"[model] factory {cfg.model.factory!r} returned {type(model).__name__}, not an nn.Module",
                          "return a torch.nn.Module")
    train_ds, val_ds = build_data(cfg)
    example = as_inputs(train_ds[0][0])
    if cfg.model.input_names and len(cfg.model.input_names) != len(example):
        raise ConfigError(f"{cfg.source}: [model] input_names has {len(cfg.model.input_names)} names but the data "
                          f"gives {len(example)} inputs", "list one name per model input")
    domain_weights = build_domain_weights(cfg, train_ds) if isinstance(train_ds, MultiDomain) else None
    sampler = build_sampler(cfg, train_ds, env, domain_weights)
    plateau = None
    if cfg.augment is not None:
        if not hasattr(train_ds, "set_augment_strength"):
            raise ConfigError(f"{cfg.source}: [augment] needs a training set with set_augment_strength(strength)",
                              "add the method to the dataset the [data] factory returns, or remove [augment]")
        plateau = PlateauMonitor(cfg.augment.levels, cfg.augment.min_improvement, cfg.augment.patience)
    total_steps = cfg.steps if cfg.steps is not None else sampler.steps_for_epochs(cfg.epochs)
    hard_loss = make_loss(cfg.loss)
    forward_loss = forward_loss_factory(hard_loss) if forward_loss_factory else None

    # precision, activation checkpointing, parallelism (applied to the plain module, names kept)
    policy = PrecisionPolicy(cfg.precision.mode, env.device.type, cfg.precision.initial_scale,
                             cfg.precision.growth_interval)
    model.to(env.device)
    policy.apply(model)
    if cfg.checkpoint.activation_checkpointing:
        par.apply_activation_checkpointing(model)
    p = cfg.parallel
    schedule = None
    if env.pp > 1:
        if policy.mode == "fp16" or forward_loss is not None:
            raise ConfigError(f"{cfg.source}: pipeline parallel supports fp32/bf16 training (no fp16, no distill)",
                              "set [parallel] pipeline = 1 or precision mode = 'bf16'")
        model = par.pipeline_stage_module(model, env)
    if env.tp > 1:
        model = par.apply_tensor_parallel(model, env, p.tensor_plan)
    comm = None
    if env.dp > 1:
        if p.data == "fsdp":
            model = par.apply_fsdp(model, env, policy)
        else:
            if env.tp > 1 or env.pp > 1:
                # DDP's reducer asserts on several backward passes per step (pipeline micro-batches), measured
                raise ConfigError(f"{cfg.source}: data = 'ddp' cannot be combined with tensor or pipeline parallel",
                                  "use data = 'fsdp' when tensor > 1 or pipeline > 1")
            model, comm = par.apply_ddp(model, env, p.comm_hook, p.powersgd_rank)
    if env.pp > 1:
        schedule = par.build_pipeline_schedule(model, env, p.pipeline_schedule, p.microbatches or env.pp, hard_loss)

    optimizer = HybridOptimizer(model, cfg.optim.lr, cfg.optim.weight_decay, tuple(cfg.optim.betas), cfg.optim.eps,
                                cfg.optim.lamb_threshold)
    lr_factor = WarmupCosine(total_steps, cfg.schedule.warmup_fraction, cfg.schedule.min_lr_ratio)
    scaler = policy.grad_scaler()
    params = [q for q in model.parameters() if q.requires_grad]
    ckpt = Checkpointer(run_dir, env.rank, cfg.checkpoint.keep, log.message)

    # resume from the latest complete checkpoint
    step, nonfinite, rollbacks = 0, 0, 0

    def restore() -> dict | None:
        state = ckpt.load_latest(model, optimizer.optimizers)
        if state is not None and scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if state is not None and domain_weights is not None and state.get("domains"):
            domain_weights.load_state_dict(state["domains"])
        if state is not None and plateau is not None and state.get("plateau"):
            plateau.load_state_dict(state["plateau"])
        return state

    state = restore()
    if state is not None:
        step = state["step"]
        rollbacks = state.get("rollbacks", 0)
        log.truncate_after(step)
        log.event("resumed", step=step, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        log.message(f"resumed from checkpoint step_{step}")
    else:
        log.reset()  # a fresh start: records of an earlier run in this directory would mix trajectories

    from torch.utils.data import DataLoader

    if plateau is not None:
        train_ds.set_augment_strength(plateau.strength)
    collate = pad_collate if isinstance(sampler, TokenBudgetBatchSampler) else None

    def batches_from(s: int):
        epoch, b = sampler.locate(s)
        while True:
            sampler.set_position(epoch, b)
            yield from DataLoader(train_ds, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                                  collate_fn=collate, persistent_workers=False)
            epoch, b = epoch + 1, 0

    data = batches_from(step)
    model.train()
    last_loss = float("nan")
    while step < total_steps:
        t0 = time.perf_counter()
        x, y = next(data)
        x, y = to_device(as_inputs(x), env.device), to_device(y, env.device)
        t_data = time.perf_counter() - t0
        lr = optimizer.set_lr_factor(lr_factor(step))

        # forward and backward
        loss = None
        if schedule is not None:
            losses: list = []
            with policy.autocast():
                if env.is_first_stage:
                    schedule.step(*x, target=y if env.is_last_stage else None, losses=losses)
                elif env.is_last_stage:
                    schedule.step(target=y, losses=losses)
                else:
                    schedule.step()
            if losses:
                loss = torch.stack([v.detach().float() for v in losses]).mean()
        else:
            with policy.autocast():
                if forward_loss is not None:
                    loss = forward_loss(model, x, y)
                else:
                    out = model(*x)
                    loss = hard_loss(out[0] if isinstance(out, (tuple, list)) else out, y)
            (scaler.scale(loss) if scaler is not None else loss).backward()

        # unscale, measure, clip, step (or skip a non-finite step)
        if scaler is not None:
            for o in optimizer.optimizers:
                scaler.unscale_(o)
        gnorm = grad_norm(params, env)
        loss_value = global_loss(loss, env)
        grads_finite = math.isfinite(float(gnorm))
        finite = grads_finite and math.isfinite(loss_value)
        if finite and cfg.optim.clip_grad_norm:
            clip_(params, cfg.optim.clip_grad_norm, gnorm)
        record: dict[str, Any] = {}
        if scaler is not None:
            record["loss_scale"] = float(scaler.get_scale())
            for o in optimizer.optimizers:
                scaler.step(o)  # skipped by the scaler itself when grads are inf/nan
            scaler.update()
        elif finite:
            optimizer.step()
        optimizer.zero_grad()
        # under fp16 inf gradients are the scaler's business; only a non-finite loss counts toward a rollback
        bad = not math.isfinite(loss_value) if scaler is not None else not finite
        nonfinite = nonfinite + 1 if bad else 0
        step += 1
        now = time.perf_counter()
        step_time = now - t0
        n_samples = len(y) * env.dp
        record.update(step=step, loss=loss_value, lr=lr, grad_norm=float(gnorm), step_time_ms=step_time * 1e3,
                      samples_per_s=n_samples / step_time, data_wait_fraction=t_data / step_time)
        if isinstance(sampler, TokenBudgetBatchSampler):
            record["tokens_per_s"] = x[0].shape[0] * x[0].shape[1] * env.dp / step_time
        if not finite:
            record["skipped"] = True
        if comm is not None:
            record["comm_bytes"] = comm.bytes_sent
            record["comm_bytes_uncompressed"] = comm.bytes_uncompressed
        log.write(record)
        if math.isfinite(loss_value):
            last_loss = loss_value

        if nonfinite >= cfg.health.max_nonfinite:
            if rollbacks >= cfg.health.max_rollbacks:
                raise TrainingError(f"loss or gradients non-finite for {nonfinite} steps in a row after "
                                    f"{rollbacks} rollbacks (step {step})",
                                    "lower [optim] lr, use bf16 instead of fp16, or check the data for NaN/Inf")
            state = restore()
            if state is None:
                raise TrainingError(f"loss or gradients non-finite for {nonfinite} steps in a row (step {step}) "
                                    "and no checkpoint to roll back to",
                                    "lower [optim] lr or checkpoint more often ([checkpoint] every)")
            rollbacks += 1
            log.event("rollback", from_step=step, to_step=state["step"], nonfinite=nonfinite, rollbacks=rollbacks)
            log.message(f"{nonfinite} non-finite steps in a row: rolled back from step {step} to "
                        f"step_{state['step']} (rollback {rollbacks}/{cfg.health.max_rollbacks})")
            step, nonfinite = state["step"], 0
            if plateau is not None:
                train_ds.set_augment_strength(plateau.strength)
            data = batches_from(step)
            continue

        if step % cfg.checkpoint.every == 0 or step == total_steps:
            # evaluate first: the mixture and augmentation it moves are part of this checkpoint
            ev: dict[str, Any] = {"step": step}
            if val_ds is not None:
                if isinstance(val_ds, MultiDomain):
                    ev.update(evaluate_domains(model, val_ds, cfg, env, policy, hard_loss, schedule))
                else:
                    ev.update(evaluate(model, val_ds, cfg, env, policy, hard_loss, schedule))
            if env.distributed and (domain_weights is not None or plateau is not None):
                box = [ev]  # rank 0's figures move the mixture and the strength on every rank alike
                dist.broadcast_object_list(box, src=0)
                ev = box[0]
            resample = False
            if domain_weights is not None:
                metric = "val_loss" if domain_weights.rule == "doremi" else domain_weights.metric
                if f"domain_{metric}" in ev and step < total_steps:
                    before = list(domain_weights.weights)
                    domain_weights.update(ev[f"domain_{metric}"])
                    resample = domain_weights.weights != before
                ev["domain_weights"] = domain_weights.as_dict()
            if plateau is not None:
                if "val_loss" in ev and step < total_steps and plateau.update(ev["val_loss"]):
                    train_ds.set_augment_strength(plateau.strength)
                    log.event("augment", step=step, strength=plateau.strength, level=plateau.level)
                    log.message(f"validation loss on a plateau: augmentation strength raised to {plateau.strength:g}")
                    resample = True
                ev["augment_strength"] = plateau.strength
            epoch, batch = sampler.locate(step)
            trainer = {"epoch": epoch, "batch": batch, "rollbacks": rollbacks,
                       "scaler": scaler.state_dict() if scaler is not None else None}
            if domain_weights is not None:
                trainer["domains"] = domain_weights.state_dict()
            if plateau is not None:
                trainer["plateau"] = plateau.state_dict()
            ckpt.save(step, model, optimizer.optimizers, trainer)
            log.event("checkpoint", **ev)
            if resample:  # no prefetched batch keeps the old mixture or strength
                data = batches_from(step)

    state_dict = model_state_for_export(model, env)
    if env.rank == 0:
        write_final(run_dir, cfg, state_dict, example, step)
    log.event("finished", step=step, loss=last_loss)
    log.close()
    del optimizer, model, schedule, params
    return RunResult(run_dir, step, last_loss)
