"""Teacher and student 3-D CNN lesion detectors (host side, torch).

A small 3-D U-Net (Çiçek et al., "3D U-Net", MICCAI 2016), cut to three scales, that maps a lung-windowed CT patch
to per-cell lesion logits: a 32³-voxel patch (64 mm at 2 mm spacing) gives 16³ cells of 2³ voxels (4 mm). The
acquisition metadata vector (``scans.meta_vector``: acquired spacing, slice thickness, kVp and missing-tag flags) is
fused with the image features by FiLM (Perez et al., AAAI 2018) at the bottleneck. Gradient (activation)
checkpointing recomputes the encoder blocks in the backward pass (``torch.utils.checkpoint``, non-reentrant).

Inputs:  ``patch`` float32 (B, 1, 32, 32, 32) in [0, 1] (lung window); ``meta`` float32 (B, META_DIM).
Output:  ``cell_logits`` float32 (B, 16·16·16, 2): two-class logits per cell (class 1 = lesion), classes on the last
         axis so softmax/KL over dim -1 is per cell.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

PATCH = 32          # voxels per side of an input patch
CELL = 2            # voxels per side of an output cell
META_DIM = 6        # see scans.meta_vector
INPUT_NAMES = ["patch", "meta"]
OUTPUT_NAMES = ["cell_logits"]


def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm3d(cout),
                         nn.ReLU(inplace=True))


class LesionDetector3D(nn.Module):
    """Three-scale 3-D U-Net with metadata FiLM; see the module docstring for shapes.

    Args:
        widths: channels at 16³, 8³ and 4³ (the teacher uses (16, 32, 64), the student (8, 16, 32)).
        checkpointing: recompute encoder activations in backward (saves memory during training; no effect in eval).
    """

    def __init__(self, widths: tuple[int, int, int] = (16, 32, 64), meta_dim: int = META_DIM,
                 checkpointing: bool = False) -> None:
        super().__init__()
        w0, w1, w2 = widths
        self.checkpointing = checkpointing
        self.stem = _conv(1, w0, stride=2)                              # 32³ → 16³
        self.enc1 = _conv(w0, w0)
        self.enc2 = nn.Sequential(_conv(w0, w1, stride=2), _conv(w1, w1))  # → 8³
        self.enc3 = nn.Sequential(_conv(w1, w2, stride=2), _conv(w2, w2))  # → 4³
        self.film = nn.Sequential(nn.Linear(meta_dim, 16), nn.ReLU(inplace=True), nn.Linear(16, 2 * w2))
        self.dec2 = _conv(w2 + w1, w1)                                   # at 8³
        self.dec1 = nn.Sequential(nn.Conv3d(w1 + w0, w0, 1, bias=False), nn.BatchNorm3d(w0), nn.ReLU(inplace=True))
        self.head = nn.Conv3d(w0, 2, 1)

    def _run(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, patch: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        s1 = self._run(self.enc1, self.stem(patch))
        s2 = self._run(self.enc2, s1)
        s3 = self._run(self.enc3, s2)
        gamma, beta = self.film(meta).chunk(2, dim=1)
        s3 = s3 * (1 + gamma[:, :, None, None, None]) + beta[:, :, None, None, None]
        d2 = self.dec2(torch.cat([F.interpolate(s3, scale_factor=2.0, mode="nearest"), s2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0, mode="nearest"), s1], dim=1))
        logits = self.head(d1)                                           # (B, 2, 16, 16, 16)
        return logits.flatten(2).transpose(1, 2)                         # (B, 4096, 2)


def make_teacher(widths: tuple[int, int, int] | list[int] = (16, 32, 64), checkpointing: bool = True
                 ) -> LesionDetector3D:
    """The teacher: widths (16, 32, 64), about 0.22 M parameters, ≈ 0.1 GMAC per 32³ patch."""
    return LesionDetector3D(tuple(widths), checkpointing=checkpointing)  # type: ignore[arg-type]


def make_student(widths: tuple[int, int, int] | list[int] = (8, 16, 32), checkpointing: bool = False
                 ) -> LesionDetector3D:
    """The student for ``dsedge distill``: half the teacher's widths, about 4× fewer MACs."""
    return LesionDetector3D(tuple(widths), checkpointing=checkpointing)  # type: ignore[arg-type]


def example_inputs(batch: int = 2) -> dict[str, torch.Tensor]:
    """Example inputs keyed by input name (batch axis 0 is the dynamic one)."""
    return {"patch": torch.zeros(batch, 1, PATCH, PATCH, PATCH), "meta": torch.zeros(batch, META_DIM)}


def cell_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float = 2.0, alpha: float = 0.75) -> torch.Tensor:
    """Focal loss over cells (Lin et al., "Focal Loss for Dense Object Detection", ICCV 2017).

    Args:
        logits: float (B, N, 2); target: int64 (B, N) with 1 = lesion cell, 0 = background, -1 = ignore.
        gamma: focusing exponent; alpha: weight of the lesion class (1 - alpha for background).
    Returns:
        scalar: summed focal loss over cells divided by (number of lesion cells + 1), averaged as in RetinaNet.
    """
    logits = logits.float().reshape(-1, 2)
    target = target.reshape(-1)
    valid = target >= 0
    logp = F.log_softmax(logits[valid], dim=-1)
    t = target[valid].long()
    logp_t = logp.gather(1, t[:, None])[:, 0]
    w = torch.where(t == 1, torch.full_like(logp_t, alpha), torch.full_like(logp_t, 1 - alpha))
    loss = -(w * (1 - logp_t.exp()).pow(gamma) * logp_t).sum()
    return loss / ((t == 1).sum() + 1).float()


def _seeded(factory, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def teacher_source() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``dsedge build --model samples.ct.model:teacher_source``: an untrained teacher with fixed (seed 0) weights,
    for trying the build and the device path only; trained runs are built with ``dsedge build --model RUN_DIR``."""
    return _seeded(lambda: make_teacher(checkpointing=False), 0).eval(), example_inputs()


def student_source() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``dsedge build --model samples.ct.model:student_source``: an untrained student, seed-0 weights (see
    ``teacher_source``)."""
    return _seeded(make_student, 0).eval(), example_inputs()
