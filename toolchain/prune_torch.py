"""Pruning of torch models before export, so a compensation fine-tune (``toolchain.finetune``) can follow.

- **Channels** (``prune_ffn_channels``): hidden channels of FFN blocks — ``nn.Linear`` up → elementwise activation
  → ``nn.Linear`` down (BERT's ``intermediate.dense``/``output.dense``, ``fc1``/``fc2``, ``lin1``/``lin2``, or
  consecutive Linears in an ``nn.Sequential``) — are removed to a global sparsity target, lowest importance first
  across all blocks. Importance of hidden channel j: ``||W_up[j, :]|| * ||W_down[:, j]||`` times the RMS of the
  channel's activation at ``down``'s input on calibration data (the weight-times-activation criterion of Wanda,
  arXiv:2306.11695, applied to whole channels as in structured-pruning work such as LLM-Pruner, arXiv:2305.11627),
  normalised by each block's mean so blocks compare. The Linears are replaced by smaller ones: the exported model
  is really smaller. Each candidate block is checked on a calibration batch to be channel-wise (perturbing up's
  channels S changes only channels S at down's input); blocks that are not are left alone and listed.
- **2:4** (``mask_2_4``): in every group of 4 consecutive input features of each output row of every ``nn.Linear``,
  the 2 least important weights (``|w| * ||x_k||``, Wanda) are zeroed — the pattern Ampere+ sparse tensor cores run;
  the masks are returned so the fine-tune keeps them. Same rule as the ONNX-side ``toolchain.prune.nm_mask``.

torch is imported lazily (toolchain modules must import without it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.errors import QuantizationError
from .prune import nm_mask

# Sibling-module names of FFN pairs in common model families (relative to one parent module).
NAMED_PAIRS = (("intermediate.dense", "output.dense"), ("fc1", "fc2"), ("lin1", "lin2"), ("w1", "w2"))


@dataclass
class FFNPair:
    """``up`` (nn.Linear ``[hidden, in]``) → channel-wise ops → ``down`` (nn.Linear ``[out, hidden]``), by name."""

    up: str
    down: str
    hidden: int


def _elementwise_module(m: Any) -> bool:
    import torch.nn as nn

    kinds = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.Hardswish,
             nn.Mish, nn.ELU, nn.Softplus, nn.ReLU6, nn.Hardtanh)
    return isinstance(m, kinds)


def candidate_pairs(model: Any) -> list[FFNPair]:
    """FFN pairs found by structure: consecutive Linears in an ``nn.Sequential`` with only elementwise modules
    between them, and the ``NAMED_PAIRS`` sibling names; ``up.out_features == down.in_features`` always."""
    import torch.nn as nn

    pairs: dict[tuple[str, str], FFNPair] = {}
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(mod, nn.Sequential):
            kids = list(mod.named_children())
            for i, (a, up) in enumerate(kids):
                if not isinstance(up, nn.Linear):
                    continue
                for b, down in kids[i + 1:]:
                    if isinstance(down, nn.Linear):
                        if down.in_features == up.out_features:
                            pairs[(prefix + a, prefix + b)] = FFNPair(prefix + a, prefix + b, up.out_features)
                        break
                    if not _elementwise_module(down):
                        break
        for a, b in NAMED_PAIRS:
            try:
                up, down = mod.get_submodule(a), mod.get_submodule(b)
            except AttributeError:
                continue
            if isinstance(up, nn.Linear) and isinstance(down, nn.Linear) and up.out_features == down.in_features:
                pairs[(prefix + a, prefix + b)] = FFNPair(prefix + a, prefix + b, up.out_features)
    return list(pairs.values())


def _run(model: Any, batch: Any, forward: Callable[[Any, Any], Any]) -> None:
    import torch

    with torch.no_grad():
        forward(model, batch)


def is_channelwise(model: Any, pair: FFNPair, batch: Any, forward: Callable[[Any, Any], Any]) -> bool:
    """True when perturbing ``up``'s output channels S changes ``down``'s input in channels S only (one batch)."""
    import torch

    up, down = model.get_submodule(pair.up), model.get_submodule(pair.down)
    seen: list[torch.Tensor] = []
    rec = down.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        _run(model, batch, forward)
        chosen = torch.zeros(pair.hidden, dtype=torch.bool)
        chosen[::2] = True

        def perturb(m: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            return out + chosen.to(out.dtype) * (out.abs().mean() + 1.0)

        hook = up.register_forward_hook(perturb)
        try:
            _run(model, batch, forward)
        finally:
            hook.remove()
    finally:
        rec.remove()
    if len(seen) != 2 or seen[0].shape != seen[1].shape or seen[0].shape[-1] != pair.hidden:
        return False                                  # down not called exactly once per forward, or reshaped
    delta = (seen[1] - seen[0]).abs().reshape(-1, pair.hidden).amax(0)
    return bool(delta[~chosen].max() <= 1e-6 and delta[chosen].max() > 1e-6)


def _input_sq_sums(model: Any, names: Sequence[str], batches: Sequence[Any],
                   forward: Callable[[Any, Any], Any]) -> dict[str, np.ndarray]:
    """Per input feature: sum of squares over every row fed to each named Linear, and the row count (float64)."""
    sums: dict[str, list] = {n: [0.0, 0] for n in names}
    hooks = []
    for n in names:
        def hook(m: Any, args: Any, n: str = n) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[n][0] = sums[n][0] + (x * x).sum(0).numpy()
            sums[n][1] += x.shape[0]
        hooks.append(model.get_submodule(n).register_forward_pre_hook(hook))
    try:
        for b in batches:
            _run(model, b, forward)
    finally:
        for h in hooks:
            h.remove()
    return {n: (np.asarray(s, np.float64), c) for n, (s, c) in sums.items()}


def _set_module(model: Any, name: str, module: Any) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def prune_ffn_channels(model: Any, sparsity: float, batches: Sequence[Any], *,
                       forward: Callable[[Any, Any], Any] | None = None, pairs: Sequence[FFNPair] | None = None,
                       min_keep: int = 8, multiple_of: int = 8) -> dict[str, Any]:
    """Remove a global fraction ``sparsity`` of the FFN hidden channels of ``model``, in place.

    Args:
        model: torch module (fp32).
        sparsity: fraction in [0, 1) of all FFN hidden channels to remove (e.g. 0.3).
        batches: calibration batches for the activation RMS and the channel-wise check (``forward(model, b)``).
        pairs: FFN pairs to prune (default :func:`candidate_pairs`, each checked by :func:`is_channelwise`).
        min_keep, multiple_of: each block keeps at least ``min_keep`` channels, rounded up to a multiple of
            ``multiple_of`` (tensor-core friendly widths).
    Returns:
        ``{"pattern": "channels", "target_sparsity", "sparsity" (achieved), "blocks": [{"up", "down",
        "hidden_before", "hidden_after"}], "rejected": [names of blocks that failed the check], "params_before",
        "params_after"}``.
    Raises:
        QuantizationError: ``sparsity`` outside [0, 1), no calibration batches, or no prunable FFN block.
    """
    import torch

    from .finetune import default_forward

    if not 0.0 <= sparsity < 1.0:
        raise QuantizationError(f"channel sparsity {sparsity} is outside [0, 1)", "e.g. --prune channels:0.3")
    if not batches:
        raise QuantizationError("channel pruning needs calibration batches and got none", "pass calibration data")
    fwd = forward or default_forward
    model.eval()
    params_before = sum(p.numel() for p in model.parameters())
    found = list(pairs) if pairs is not None else candidate_pairs(model)
    ok = [p for p in found if is_channelwise(model, p, batches[0], fwd)]
    rejected = [f"{p.up} -> {p.down}" for p in found if p not in ok]
    if not ok:
        raise QuantizationError("no prunable FFN block (Linear → activation → Linear) found"
                                + (f"; not channel-wise: {', '.join(rejected)}" if rejected else ""),
                                "channel pruning needs Linear → elementwise activation → Linear blocks")
    stats = _input_sq_sums(model, [p.down for p in ok], batches, fwd)
    scores = []
    for p in ok:
        w1 = model.get_submodule(p.up).weight.detach().double()
        w2 = model.get_submodule(p.down).weight.detach().double()
        sq, rows = stats[p.down]
        s = (w1.norm(dim=1) * w2.norm(dim=0)).numpy() * np.sqrt(sq / max(rows, 1))
        scores.append(s / (s.mean() + 1e-12))
    flat = np.concatenate(scores)
    n_prune = int(round(sparsity * flat.size))
    threshold = np.sort(flat)[n_prune - 1] if n_prune else -np.inf
    blocks = []
    for p, s in zip(ok, scores):
        keep_n = max(min_keep, int(np.count_nonzero(s > threshold)))
        keep_n = min(p.hidden, -(-keep_n // multiple_of) * multiple_of)
        keep = torch.from_numpy(np.sort(np.argsort(-s, kind="stable")[:keep_n]))
        up, down = model.get_submodule(p.up), model.get_submodule(p.down)
        new_up = torch.nn.Linear(up.in_features, keep_n, bias=up.bias is not None,
                                 device=up.weight.device, dtype=up.weight.dtype)
        new_down = torch.nn.Linear(keep_n, down.out_features, bias=down.bias is not None,
                                   device=down.weight.device, dtype=down.weight.dtype)
        with torch.no_grad():
            new_up.weight.copy_(up.weight[keep])
            if up.bias is not None:
                new_up.bias.copy_(up.bias[keep])
            new_down.weight.copy_(down.weight[:, keep])
            if down.bias is not None:
                new_down.bias.copy_(down.bias)
        _set_module(model, p.up, new_up)
        _set_module(model, p.down, new_down)
        blocks.append({"up": p.up, "down": p.down, "hidden_before": p.hidden, "hidden_after": int(keep_n)})
    before = sum(b["hidden_before"] for b in blocks)
    after = sum(b["hidden_after"] for b in blocks)
    return {"pattern": "channels", "target_sparsity": sparsity, "sparsity": round(1 - after / before, 4),
            "blocks": blocks, "rejected": rejected, "params_before": int(params_before),
            "params_after": int(sum(p.numel() for p in model.parameters()))}


def mask_2_4(model: Any, batches: Sequence[Any] | None = None, *, forward: Callable[[Any, Any], Any] | None = None,
             skip: Sequence[str] = ()) -> tuple[dict[Any, Any], dict[str, Any]]:
    """Zero 2 of every 4 consecutive input-feature weights per output row of every ``nn.Linear``, in place.

    Importance ``|w| * ||x_k||`` over ``batches`` (Wanda, arXiv:2306.11695), or ``|w|`` without batches. Linears
    whose ``in_features`` is not a multiple of 4, or named in ``skip``, are left dense and listed.
    Returns:
        (``{weight parameter: float 0/1 mask of its shape}``, report ``{"pattern": "2:4", "layers": [{"name",
        "sparsity"}], "skipped", "importance"}``).
    """
    import torch

    from .finetune import default_forward

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    todo = [n for n in names if n not in skip and model.get_submodule(n).in_features % 4 == 0]
    skipped = [n for n in names if n not in todo]
    stats = _input_sq_sums(model, todo, batches, forward or default_forward) if batches else {}
    masks, layers = {}, []
    for n in todo:
        lin = model.get_submodule(n)
        w = lin.weight.detach().double().numpy().T                          # [K, N] like the ONNX side
        imp = np.sqrt(stats[n][0]) if n in stats else None
        keep = torch.from_numpy(np.ascontiguousarray(nm_mask(w, 2, 4, imp).T)).to(lin.weight.dtype)
        with torch.no_grad():
            lin.weight.mul_(keep)
        masks[lin.weight] = keep
        layers.append({"name": n, "sparsity": round(float(1 - keep.mean()), 4)})
    return masks, {"pattern": "2:4", "layers": layers, "skipped": skipped,
                   "importance": "wanda" if stats else "magnitude"}


__all__ = ["FFNPair", "candidate_pairs", "is_channelwise", "prune_ffn_channels", "mask_2_4", "NAMED_PAIRS"]
