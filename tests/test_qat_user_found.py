"""Found by a user trying QAT (`dsedge build --precision int4 --qat-steps N`) on a torch model of their own: failed
before its fix. Real torch, a tiny transformer layer."""
from __future__ import annotations

import copy

import torch

from dsedge.toolchain.qat import fake_quant_weight, qat_finetune, unwrap_linears, wrap_linears


class Encoder(torch.nn.Module):
    """A torch TransformerEncoderLayer: its attention reads ``out_proj.weight`` itself instead of calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean(1)


def test_qat_on_multihead_attention_quantizes_out_proj_instead_of_crashing():
    """`nn.MultiheadAttention` passes ``self.out_proj.weight`` to its functional form: the fake-quant wrapper had no
    ``weight``, so QAT of any model with torch attention ended in an AttributeError traceback."""
    torch.manual_seed(0)
    model = Encoder()
    x = torch.randn(4, 5, 32)
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for m in expected.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(fake_quant_weight(m.weight, 16))
            if isinstance(m, torch.nn.MultiheadAttention):  # the packed q/k/v weight too, as the export does
                m.in_proj_weight.copy_(fake_quant_weight(m.in_proj_weight, 16))
    wrap_linears(model, block_size=16)
    with torch.no_grad():
        got = model(x)
    unwrap_linears(model)
    torch.testing.assert_close(got, expected(x), rtol=1e-5, atol=1e-5)  # out_proj quantized too, like the export
    before = model.layer.self_attn.out_proj.weight.detach().clone()
    report = qat_finetune(model, [x], steps=3, lr=1e-3, block_size=16)
    assert "layer.self_attn.out_proj" in report["layers"]
    assert type(model.layer.self_attn.out_proj).__name__ == "NonDynamicallyQuantizableLinear"  # unwrapped
    assert not torch.equal(model.layer.self_attn.out_proj.weight, before)                    # and trained


def test_qat_fake_quantizes_attention_in_proj_weight_with_a_straight_through_gradient():
    """`nn.MultiheadAttention` keeps its q/k/v projection as a bare Parameter (``in_proj_weight`` [3E, E]), not an
    nn.Linear: QAT trained it in float while the INT4 export quantizes it (a MatMul weight, blocks along E), so the
    QAT model never saw the deployed model's error on a third of the attention weights."""
    torch.manual_seed(0)
    model = Encoder().train()
    x = torch.randn(4, 5, 32)
    expected = copy.deepcopy(model)
    w0 = model.layer.self_attn.in_proj_weight.detach().clone()
    with torch.no_grad():
        for m in expected.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(fake_quant_weight(m.weight, 16))
        expected.layer.self_attn.in_proj_weight.copy_(fake_quant_weight(w0, 16))
    layers = wrap_linears(model, block_size=16)
    assert "layer.self_attn.in_proj_weight" in layers
    got = model(x)                                                  # training mode, with autograd
    want = expected(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (got * torch.arange(32.0)).sum().backward()
    (want * torch.arange(32.0)).sum().backward()
    grad = model.layer.self_attn.parametrizations.in_proj_weight.original.grad
    # straight-through: d/dw of w + (fq(w) - w).detach() is 1, so the float weight gets the quantized one's gradient
    torch.testing.assert_close(grad, expected.layer.self_attn.in_proj_weight.grad, rtol=1e-5, atol=1e-6)
    unwrap_linears(model)
    assert type(model.layer.self_attn.in_proj_weight) is torch.nn.Parameter
    assert torch.equal(model.layer.self_attn.in_proj_weight, w0)   # the float weight back, not its fake-quant
    report = qat_finetune(model, [x], steps=3, lr=1e-3, block_size=16)
    assert "layer.self_attn.in_proj_weight" in report["layers"]
    assert not torch.equal(model.layer.self_attn.in_proj_weight, w0)  # trained
    assert type(model.layer.self_attn.in_proj_weight) is torch.nn.Parameter
