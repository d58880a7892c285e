"""Quantization-aware fine-tuning (QAT) in torch: fake-quantized INT4 blockwise weights, straight-through gradients.

Every ``nn.Linear`` (weight ``[out, in]``), and every ``nn.MultiheadAttention``'s bare projection Parameters
(``in_proj_weight`` ``[3E, E]``, or ``q/k/v_proj_weight``: MatMul weights of the export too), is wrapped so its forward
uses ``w + (fq(w) - w).detach()`` where
``fq`` is the same blockwise quantizer the ONNX export uses (blocks of ``block_size`` along the input dimension,
symmetric INT4 codes in [-8, 7] with ``scale = absmax / 7`` per block, or asymmetric UINT4 with a zero point) —
the straight-through estimator of Bengio et al. (arXiv:1308.3432) as used by QAT (Jacob et al., arXiv:1712.05877).
The student is trained to match the fp32 teacher's outputs (self-distillation: 1 - cosine, or MSE; the loop is
``toolchain.finetune.distill_finetune``) for ``steps`` steps; afterwards the wrappers are removed, leaving float
weights that sit on the INT4 grid's favourable side, and the model is exported and quantized with RTN *without*
clip search (``quantize_weight_only(algorithm="rtn", clip_search=False)``) — the same quantizer, so the ONNX codes
equal the fake-quant values.

torch is imported lazily (toolchain modules must import without it).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any


def fake_quant_weight(w: Any, block_size: int = 32, symmetric: bool = True, bits: int = 4) -> Any:
    """Fake-quantized copy of a torch weight ``[out, in]`` (blocks along ``in``); same dtype and shape."""
    import torch

    out_f, in_f = w.shape
    nb = -(-in_f // block_size)
    pad = nb * block_size - in_f
    wp = torch.nn.functional.pad(w, (0, pad)).reshape(out_f, nb, block_size)
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        s = (wp.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12)
        q = torch.clamp(torch.round(wp / s), -qmax - 1, qmax) * s
    else:
        qmax = (1 << bits) - 1
        lo = wp.amin(-1, keepdim=True).clamp(max=0)
        hi = wp.amax(-1, keepdim=True).clamp(min=0)
        s = ((hi - lo) / qmax).clamp(min=1e-12)
        z = torch.clamp(torch.round(-lo / s), 0, qmax)
        q = (torch.clamp(torch.round(wp / s) + z, 0, qmax) - z) * s
    return q.reshape(out_f, nb * block_size)[:, :in_f]


def _fq_linear_class():
    import torch

    class FakeQuantLinear(torch.nn.Module):
        """``nn.Linear`` whose weight is fake-quantized in forward (straight-through gradient).

        ``weight`` and ``bias`` read like the Linear's (the weight fake-quantized): parents that use their Linear's
        weight directly, as ``nn.MultiheadAttention`` does with ``out_proj.weight``, see the same quantized weight
        (they failed with an AttributeError)."""

        def __init__(self, linear: torch.nn.Linear, block_size: int, symmetric: bool) -> None:
            super().__init__()
            self.linear, self.block_size, self.symmetric = linear, block_size, symmetric

        @property
        def weight(self) -> torch.Tensor:
            w = self.linear.weight
            return w + (fake_quant_weight(w, self.block_size, self.symmetric) - w).detach()

        @property
        def bias(self) -> torch.Tensor | None:
            return self.linear.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.weight, self.linear.bias)

    return FakeQuantLinear


def _fq_parametrization(block_size: int, symmetric: bool) -> Any:
    """``w -> w + (fq(w) - w).detach()`` as a torch parametrization (for weights that are bare Parameters)."""
    import torch

    class FakeQuantWeight(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w + (fake_quant_weight(w, block_size, symmetric) - w).detach()

    return FakeQuantWeight()


# nn.MultiheadAttention's input projections: bare Parameters [out, in] that its functional form multiplies with
# (the export's MatMul weights), unlike out_proj, which is an nn.Linear
_ATTENTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def wrap_linears(model: Any, block_size: int = 32, symmetric: bool = True,
                 skip: Sequence[str] = ()) -> list[str]:
    """Fake-quantize, in place, every weight the INT4 export quantizes: replace every ``nn.Linear`` by a wrapper,
    and parametrize each ``nn.MultiheadAttention``'s ``in_proj_weight`` (or ``q/k/v_proj_weight``) ``[out, in]``
    with the same quantizer (blocks along ``in``). Returns their names (``layer.self_attn.in_proj_weight`` for the
    latter); names in ``skip`` are left in float."""
    import torch
    from torch.nn.utils import parametrize

    cls = _fq_linear_class()
    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.MultiheadAttention):
            for attr in _ATTENTION_WEIGHTS:
                full = f"{name}.{attr}" if name else attr
                if isinstance(getattr(mod, attr, None), torch.nn.Parameter) and full not in skip:
                    parametrize.register_parametrization(mod, attr, _fq_parametrization(block_size, symmetric))
                    names.append(full)
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and full not in skip:
                setattr(mod, child_name, cls(child, block_size, symmetric))
                names.append(full)
    return names


def unwrap_linears(model: Any) -> None:
    """Undo :func:`wrap_linears` (the trained float weights stay), in place."""
    from torch.nn.utils import parametrize

    for _, mod in list(model.named_modules()):
        for attr in _ATTENTION_WEIGHTS:
            if parametrize.is_parametrized(mod, attr):
                parametrize.remove_parametrizations(mod, attr, leave_parametrized=False)
        for child_name, child in list(mod.named_children()):
            if type(child).__name__ == "FakeQuantLinear":
                setattr(mod, child_name, child.linear)


def _fake_quant_params(model: Any) -> list:
    """The float weights :func:`wrap_linears` fake-quantizes (what QAT trains)."""
    from torch.nn.utils import parametrize

    params = []
    for mod in model.modules():
        if type(mod).__name__ == "FakeQuantLinear":
            params.append(mod.linear.weight)
        params += [mod.parametrizations[a].original for a in _ATTENTION_WEIGHTS if parametrize.is_parametrized(mod, a)]
    return params


def _cosine(student: Any, teacher: Any, batches: Sequence[Any], fwd: Callable[[Any, Any], Any]) -> float:
    import torch

    with torch.no_grad():
        cos = [torch.nn.functional.cosine_similarity(fwd(student, b).reshape(len(t), -1), t.reshape(len(t), -1), dim=1)
               for b, t in ((b, fwd(teacher, b)) for b in batches)]
    return float(torch.cat(cos).mean())


def qat_finetune(model: Any, batches: Sequence[Any], *, forward: Callable[[Any, Any], Any] | None = None,
                 steps: int = 500, lr: float = 1e-5, block_size: int = 32, symmetric: bool = True,
                 loss: str = "cosine", skip: Sequence[str] = (), seed: int = 0, masks: Any = None,
                 teacher: Any = None, log: Callable[[str], None] | None = None) -> dict:
    """Fake-quant INT4 fine-tune of ``model`` (in place) against its own fp32 copy as the teacher.

    Args:
        model: torch module in fp32; its ``nn.Linear`` weights and attention input projections are trained (biases
            and other parameters are not).
        batches: calibration batches, cycled; each is passed to ``forward(model, batch)`` (default: ``model(batch)``,
            ``model(*batch)`` for a tuple or ``model(**batch)`` for a dict), which returns the tensor to match
            (e.g. the sentence embedding).
        steps, lr: optimisation steps (default 500) and AdamW learning rate.
        loss: ``cosine`` (1 - cosine per sample) or ``mse`` (``train.losses.feature_distance``).
        masks: ``{weight: 0/1 mask}`` kept through the fine-tune (a 2:4-pruned model).
        teacher: the fp32 model to match (default: a copy of ``model`` before QAT); e.g. the unpruned original.
    Returns:
        report: ``{"steps", "loss_before", "loss_after", "cosine_before", "cosine_after", "layers", "time_s"}``
        where loss and cosine are those of the fake-quantized student vs the teacher on all ``batches``.
    Raises:
        CalibrationError when ``batches`` is empty; ConfigError for an unknown ``loss`` or negative ``steps``.
    """
    from .finetune import default_forward, distill_finetune

    if not batches:
        from ..runtime.errors import CalibrationError

        raise CalibrationError("QAT needs training batches and got none", "pass calibration batches")
    fwd = forward or default_forward
    teacher = (teacher if teacher is not None else copy.deepcopy(model)).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    layers = wrap_linears(model, block_size, symmetric, skip)
    try:
        cos_before = _cosine(model, teacher, batches, fwd)
        params = _fake_quant_params(model)
        rep = distill_finetune(model, teacher, batches, forward=fwd, steps=steps, lr=lr, loss=loss, params=params,
                               masks=masks, seed=seed,
                               log=(lambda s: log("QAT " + s)) if log else None)
        cos_after = _cosine(model, teacher, batches, fwd)
    finally:
        unwrap_linears(model)
    model.eval()
    return {**rep, "block_size": block_size, "symmetric": symmetric, "cosine_before": cos_before,
            "cosine_after": cos_after, "layers": layers}
