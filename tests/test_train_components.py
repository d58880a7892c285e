"""Training components on real tensors: LAMB vs a reference, the hybrid split, schedule, samplers, losses, precision."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dsedge.toolchain.train.losses import DistillLoss, kd_kl, make_loss
from dsedge.toolchain.train.config import LossConfig
from dsedge.toolchain.train.optim import HybridOptimizer, Lamb, WarmupCosine
from dsedge.toolchain.train.precision import PrecisionPolicy
from dsedge.toolchain.train.sampler import ShardedBatchSampler, TokenBudgetBatchSampler, pad_collate


def lamb_reference(w, grads, lr, b1, b2, eps, wd):
    """arXiv:1904.00962 Algorithm 2, written out per step with plain float64 tensors."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        u = r + wd * w
        wn, un = w.norm(), u.norm()
        trust = wn / un if wn > 0 and un > 0 else 1.0
        w = w - lr * trust * u
    return w


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_matches_reference(wd):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g)
    grads = [torch.randn(7, 5, generator=g) * (i + 1) for i in range(5)]
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.01, betas=(0.9, 0.98), eps=1e-6, weight_decay=wd)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    ref = lamb_reference(w0, grads, 0.01, 0.9, 0.98, 1e-6, wd)
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)
    assert float(opt.state[p]["step"]) == 5.0


def test_lamb_trust_ratio_is_one_for_zero_weights():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    p.grad = torch.ones(3, 3)
    Lamb([p], lr=0.1, weight_decay=0.0).step()
    # first Adam step: m_hat/sqrt(v_hat) = 1 elementwise (eps aside), trust 1 -> w = -lr
    torch.testing.assert_close(p.detach(), torch.full((3, 3), -0.1), rtol=1e-5, atol=1e-5)


def test_hybrid_split_and_no_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))
    opt = HybridOptimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.98), eps=1e-6, lamb_threshold=32)
    lamb, adamw = opt.optimizers
    assert isinstance(lamb, Lamb) and isinstance(adamw, torch.optim.AdamW)
    assert opt.lamb_names == ["0.weight", "2.weight"]  # max(shape) 40 > 32; LayerNorm weight is 1-D
    lamb_ids = {id(p) for g in lamb.param_groups for p in g["params"]}
    assert lamb_ids == {id(model[0].weight), id(model[2].weight)}
    decay = {id(p) for o in opt.optimizers for g in o.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decay == lamb_ids  # biases and the LayerNorm get no decay
    assert opt.set_lr_factor(0.5) == pytest.approx(5e-4)
    assert all(g["lr"] == pytest.approx(5e-4) for o in opt.optimizers for g in o.param_groups)


def test_warmup_cosine():
    s = WarmupCosine(100, warmup_fraction=0.1, min_ratio=0.0)
    assert s(0) == pytest.approx(1 / 11) and s(9) == pytest.approx(10 / 11)
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.5)
    assert s(100) == pytest.approx(0.0, abs=1e-12)
    assert all(s(i) >= s(i + 1) for i in range(10, 100))
    assert WarmupCosine(10, 0.0, min_ratio=0.1)(10) == pytest.approx(0.1)


def test_sharded_sampler_ranks_together_equal_one_process_and_resume():
    single = list(ShardedBatchSampler(50, 8, seed=4))
    r0 = list(ShardedBatchSampler(50, 8, dp_rank=0, dp=2, seed=4))
    r1 = list(ShardedBatchSampler(50, 8, dp_rank=1, dp=2, seed=4))
    assert len(single) == 6 and all(len(b) == 4 for b in r0 + r1)
    assert [a + b for a, b in zip(r0, r1)] == single
    s = ShardedBatchSampler(50, 8, seed=4)
    s.set_position(0, 4)
    assert list(s) == single[4:]
    s.set_position(1, 0)
    assert list(s) != single  # a new epoch, a new order
    assert len(set(sum(single, []))) == 48


def test_token_budget_sampler_packs_under_budget():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 30, (200,), generator=g).tolist()
    samplers = [TokenBudgetBatchSampler(lengths, max_tokens=64, max_batch_size=8, dp_rank=r, dp=2, seed=1)
                for r in range(2)]
    batches = [list(s) for s in samplers]
    assert len(batches[0]) == len(batches[1]) > 0
    seen = [i for bs in batches for b in bs for i in b]
    assert len(seen) == len(set(seen))
    for b in batches[0] + batches[1]:
        assert len(b) <= 8 and len(b) * max(lengths[i] for i in b) <= 64
    # packing by length: padded tokens are far fewer than with random batches of the same sizes
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches[0])
    real = sum(lengths[i] for b in batches[0] for i in b)
    assert real / padded > 0.8
    mem = TokenBudgetBatchSampler(lengths, memory_limit_mb=1.0, bytes_per_token=2 ** 20 / 40)
    assert mem.max_tokens == 40


def test_pad_collate():
    items = [((torch.tensor([1, 2, 3]), torch.tensor(1.0)), torch.tensor(0)),
             ((torch.tensor([4]), torch.tensor(2.0)), torch.tensor(1))]
    (ids, scalar), y = pad_collate(items)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and scalar.tolist() == [1.0, 2.0] and y.tolist() == [0, 1]


def test_losses_from_config():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    ce = make_loss(LossConfig(kind="cross_entropy", class_weights=[1.0, 3.0]))
    assert float(ce(logits, y)) == pytest.approx(float(F.cross_entropy(logits, y, weight=torch.tensor([1.0, 3.0]))))
    bce = make_loss(LossConfig(kind="bce_with_logits", pos_weight=10.0))
    z, t = torch.tensor([[0.5], [-1.0]]), torch.tensor([1.0, 0.0])
    want = F.binary_cross_entropy_with_logits(z.squeeze(-1), t, pos_weight=torch.tensor([10.0]))
    assert float(bce(z, t)) == pytest.approx(float(want))


def test_kd_loss_values():
    s = torch.tensor([[1.0, 2.0, 0.5]])
    t = torch.tensor([[0.5, 3.0, -1.0]])
    T = 2.0
    p_t = F.softmax(t / T, -1)
    want = float((p_t * (p_t.log() - F.log_softmax(s / T, -1))).sum()) * T * T
    assert float(kd_kl(s, t, T)) == pytest.approx(want, rel=1e-5)
    assert float(kd_kl(t, t, T)) == pytest.approx(0.0, abs=1e-6)
    hard = make_loss(LossConfig())
    y = torch.tensor([1])
    assert float(DistillLoss(hard, T, alpha=0.0)(s, t, y)) == pytest.approx(float(hard(s, y)))
    mixed = DistillLoss(hard, T, alpha=0.25)(s, t, y)
    assert float(mixed) == pytest.approx(0.25 * want + 0.75 * float(hard(s, y)), rel=1e-5)
    # binary single-logit teacher/student
    assert float(kd_kl(torch.tensor([[0.3]]), torch.tensor([[0.3]]), 4.0)) == pytest.approx(0.0, abs=1e-7)


def test_bf16_policy_keeps_norms_fp32():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    names = [n for n, _ in model.named_parameters()]
    policy = PrecisionPolicy("bf16", "cpu")
    policy.apply(model)
    assert [n for n, _ in model.named_parameters()] == names
    x = torch.randn(3, 4)
    with policy.autocast():
        h = model[0](x)
        n = model[1](h)
        out = model[2](n)
    assert h.dtype == torch.bfloat16 and n.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert policy.grad_scaler() is None
    scaler = PrecisionPolicy("fp16", "cpu", initial_scale=128.0, growth_interval=5).grad_scaler()
    assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == 5


def test_token_budget_locate_walks_epochs():
    lengths = [3, 9, 4, 12, 7, 2, 5, 8, 6, 11] * 4
    s = TokenBudgetBatchSampler(lengths, max_tokens=24, seed=2)
    n0, n1 = s.batches_per_epoch(0), s.batches_per_epoch(1)
    assert s.locate(0) == (0, 0) and s.locate(n0 - 1) == (0, n0 - 1)
    assert s.locate(n0) == (1, 0) and s.locate(n0 + n1) == (2, 0)
    assert s.steps_for_epochs(2) == n0 + n1


def test_a_single_process_checkpoint_round_trips_without_warnings(tmp_path):
    """torch's DCP warns on every save and load without a process group, even when told ``no_dist=True``: a
    single-process ``dsedge train`` printed it at each checkpoint. The state still round-trips exactly."""
    import warnings

    from dsedge.toolchain.train.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ck = Checkpointer(tmp_path, log=lambda _m: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(1, model, [opt], {"note": "x"})
        fresh = torch.nn.Linear(4, 3)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        trainer = ck.load_latest(fresh, [fresh_opt])
    assert [str(w.message) for w in caught if "torch.distributed" in str(w.message)] == []
    assert trainer["step"] == 1 and trainer["note"] == "x"
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
