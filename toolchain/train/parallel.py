"""Parallelism on one DeviceMesh: data (DDP or FSDP2), tensor (DTensor TP), pipeline (torch.distributed.pipelining).

The mesh is ``(pp, dp, tp)`` from ``init_device_mesh`` (gloo on CPU, NCCL on GPU). Each ``apply_*`` function takes
a plain ``nn.Module`` and returns it parallelized, so model code never knows how it is sharded (torchtitan's style).
Parameter names (FQNs) are kept: DDP's ``module.`` prefix is removed by torch.distributed.checkpoint.state_dict.
"""
from __future__ import annotations

import datetime
import fnmatch
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.errors import ConfigError
from .config import TrainConfig
from .validation import check_world
from .precision import PrecisionPolicy, is_norm


@dataclass
class DistEnv:
    """Where this process sits. ``mesh`` is None in a single process; ``*_group`` are None when that degree is 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    mesh: Any = None
    owns_group: bool = False  # this run created the process group (and so destroys it)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def submesh(self, name: str) -> Any:
        return None if self.mesh is None else self.mesh[name]

    def group(self, name: str) -> Any:
        return None if self.mesh is None else self.mesh.get_group(name)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` for ``device = 'cuda'`` (or ``auto`` with a GPU), else the CPU.

    Raises:
        ConfigError: CUDA asked and no GPU is visible, or ``local_rank`` is past the visible GPUs (more processes per
            node than GPUs) — before ``init_process_group``, where the other ranks would wait for this one.
    """
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{cfg.source}: device = 'cuda' but no CUDA GPU is visible", "use device = 'auto'")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(f"{cfg.source}: this process is local rank {local_rank} and only {count} CUDA GPU"
                              f"{'s are' if count != 1 else ' is'} visible (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                              f"start at most {count} process{'es' if count != 1 else ''} per node "
                              f"(--nproc-per-node {count}), one per GPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: TrainConfig) -> DistEnv:
    """Join the torchrun process group (env:// rendezvous) when launched by torchrun, and build the mesh.

    Raises ConfigError when tensor x pipeline does not divide the world size (see validation.check_world).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg, local_rank)
    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = check_world(cfg, world, device.type)
    env = DistEnv(world_size=world, local_rank=local_rank, device=device, dp=dp, tp=cfg.parallel.tensor,
                  pp=cfg.parallel.pipeline)
    if world == 1:
        return env
    if not dist.is_initialized():
        env.owns_group = True
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=int(os.environ.get("DSEDGE_PG_TIMEOUT",
                                                                                                    600))))
    from torch.distributed.device_mesh import init_device_mesh

    env.rank = dist.get_rank()
    env.mesh = init_device_mesh(device.type, (env.pp, env.dp, env.tp), mesh_dim_names=("pp", "dp", "tp"))
    env.pp_rank = env.mesh.get_local_rank("pp")
    env.dp_rank = env.mesh.get_local_rank("dp")
    env.tp_rank = env.mesh.get_local_rank("tp")
    return env


def teardown(env: DistEnv) -> None:
    """Collect, barrier, then destroy the group (in this order, or DDP processes sometimes abort at exit).

    A group this run did not create (the caller's) is left up, after the barrier."""
    gc.collect()
    if dist.is_initialized():
        if not env.owns_group:
            dist.barrier()
            return
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------- blocks
def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: elements of every ModuleList (or children of a Sequential root), the sharding and
    activation-checkpointing unit."""
    found = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    if not found and isinstance(model, torch.nn.Sequential):
        found = [c for c in model.children() if any(True for _ in c.parameters())]
    return found


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each block's activations in backward (non-reentrant ``torch.utils.checkpoint``); names unchanged.

    Returns the number of blocks wrapped."""
    from torch.utils.checkpoint import checkpoint

    n = 0
    for b in blocks(model):
        fwd = b.forward

        def run(*args: Any, _fwd: Any = fwd, **kwargs: Any) -> Any:
            return checkpoint(_fwd, *args, use_reentrant=False, **kwargs)

        b.forward = run
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------------- tensor
def apply_tensor_parallel(model: torch.nn.Module, env: DistEnv, plan: dict[str, str] | None) -> torch.nn.Module:
    """DTensor TP with ``parallelize_module``: ``plan`` maps module names (fnmatch globs) to colwise | rowwise
    (Megatron-LM pairing, arXiv:1909.08053). Default: the model's ``tp_plan`` attribute.

    Raises ConfigError when no plan is known or a pattern matches no Linear layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = plan or getattr(model, "tp_plan", None)
    if not plan:
        raise ConfigError("tensor parallel needs a plan: [parallel] tensor_plan or a `tp_plan` attribute on the model",
                          'e.g. tensor_plan = { "blocks.*.up" = "colwise", "blocks.*.down" = "rowwise" }')
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    resolved = {}
    for pattern, style in plan.items():
        if style not in styles:
            raise ConfigError(f"tensor_plan[{pattern!r}] = {style!r} is not colwise or rowwise", "fix the plan")
        names = [n for n, m in model.named_modules() if fnmatch.fnmatchcase(n, pattern)
                 and isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
        if not names:
            raise ConfigError(f"tensor_plan pattern {pattern!r} matches no Linear/Embedding layer",
                              "names are those of model.named_modules()")
        resolved.update({n: styles[style]() for n in names})
    return parallelize_module(model, env.submesh("tp"), resolved)


# ------------------------------------------------------------------------------------------------------------- data
def apply_fsdp(model: torch.nn.Module, env: DistEnv, policy: PrecisionPolicy) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` over the dp mesh: norm layers (fp32 units), then each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    mesh = env.submesh("dp")
    if policy.dtype is not None:
        for m in model.modules():
            if is_norm(m) and any(True for _ in m.parameters(recurse=False)):
                fully_shard(m, mesh=mesh, mp_policy=policy.fsdp_policy(norm=True))
    for b in blocks(model):
        fully_shard(b, mesh=mesh, mp_policy=policy.fsdp_policy())
    fully_shard(model, mesh=mesh, mp_policy=policy.fsdp_policy())
    return model


@dataclass
class CommStats:
    """Gradient bytes this rank handed to all-reduce (after compression), and before it, summed over steps."""

    bytes_sent: int = 0
    bytes_uncompressed: int = 0


def apply_ddp(model: torch.nn.Module, env: DistEnv, comm_hook: str | None = None, powersgd_rank: int = 1
              ) -> tuple[torch.nn.Module, CommStats]:
    """DDP over the dp group, with an optional gradient-compression comm hook: fp16 / bf16 (cast before all-reduce;
    bf16 needs NCCL) or PowerSGD (Vogels et al., arXiv:1905.13727). Returns the model and live byte counters."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = env.group("dp")
    if comm_hook == "bf16" and dist.get_backend(group) == "gloo":
        raise ConfigError("[parallel] comm_hook = 'bf16' needs the NCCL backend (GPU); gloo cannot reduce bf16",
                          "use comm_hook = 'fp16' or 'powersgd' on CPU")
    ddp = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None, process_group=group)
    stats = CommStats()
    # hooks are left unannotated: DDP rejects annotations it cannot match (they are strings here)
    if comm_hook is None:
        # the built-in C++ all-reduce (fastest); count bytes per backward with a post-accumulate hook on the root
        nbytes = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)

        def count(*_):
            stats.bytes_sent += nbytes
            stats.bytes_uncompressed += nbytes
        ddp.register_forward_pre_hook(lambda *_: count() if torch.is_grad_enabled() else None)
    elif comm_hook in ("fp16", "bf16"):
        inner = default_hooks.fp16_compress_hook if comm_hook == "fp16" else default_hooks.bf16_compress_hook

        def hook(state, bucket):
            stats.bytes_sent += bucket.buffer().numel() * 2
            stats.bytes_uncompressed += bucket.buffer().numel() * bucket.buffer().element_size()
            return inner(state, bucket)
        ddp.register_comm_hook(group, hook)
    else:
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)

        # PowerSGD issues its second all-reduce from a future callback; on gloo, with several buckets, ranks then
        # issue collectives in different orders (a size-mismatch abort, measured), so finish each bucket in turn
        serial = dist.get_backend(group) == "gloo"

        def hook(st, bucket):
            before = st.total_numel_after_compression
            fut = powerSGD_hook.powerSGD_hook(st, bucket)
            if serial:
                fut.wait()
            size = bucket.buffer().element_size()
            sent = st.total_numel_after_compression - before
            # before start_powerSGD_iter PowerSGD all-reduces the whole bucket uncompressed
            stats.bytes_sent += (sent or bucket.buffer().numel()) * size
            stats.bytes_uncompressed += bucket.buffer().numel() * size
            return fut
        ddp.register_comm_hook(state, hook)
    return ddp, stats


# --------------------------------------------------------------------------------------------------------- pipeline
def pipeline_stage_module(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """This rank's pipeline stage, parameter names unchanged: ``model.pipeline_stage(index, num_stages)`` when the
    model defines it, else a contiguous, evenly sized slice of an ``nn.Sequential``'s children.

    Raises ConfigError for other models or more stages than children."""
    if hasattr(model, "pipeline_stage"):
        return model.pipeline_stage(env.pp_rank, env.pp)
    if not isinstance(model, torch.nn.Sequential):
        raise ConfigError("pipeline parallel needs an nn.Sequential model or a `pipeline_stage(index, num_stages)` "
                          "method on the model", "set [parallel] pipeline = 1, or add pipeline_stage to the model")
    children = list(model.named_children())
    if len(children) < env.pp:
        raise ConfigError(f"pipeline = {env.pp} stages but the model has {len(children)} layers",
                          "lower [parallel] pipeline")
    bounds = [round(i * len(children) / env.pp) for i in range(env.pp + 1)]
    from collections import OrderedDict

    return torch.nn.Sequential(OrderedDict(children[bounds[env.pp_rank]:bounds[env.pp_rank + 1]]))


def build_pipeline_schedule(stage_module: torch.nn.Module, env: DistEnv, schedule: str, microbatches: int,
                            loss_fn: Any) -> Any:
    """A GPipe (Huang et al., arXiv:1811.06965) or 1F1B (PipeDream-Flush, arXiv:2006.09503) schedule for this stage.

    Gradients are averaged over micro-batches (``scale_grads``), matching a mean loss over the whole batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(stage_module, env.pp_rank, env.pp, env.device, group=env.group("pp"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
