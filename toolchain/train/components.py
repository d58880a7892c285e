"""The run's parts built from the config: factory calls, train/val data, the domain mixture, the batch sampler; and the
two batch helpers the loop and the evaluation share (``to_device``, ``as_inputs``)."""
from __future__ import annotations

from typing import Any

import torch

from ...runtime.errors import ConfigError, DsedgeError
from . import parallel as par
from .config import DomainsConfig, TrainConfig, resolve_callable
from .domains import DomainBatchSampler, DomainWeights, MultiDomain
from .sampler import ShardedBatchSampler, TokenBudgetBatchSampler, token_budget


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
    except DsedgeError:
        raise  # one-line already (e.g. the data factory's SeriesError / CSV errors)
    except (TypeError, ValueError) as e:  # a bad kwarg name, or a value the factory refuses (dropout = 1.5)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{cfg.source}: [{section}] factory {spec!r} failed: {first}",
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
    if not token_budget(d):
        return ShardedBatchSampler(len(dataset), d.batch_size, env.dp_rank, env.dp, cfg.seed, d.shuffle)
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        lengths = [as_inputs(dataset[i][0])[0].shape[0] for i in range(len(dataset))]
    return TokenBudgetBatchSampler(lengths, d.max_tokens, d.max_batch_size, d.memory_limit_mb, d.bytes_per_token,
                                   env.dp_rank, env.dp, cfg.seed, d.shuffle)


def describe_inputs(x: tuple) -> str:
    """``[4, 29] float32, [4] int64``: the shapes and dtypes of a batch's input tensors, for error messages."""
    return ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in x if isinstance(t, torch.Tensor))


def first_forward(model: torch.nn.Module, x: tuple, cfg: Any) -> Any:
    """The model on its first batch: a model whose forward() does not take the data's inputs (their number, shapes
    or dtypes) is a one-line ConfigError, as a distillation teacher's is, not a traceback per rank (a user's pass,
    2026-12-06: ``forward(dense)`` fed (dense, ids) ended in ``TypeError … takes 2 positional arguments``)."""
    try:
        return model(*x)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise ConfigError(f"{cfg.source}: the model ({cfg.model.factory}) cannot run on this data's inputs "
                          f"({describe_inputs(x)}):"
                          f" {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                          "make forward() take the [data] factory's inputs, in order (items are (inputs, target))"
                          ) from None
