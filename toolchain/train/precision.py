"""Precision policy: matmuls in bf16/fp16 under autocast, normalization layers in fp32, fp16 with dynamic loss scaling.

CPU autocast does not upcast LayerNorm (measured, torch 2.13), so the policy wraps every normalization layer's
forward to run in fp32 with autocast off. Master weights and optimizer state stay fp32. With FSDP2 the same policy
becomes a ``MixedPrecisionPolicy`` (params gathered in bf16/fp16, gradients reduced in fp32; norm layers sharded as
their own fp32 units). fp16 uses ``torch.amp.GradScaler`` (Micikevicius et al., arXiv:1710.03740); bf16 does not.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_norm(module: torch.nn.Module) -> bool:
    """LayerNorm, RMSNorm, BatchNorm*, GroupNorm and custom ``*Norm`` classes (by class name)."""
    return "norm" in type(module).__name__.lower() and not isinstance(module, torch.nn.ModuleList)


def _fp32_forward(forward: Any, device_type: str) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            args = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
            return forward(*args, **kwargs)

    run.dsedge_fp32 = True  # type: ignore[attr-defined]
    return run


@dataclass
class PrecisionPolicy:
    """``mode`` fp32 | bf16 | fp16 on ``device_type`` cpu | cuda; GradScaler settings for fp16."""

    mode: str = "fp32"
    device_type: str = "cpu"
    initial_scale: float = 65536.0
    growth_interval: int = 2000

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.mode]

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's context: autocast to the policy dtype (a no-op for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make every normalization layer compute in fp32 (inputs cast up, autocast off). Keeps parameter names."""
        if self.dtype is None:
            return model
        for m in model.modules():
            if is_norm(m) and not getattr(m.forward, "dsedge_fp32", False):
                m.forward = _fp32_forward(m.forward, self.device_type)
        return model

    def grad_scaler(self) -> "torch.amp.GradScaler | None":
        """A dynamic loss scaler for fp16 (initial scale, growth interval from the config), else None."""
        if self.mode != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type, init_scale=self.initial_scale,
                                    growth_interval=self.growth_interval)

    def fsdp_policy(self, norm: bool = False) -> Any:
        """FSDP2 MixedPrecisionPolicy: params in the policy dtype (fp32 for norm units), reduce in fp32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.dtype is None or norm:
            return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
