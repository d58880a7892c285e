"""The training recipe: one config in, one run directory out (torchtune-style: read it top to bottom).

    set up processes and mesh → build model and data → precision, checkpointing, parallelism → hybrid optimizer
    → resume from the latest complete checkpoint → loop (forward/backward, unscale, clip, skip non-finite, step,
    log, evaluate (per domain) → move the domain mixture / raise augmentation on a plateau → checkpoint, roll back
    after K non-finite steps, skipping their batches from then on) → write ``final/`` (safetensors + model.json)

Run in one process (``dsedge train CONFIG``) or under torchrun (``torchrun --nproc-per-node N -m dsedge.cli train
CONFIG``); the distill recipe (distill.py) reuses this loop with its own ``forward_loss``.
"""
from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from ...runtime.errors import ConfigError, TrainingError
from . import parallel as par
from .checkpoint import Checkpointer
from .components import as_inputs, build_data, build_domain_weights, build_sampler, call_factory, first_forward
from .components import to_device
from .config import TrainConfig
from .domains import MultiDomain
from .evaluation import adapt, validation_figures
from .losses import make_loss
from .metrics import MetricsLog
from .optim import HybridOptimizer, WarmupCosine
from .plateau import PlateauMonitor
from .precision import PrecisionPolicy
from .reductions import clip_, dp_mean, global_loss, grad_norm
from .run_files import model_state_for_export, write_final, write_resolved_config
from .sampler import TokenBudgetBatchSampler, pad_collate

# forward_loss(model, inputs: tuple[Tensor, ...], target) -> scalar loss; runs inside the precision autocast
ForwardLoss = Callable[[torch.nn.Module, tuple, Any], torch.Tensor]


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    final_loss: float
    resumed_from: int = 0   # the checkpoint step this process started at (0: a fresh run)


def step_lr(schedulers: list) -> None:
    """Advance the LR schedulers one step; quiet about a step whose optimizer step was skipped (non-finite
    gradients, or the fp16 GradScaler's own skip), which still counts as a step of the schedule."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler", category=UserWarning)
        for s in schedulers:
            s.step()


# ----------------------------------------------------------------------------------------------------------- recipe
def run(cfg: TrainConfig, forward_loss: Callable[[Callable], ForwardLoss] | None = None,
        setup_extra: Callable[[par.DistEnv, PrecisionPolicy], None] | None = None) -> RunResult:
    """Train per ``cfg`` (collective under torchrun). ``forward_loss(hard_loss) -> ForwardLoss`` replaces the plain
    ``loss(model(*inputs), target)`` (the distill recipe's teacher + KD loss); ``setup_extra(env, policy)`` runs
    after the process group is up (e.g. to load a teacher). Raises ConfigError / TrainingError.

    A run that fails before its first step completes (a loss-shape, teacher or DDP error of that step) removes the
    run directory when it created it (``config.toml`` is written after that step), so nothing looks like a started
    run; a directory that was there before (a resume) keeps what it held."""
    env = par.init_distributed(cfg)
    run_dir = Path(cfg.out_dir)
    created = env.rank == 0 and not run_dir.exists()
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
        else:
            if created and run_dir.is_dir() and not (run_dir / "config.toml").exists():
                shutil.rmtree(run_dir, ignore_errors=True)  # only what this run wrote before its first step
            if env.owns_group and dist.is_initialized():
                dist.destroy_process_group()


def check_token_budget_world(state: dict, sampler: Any, world: int, run_dir: Path) -> None:
    """Refuse to resume a token-budget run on another number of processes than its checkpoint's: each process takes
    a batch of its own per step, so a step of 1 process is one batch and of 2 processes two. A checkpoint without
    ``world_size`` (written before it was recorded) is let through.

    Raises:
        ConfigError: naming both process counts.
    """
    saved = state.get("world_size")
    if not isinstance(sampler, TokenBudgetBatchSampler) or saved is None or saved == world:
        return

    def procs(n: int) -> str:
        return f"{n} process{'es' * (n != 1)}"

    raise ConfigError(f"{run_dir}: a token-budget run checkpointed by {procs(saved)} (step_{state['step']}) cannot "
                      f"resume on {procs(world)}: each process takes its own batch per step, so a step would take "
                      "other batches",
                      f"resume with --nproc-per-node {saved}, or set another out_dir for a new run")


def check_class_weights(model: torch.nn.Module, train_ds: Any, hard_loss: Callable, padded: bool) -> None:
    """``[loss] class_weights`` against the classes the model really gives, before the run directory is written:
    the first training sample through the plain model (CPU, eval mode, no grad) into ``hard_loss``.

    Raises:
        ConfigError: the loss's own, naming both counts. Any other error of this one-sample forward is left to the
            first training step (a forward may need the device the model is not on yet).
    """
    x, y = (pad_collate if padded else default_collate)([train_ds[0]])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(*as_inputs(x))
    except Exception:  # not this check's business: the first step reports it, as it always did
        return
    finally:
        model.train(was_training)
    hard_loss(out[0] if isinstance(out, (tuple, list)) else out, y)


def check_all_used(model: torch.nn.Module, cfg: TrainConfig) -> None:
    """After the first backward under DDP: every trainable parameter got a gradient. DDP (without the costly
    ``find_unused_parameters``) otherwise fails the next step with a RuntimeError traceback on every rank.

    Raises:
        ConfigError: naming the parameters ``forward()`` did not use.
    """
    unused = [n.removeprefix("module.") for n, q in model.named_parameters() if q.requires_grad and q.grad is None]
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ConfigError(f"{cfg.source}: [model] {cfg.model.factory}: forward() leaves {', '.join(unused[:5])}{more} "
                          "unused, which data-parallel training (DDP) cannot reduce",
                          "use them in forward(), or freeze them (requires_grad_(False)) or delete them in the factory")


def _train(cfg: TrainConfig, env: par.DistEnv, forward_loss_factory: Callable | None) -> RunResult:
    run_dir = Path(cfg.out_dir)

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
    if cfg.checkpoint.activation_checkpointing and not par.blocks(model):  # else silently no recomputation at all
        raise ConfigError(f"{cfg.source}: [checkpoint] activation_checkpointing needs repeated blocks: the model has "
                          "no nn.ModuleList and is not an nn.Sequential", "keep the blocks in an nn.ModuleList, or "
                          "set activation_checkpointing = false")
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
    if cfg.loss.class_weights:
        check_class_weights(model, train_ds, hard_loss, isinstance(sampler, TokenBudgetBatchSampler))
    # the training step's loss: with class weights on several data-parallel ranks, normalized by the global batch's
    # weight sum (an all-reduce per step), so N processes train as one does (make_loss); pipeline runs keep the
    # per-rank mean (their loss runs per microbatch inside the schedule), as does validation
    step_loss = hard_loss
    if cfg.loss.class_weights and env.dp > 1 and env.pp == 1:
        step_loss = make_loss(cfg.loss, weight_mean=lambda t: dp_mean(t, env))
    forward_loss = forward_loss_factory(step_loss) if forward_loss_factory else None
    # the run directory only once the model and data could be built: a bad config or a missing data file leaves
    # nothing behind (config.toml once the checkpoints, if any, loaded: below)
    log = MetricsLog(run_dir / "metrics.jsonl", env.rank, total_steps, progress=cfg.health.progress,
                     tensorboard=cfg.health.tensorboard)

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
    lr_schedule = WarmupCosine(total_steps, cfg.schedule.warmup_fraction, cfg.schedule.min_lr_ratio)
    lr_schedulers = lr_schedule.schedulers(optimizer)  # torch.optim.lr_scheduler, stepped once per loop step
    lr_signature = [lr_schedule.total, lr_schedule.warmup, lr_schedule.min_ratio, cfg.optim.lr]
    scaler = policy.grad_scaler()
    params = [q for q in model.parameters() if q.requires_grad]
    ckpt = Checkpointer(run_dir, env.rank, cfg.checkpoint.keep, log.message)

    # resume from the latest complete checkpoint. ``pos``: the data position of the next batch (0-based count of global
    # batches drawn), ahead of ``step`` by the batches skipped after a rollback (``skipped``: their positions)
    step, nonfinite, rollbacks = 0, 0, 0
    pos, skipped, streak = 0, set(), []

    def restore() -> dict | None:
        state = ckpt.load_latest(model, optimizer.optimizers)
        if state is not None:  # the checkpoint's lr, weight_decay, betas, eps replaced the config's: take them back
            optimizer.reset_hparams()
        if state is not None and scaler is not None and state.get("scaler"):
            # the running scale is the checkpoint's; the growth interval the config's (it was silently the old one)
            scaler.load_state_dict({**state["scaler"], "growth_interval": cfg.precision.growth_interval})
        if state is not None and domain_weights is not None and state.get("domains"):
            domain_weights.load_state_dict(state["domains"])
        if state is not None and plateau is not None and state.get("plateau"):
            plateau.load_state_dict(state["plateau"])
        if state is not None and state.get("lr_schedule") == lr_signature and state.get("lr_schedulers"):
            for s, sd in zip(lr_schedulers, state["lr_schedulers"]):
                s.load_state_dict(sd)
        elif state is not None:  # no scheduler state, or steps/[schedule] changed since: replay up to its step
            optimizer.set_lr_factor(1.0)
            lr_schedulers[:] = lr_schedule.schedulers(optimizer)
            for _ in range(state["step"]):
                step_lr(lr_schedulers)
        return state

    state = restore()
    # config.toml once the first step has completed (below): a resume refused (checkpoints of another model) or a
    # first step that fails (a loss-shape, teacher or DDP error) left it beside no run, or beside another run's files
    if state is not None:
        step = state["step"]
        check_token_budget_world(state, sampler, env.world_size, run_dir)
        pos, skipped = state.get("data_position", step), set(state.get("skipped_batches", ()))
        rollbacks = state.get("rollbacks", 0)
        log.truncate_after(step)
        log.event("resumed", step=step, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        log.message(f"resumed from checkpoint step_{step}")
    else:
        log.reset()  # a fresh start: records of an earlier run in this directory would mix trajectories
    if cfg.loss.class_weights and env.dp > 1 and env.pp > 1 and env.rank == 0:
        log.message(f"note: class_weights with {env.dp} data-parallel ranks of a pipeline: each rank takes the "
                    "weighted mean of its slice and the ranks average those, the global weighted mean only in "
                    "expectation (docs/train.md)")

    if plateau is not None:
        train_ds.set_augment_strength(plateau.strength)
    collate = pad_collate if isinstance(sampler, TokenBudgetBatchSampler) else None

    def batches_from(s: int):
        """``(data position, batch)`` from data position ``s`` on, without the ``skipped`` positions."""
        epoch, b = sampler.locate(s)
        while True:
            sampler.set_position(epoch, b)
            # a generator of its own: a loader without one draws its base seed from the global RNG when iterated, and
            # a resumed run iterates a new loader where the run it resumes did not, so its dropout diverged
            seeds = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
            for batch in DataLoader(train_ds, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                                    collate_fn=collate, persistent_workers=False, generator=seeds):
                if s not in skipped:
                    yield s, batch
                s += 1
            epoch, b = epoch + 1, 0

    data = batches_from(pos)
    model.train()
    start_step = step
    last_loss = float((state or {}).get("loss", "nan"))  # a no-op rerun reports the loss its checkpoint saw
    wrote_config = False
    while step < total_steps:
        t0 = time.perf_counter()
        batch_pos, (x, y) = next(data)
        pos = batch_pos + 1
        x, y = to_device(as_inputs(x), env.device), to_device(y, env.device)
        t_data = time.perf_counter() - t0
        lr = next((float(g["lr"]) for o in optimizer.optimizers for g in o.param_groups), 0.0)

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
                    out = first_forward(model, x, cfg) if step == start_step else model(*x)
                    loss = step_loss(out[0] if isinstance(out, (tuple, list)) else out, y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if comm is not None and step == start_step:  # DDP, first step of this process
                check_all_used(model, cfg)

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
        step_lr(lr_schedulers)  # a skipped step still moves the schedule on, as ``step`` does
        # under fp16 inf gradients are the scaler's business; only a non-finite loss counts toward a rollback
        bad = not math.isfinite(loss_value) if scaler is not None else not finite
        nonfinite = nonfinite + 1 if bad else 0
        streak = streak + [(step + 1, batch_pos)] if bad else []
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
        if not wrote_config and env.rank == 0:
            write_resolved_config(run_dir, cfg)
            wrote_config = True

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
            # skip the replayed batches of the non-finite steps: a bad batch would fail the same way every rollback
            from_step, step, pos = step, state["step"], state.get("data_position", state["step"])
            gone = [(s, p) for s, p in streak if p >= pos]
            skipped |= set(state.get("skipped_batches", ())) | {p for _, p in gone}
            where = [{"step": s, "epoch": sampler.locate(p)[0], "batch": sampler.locate(p)[1]} for s, p in gone]
            log.event("skipped_batches", step=step, batches=where)
            log.message(f"{nonfinite} non-finite steps in a row: rolled back from step {from_step} to "
                        f"step_{step} (rollback {rollbacks}/{cfg.health.max_rollbacks}); skipping the batch"
                        f"{'es' * (len(gone) != 1)} of step{'s' * (len(gone) != 1)} "
                        f"{', '.join(str(s) for s, _ in gone)}")
            nonfinite, streak = 0, []
            if plateau is not None:
                train_ds.set_augment_strength(plateau.strength)
            data = batches_from(pos)
            continue

        if step % cfg.checkpoint.every == 0 or step == total_steps:
            # evaluate first: the mixture and augmentation it moves are part of this checkpoint
            ev = validation_figures(model, val_ds, cfg, env, policy, hard_loss, schedule, step,
                                    share=domain_weights is not None or plateau is not None)
            resample = adapt(ev, step >= total_steps, train_ds, domain_weights, plateau, log)
            epoch, batch = sampler.locate(pos)
            trainer = {"epoch": epoch, "batch": batch, "rollbacks": rollbacks, "loss": last_loss,
                       "data_position": pos, "skipped_batches": sorted(skipped), "world_size": env.world_size,
                       "scaler": scaler.state_dict() if scaler is not None else None,
                       "lr_schedule": lr_signature, "lr_schedulers": [s.state_dict() for s in lr_schedulers]}
            if domain_weights is not None:
                trainer["domains"] = domain_weights.state_dict()
            if plateau is not None:
                trainer["plateau"] = plateau.state_dict()
            ckpt.save(step, model, optimizer.optimizers, trainer)
            log.event("checkpoint", **ev)
            if resample:  # no prefetched batch keeps the old mixture or strength
                data = batches_from(pos)

    state_dict = model_state_for_export(model, env)
    if env.rank == 0 and (step > start_step or not (run_dir / "final" / "model.json").exists()):  # a no-op rerun
        write_final(run_dir, cfg, state_dict, example, step)  # keeps the final/ (and precision) that run wrote
    log.event("finished", step=step, loss=last_loss)
    log.close()
    optimizer = model = schedule = params = None  # free them before returning (the restore closure holds them too)
    return RunResult(run_dir, step, last_loss, start_step)
