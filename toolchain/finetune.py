"""Compensation fine-tune in torch: train a compressed student (pruned, 2:4-masked or fake-quantized) to match its
uncompressed teacher on calibration batches, and measure both against the teacher on held-out inputs.

The loss is knowledge distillation by feature matching (FitNets, arXiv:1412.6550; Hinton et al., arXiv:1503.02531):
``toolchain.train.losses.feature_distance`` (1 - cosine or MSE) between the student's and the teacher's outputs
(the sentence embedding for the reference model), plus an optional weighted term on a second output (token states).
The teacher's outputs are computed once; the student runs in eval mode (dropout off: the target is deterministic)
with gradients on. 2:4 masks are re-applied after every optimizer step so the pattern survives (masked fine-tune,
as in NVIDIA's ASP recipe).

torch is imported lazily (toolchain modules must import without it).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Forward = Callable[[Any, Any], Any]


def default_forward(model: Any, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple/list, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def output_forward(index: int, feature_index: int | None = None) -> Forward:
    """A forward returning output ``index`` of a multi-output model (and ``feature_index`` as a second tensor)."""
    def fwd(model: Any, batch: Any) -> Any:
        out = default_forward(model, batch)
        if not isinstance(out, (tuple, list)):
            return out
        return out[index] if feature_index is None else (out[index], out[feature_index])

    return fwd


def torch_batches(arrays: Mapping[str, np.ndarray], batch_size: int = 8) -> list[tuple]:
    """Numpy inputs ``{name: [N, ...]}`` (model input order) → tuples of torch tensors of ``batch_size`` rows."""
    import torch

    names = list(arrays)
    n = len(arrays[names[0]])
    return [tuple(torch.from_numpy(np.ascontiguousarray(arrays[k][i:i + batch_size])) for k in names)
            for i in range(0, n, batch_size)]


def token_replacement(names: Sequence[str], p: float = 0.15, seed: int = 0) -> Callable[[Any, int], Any]:
    """Augmentation for text batches (tuples in ``names`` order with ``input_ids`` and ``attention_mask``): each real
    token except the first and last of a row is replaced, with probability ``p``, by a token drawn from the batch's
    own real tokens — new inputs the teacher labels on the fly, so a few calibration sentences do not overfit
    (the data-augmentation idea of TinyBERT, arXiv:1909.10351, without its vocabulary model)."""
    import torch

    ids_i, mask_i = names.index("input_ids"), names.index("attention_mask")
    g = torch.Generator().manual_seed(seed)

    def augment(batch: tuple, step: int) -> tuple:
        ids, mask = batch[ids_i], batch[mask_i].bool()
        inner = mask.clone()
        inner[:, 0] = False
        last = mask.long().sum(1) - 1
        inner[torch.arange(len(ids)), last.clamp(min=0)] = False
        pool = ids[inner]
        if pool.numel() == 0:
            return batch
        pick = inner & (torch.rand(ids.shape, generator=g) < p)
        new = ids.clone()
        new[pick] = pool[torch.randint(len(pool), (int(pick.sum()),), generator=g)]
        return tuple(new if i == ids_i else t for i, t in enumerate(batch))

    return augment


def _distance(kind: str, feature_weight: float) -> Callable[[Any, Any], Any]:
    from .train.losses import feature_distance

    def loss(y: Any, t: Any) -> Any:
        if isinstance(y, tuple):
            val = feature_distance(y[0], t[0], kind)
            return val + feature_weight * feature_distance(y[1], t[1], kind) if feature_weight else val
        return feature_distance(y, t, kind)

    return loss


def distill_finetune(student: Any, teacher: Any, batches: Sequence[Any], *, forward: Forward | None = None,
                     steps: int = 500, lr: float = 1e-4, loss: str = "cosine", feature_weight: float = 0.0,
                     params: Sequence[Any] | None = None, masks: Mapping[Any, Any] | None = None, seed: int = 0,
                     augment: Callable[[Any, int], Any] | None = None,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fine-tune ``student`` in place so its outputs match ``teacher``'s on ``batches`` (cycled).

    Args:
        student, teacher: torch modules (fp32); the teacher is not changed.
        batches: each is passed to ``forward(model, batch)`` (default :func:`default_forward`), which returns a
            tensor ``[N, ...]`` or a pair (main output, feature) — e.g. (sentence embedding [N, H], token states
            [N, S, H]).
        steps, lr: AdamW steps and learning rate (no weight decay).
        loss: ``cosine`` (1 - cosine per sample) or ``mse``; ``feature_weight`` weights the second tensor's term.
        params: the tensors to train (default: every student parameter that requires grad).
        masks: ``{parameter: 0/1 tensor of its shape}`` re-applied after every step (2:4 sparsity).
        augment: ``augment(batch, step) -> batch`` (e.g. :func:`token_replacement`): training steps use the
            augmented batch, labelled by the teacher on the fly; the reported losses use the plain batches.
    Returns:
        ``{"steps", "lr", "loss", "loss_before", "loss_after", "time_s"}`` — losses averaged over all ``batches``.
    Raises:
        CalibrationError: ``batches`` is empty. ConfigError: ``steps`` < 0 or an unknown ``loss``.
        TrainingError: the loss or the gradients were non-finite for ``HealthConfig.max_nonfinite`` (3) steps in a
            row (such steps are skipped, as ``dsedge train`` skips them; there is no checkpoint to roll back to), or
            the loss before or after the fine-tune is non-finite: the student is not to be exported.
    """
    import torch

    from ..runtime.errors import CalibrationError, ConfigError, TrainingError
    from .train.config import HealthConfig

    if not batches:
        raise CalibrationError("the fine-tune needs training batches and got none", "pass calibration data")
    if steps < 0:
        raise ConfigError(f"fine-tune steps must be >= 0, got {steps}", "e.g. 500")
    if loss not in ("cosine", "mse"):
        raise ConfigError(f"unknown fine-tune loss {loss!r}", "use cosine or mse")
    fwd = forward or default_forward
    dist = _distance(loss, feature_weight)
    torch.manual_seed(seed)
    teacher.eval()
    with torch.no_grad():
        targets = [_detach(fwd(teacher, b)) for b in batches]
    student.eval()  # dropout off; gradients still flow

    def mean_loss() -> float:
        with torch.no_grad():
            return float(sum(float(dist(fwd(student, b), t)) for b, t in zip(batches, targets)) / len(batches))

    def refuse(what: str, value: float) -> None:
        if not math.isfinite(value):
            raise TrainingError(f"fine-tune loss {what} is {value} (non-finite): the student is not exported",
                                "check the model and its calibration inputs for NaN/Inf (e.g. a forward that "
                                "overflows)")

    loss_before = mean_loss()
    refuse("before the first step", loss_before)
    t0 = time.perf_counter()
    trained = list(params) if params is not None else [p for p in student.parameters() if p.requires_grad]
    max_nonfinite, nonfinite = HealthConfig().max_nonfinite, 0
    if steps and trained:
        opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
        for step in range(steps):
            i = step % len(batches)
            opt.zero_grad(set_to_none=True)
            if augment is None:
                batch, target = batches[i], targets[i]
            else:
                batch = augment(batches[i], step)
                with torch.no_grad():
                    target = _detach(fwd(teacher, batch))
            lval = dist(fwd(student, batch), target)
            lval.backward()
            # as `dsedge train`: a step whose loss or gradients are non-finite is skipped, several in a row stop
            grads = [p.grad for p in trained if p.grad is not None]
            gnorm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
                if grads else 0.0
            if not (math.isfinite(float(lval.detach())) and math.isfinite(gnorm)):
                nonfinite += 1
                if nonfinite >= max_nonfinite:
                    raise TrainingError(f"fine-tune loss or gradients non-finite for {nonfinite} steps in a row "
                                        f"(step {step + 1} of {steps}): the student is not exported",
                                        "check the model and its calibration inputs for NaN/Inf, or prune "
                                        "without a fine-tune (--finetune-steps 0)")
                continue
            nonfinite = 0
            opt.step()
            if masks:
                with torch.no_grad():
                    for p, m in masks.items():
                        p.mul_(m)
            if log and (step + 1) % max(1, steps // 5) == 0:
                log(f"fine-tune step {step + 1}/{steps}: loss {float(lval.detach()):.6f}")
    elapsed = time.perf_counter() - t0
    loss_after = mean_loss()
    refuse("after the fine-tune", loss_after)
    return {"steps": steps, "lr": lr, "loss": loss, "loss_before": loss_before, "loss_after": loss_after,
            "time_s": round(elapsed, 2)}


def _detach(y: Any) -> Any:
    return tuple(v.detach() for v in y) if isinstance(y, tuple) else y.detach()


def heldout_metrics(student: Any, teacher: Any, feeds: Mapping[str, np.ndarray], *, output: int = 0,
                    task: str = "generic", batch_size: int = 16) -> dict[str, Any]:
    """Student vs teacher in torch on held-out numpy inputs ``{name: [N, ...]}`` (model input order).

    ``task="sentence-embedding"``: cosine mean/min and top-1 neighbour agreement of output ``output`` [N, H]
    (``evaluate.sentence_embedding_metrics``); otherwise cosine mean/min per sample and argmax agreement when the
    output's last dim is > 1 — the same metrics the build report uses for its ONNX variants.
    """
    import torch

    from .evaluate import _cos_rows, sentence_embedding_metrics

    fwd = output_forward(output)
    batches = torch_batches(feeds, batch_size)
    with torch.no_grad():
        s = np.concatenate([fwd(student, b).numpy() for b in batches])
        t = np.concatenate([fwd(teacher, b).numpy() for b in batches])
    if task == "sentence-embedding":
        return sentence_embedding_metrics(t, s)
    cos = _cos_rows(t, s)
    out = {"cosine_mean": round(float(cos.mean()), 5), "cosine_min": round(float(cos.min()), 5), "n": int(len(t))}
    if t.ndim >= 2 and t.shape[-1] > 1:
        out["argmax_agreement"] = round(float(np.mean(t.argmax(-1) == s.argmax(-1))), 4)
    return out


__all__ = ["distill_finetune", "token_replacement", "heldout_metrics", "torch_batches", "output_forward",
           "default_forward"]
