"""QAT: fake-quant INT4 fine-tune in real torch, then export to the same Q/DQ form (real ORT)."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch

from dsedge.runtime.errors import CalibrationError
from dsedge.toolchain.qat import fake_quant_weight, qat_finetune, unwrap_linears, wrap_linears
from dsedge.toolchain.quantize.blockwise import quantize_blockwise
from dsedge.toolchain.quantize.weight_only import quantize_weight_only

from quantize_models import cosine, run


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).eval()


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    scale = torch.ones(64)
    scale[[3, 30]] = 8.0
    return [torch.randn(16, 64, generator=g) * scale for _ in range(n)]


def test_fake_quant_equals_the_onnx_rtn_quantizer():
    w = torch.randn(24, 70)
    fq = fake_quant_weight(w, block_size=32).numpy()
    bw = quantize_blockwise(w.numpy().T, block_size=32, clip_search=False)     # ONNX layout [K, N]
    np.testing.assert_allclose(fq, bw.dequantize().T, rtol=1e-6, atol=1e-6)
    fqa = fake_quant_weight(w, block_size=32, symmetric=False).numpy()
    bwa = quantize_blockwise(w.numpy().T, block_size=32, symmetric=False, clip_search=False)
    np.testing.assert_allclose(fqa, bwa.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_qat_improves_the_int4_student_and_exports_to_the_same_codes():
    model, batches = _mlp(), _batches()
    reference = [model(b).detach().numpy() for b in batches]
    report = qat_finetune(model, batches, steps=80, lr=2e-3, block_size=16)
    assert report["layers"] == ["0", "2"] and report["steps"] == 80
    assert report["loss_after"] < 0.9 * report["loss_before"]
    assert report["cosine_after"] > report["cosine_before"]
    assert all(isinstance(m, torch.nn.Linear) for m in (model[0], model[2]))      # wrappers removed

    buf = io.BytesIO()
    torch.onnx.export(model, (batches[0],), buf, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}}, opset_version=17, dynamo=False)
    fp32 = onnx.load_from_string(buf.getvalue())
    q, _ = quantize_weight_only(fp32, None, algorithm="rtn", block_size=16, clip_search=False)
    wrap_linears(model, block_size=16)                                           # the student as trained
    with torch.no_grad():
        student = model(batches[1]).numpy()
    unwrap_linears(model)
    got = run(q, {"x": batches[1].numpy()}, exact_int4=True)
    np.testing.assert_allclose(got, student, rtol=1e-3, atol=1e-3)
    assert cosine(got, reference[1]) >= report["cosine_after"] - 0.01


def test_qat_without_batches_fails_clearly():
    with pytest.raises(CalibrationError, match="got none"):
        qat_finetune(_mlp(), [], steps=1)
