"""The training LR schedule as torch.optim.lr_scheduler objects equals its closed form, step by step."""
from __future__ import annotations

import pytest
import torch

from dsedge.toolchain.train.optim import HybridOptimizer, WarmupCosine


@pytest.mark.parametrize("total, warmup, min_ratio", [(60, 0.1, 0.0), (10, 0.0, 0.1), (37, 0.2, 0.05)])
def test_torch_schedulers_follow_warmup_cosine(total, warmup, min_ratio):
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 4))
    opt = HybridOptimizer(model, 1e-3, 0.01, (0.9, 0.999), 1e-8, 32)
    schedule = WarmupCosine(total, warmup, min_ratio)
    schedulers = schedule.schedulers(opt)
    assert len(schedulers) == len(opt.optimizers) == 2
    for step in range(total):
        for o in opt.optimizers:
            for g in o.param_groups:
                assert g["lr"] == pytest.approx(1e-3 * schedule(step), rel=1e-9, abs=1e-15)
        opt.step()
        for s in schedulers:
            s.step()
