"""Continuous batching over a tiny GPT-2 built here (random weights) and exported by optimum with past key/values."""
from __future__ import annotations

import numpy as np
import pytest

import dsedge
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.toolchain.bundle_writer import write_bundle

pytestmark = pytest.mark.slow  # a GPT-2 export with optimum (~8 s on 2 idle cores) feeds these tests

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(float16)": "float16"}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(bundle path, torch model): GPT-2 with 2 layers, 2 heads, 32 dims, vocab 64; optimum ONNX export."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    main_export = pytest.importorskip("optimum.exporters.onnx").main_export
    import onnxruntime as ort

    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(root / "hf")
    main_export(str(root / "hf"), output=str(root / "onnx"), task="text-generation-with-past")
    sess = ort.InferenceSession(str(root / "onnx" / "model.onnx"))
    spec = lambda io: IOSpec(io.name, _ORT_DTYPES[io.type], tuple(io.shape))  # noqa: E731
    bundle = write_bundle(
        root / "tiny-gpt2-cpu.dse", name="tiny-gpt2", target={"name": "cpu"},
        inputs=[spec(i) for i in sess.get_inputs()], outputs=[spec(o) for o in sess.get_outputs()],
        models={"models/fp32.onnx": root / "onnx" / "model.onnx"},
        variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32")
    return bundle, model


def _reference(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PROMPTS = [[5, 9, 2], [11, 3, 7, 7, 30, 41, 2, 8, 19], [60], [4, 4, 4, 4, 4, 12], [33, 21, 17, 2, 9, 9, 1]]


def test_continuous_batching_matches_generation_alone(gpt2):
    bundle, model = gpt2
    lengths = [100] + [12 + i for i in range(1, len(PROMPTS))]
    with dsedge.load(bundle, threads=1, budget_ms=5000) as s:
        assert s.is_decoder
        first = s.generate_stream(PROMPTS[0], max_new_tokens=lengths[0], id=0)
        it = iter(first)
        head = [next(it), next(it)]  # the first sequence is decoding: the others join its running batch
        streams = [first] + [s.generate_stream(p, max_new_tokens=n, id=i)
                             for i, (p, n) in enumerate(zip(PROMPTS[1:], lengths[1:]), start=1)]
        tokens = [head + list(it)] + [list(st) for st in streams[1:]]
        stats = s._decoder.stats
    for i, (p, got) in enumerate(zip(PROMPTS, tokens)):
        assert got == _reference(model, p, lengths[i]), f"prompt {i}"
        assert streams[i].finish_reason == "length" and streams[i].tokens == got
        assert streams[i].ttft_ms is not None and len(streams[i].token_gaps_ms) == len(got) - 1
    assert stats.max_rows >= 2  # rows really decoded together
    assert stats.joins_while_running >= 1  # and a prompt joined between steps of a running batch


def test_tokens_stream_as_produced_and_eos_stops(gpt2):
    bundle, model = gpt2
    ref = _reference(model, PROMPTS[1], 10)
    with dsedge.load(bundle, threads=1, budget_ms=5000) as s:
        st = s.generate_stream(PROMPTS[1], max_new_tokens=10)
        seen_at = []
        for tok in st:
            seen_at.append((tok, len(st.tokens), st.done()))
        assert [t for t, _, _ in seen_at] == ref
        # each token was handed over as it was produced (consumption order under CPU load is not asserted)
        assert st.ttft_ms is not None and len(st.token_gaps_ms) == len(ref) - 1
        import asyncio

        async def collect():
            return [t async for t in s.generate_stream(PROMPTS[1], max_new_tokens=10)]
        assert asyncio.run(collect()) == ref
        eos = ref[3]
        st2 = s.generate_stream(PROMPTS[1], max_new_tokens=10, eos_token_id=eos)
        got = list(st2)
        assert got == ref[: ref.index(eos) + 1] and st2.finish_reason == "eos"


def test_budgets_reject_explicitly(gpt2):
    bundle, _ = gpt2
    with dsedge.load(bundle, threads=1) as s:
        st = s.generate_stream(PROMPTS[0], max_new_tokens=4, budget_ms=0.0001)
        assert list(st) == [] and st.rejected is not None and st.rejected.reason == "budget"
        assert st.finish_reason == "rejected" and not st.within_budget
        ok = s.generate_stream(PROMPTS[0], max_new_tokens=4, budget_ms=5000, token_budget_ms=5000)
        assert len(list(ok)) == 4 and ok.within_budget
        m = s.metrics()["decode"]
        assert m["prefills"] >= 1 and m["steps"] >= 3
        with pytest.raises(dsedge.InputError, match="decoder with past"):
            s.submit({"input_ids": np.ones((1, 2), np.int64)})
    with pytest.raises(dsedge.SessionClosedError):
        s.generate_stream(PROMPTS[0], 2)


def test_close_without_drain_ends_every_sequence(gpt2):
    bundle, _ = gpt2
    s = dsedge.load(bundle, threads=1, budget_ms=60_000)
    streams = [s.generate_stream(p, max_new_tokens=100) for p in PROMPTS * 4]
    s.close(drain=False)
    assert all(st.done() for st in streams)
    assert {st.finish_reason for st in streams} <= {"shutdown", "length"}
    assert any(st.finish_reason == "shutdown" for st in streams)
    shut = [st for st in streams if st.rejected is not None]
    assert all(st.rejected.reason == "shutdown" for st in shut)


def test_generate_stream_needs_a_decoder(tmp_path):
    from streaming_models import text_bundle

    with dsedge.load(text_bundle(tmp_path / "t"), threads=1) as s:
        assert not s.is_decoder
        with pytest.raises(dsedge.InputError, match="decoder"):
            s.generate_stream([1, 2, 3])


def test_per_token_budget_keeps_new_prompts_out_of_a_tight_batch(gpt2):
    bundle, model = gpt2
    with dsedge.load(bundle, threads=1, budget_ms=5000) as s:
        tight = s.generate_stream(PROMPTS[0], max_new_tokens=40, token_budget_ms=1e-6)
        it = iter(tight)
        head = [next(it), next(it)]
        later = s.generate_stream(PROMPTS[1], max_new_tokens=6)  # joining would slow the tight sequence's tokens
        rest = list(it)
        got = list(later)
        stats = s._decoder.stats
    assert head + rest == _reference(model, PROMPTS[0], 40) and got == _reference(model, PROMPTS[1], 6)
    assert stats.joins_while_running == 0 and stats.max_rows == 1  # it waited for the tight one to finish
    assert not tight.within_budget and later.within_budget
