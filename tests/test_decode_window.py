"""Sliding-window (StreamingLLM) decode over a tiny Llama built here and exported by optimum with past key/values.

The reference is a plain PyTorch StreamingLLM of the same weights: unrotated keys are cached, the middle is evicted,
and every key is rotated at its slot in the cache at each step (Xiao et al., arXiv:2309.17453, "pos shift").
"""
from __future__ import annotations

import numpy as np
import pytest

import dsedge
from dsedge.runtime.bundle import IOSpec, Variant
from dsedge.runtime.kv_cache import RotarySpec, WindowUnsupported
from dsedge.toolchain.bundle_writer import write_bundle

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(float16)": "float16"}
MAX_POS = 64


def _bundle(root, hf_model, name, source):
    main_export = pytest.importorskip("optimum.exporters.onnx").main_export
    import onnxruntime as ort

    hf_model.save_pretrained(root / "hf")
    main_export(str(root / "hf"), output=str(root / "onnx"), task="text-generation-with-past")
    sess = ort.InferenceSession(str(root / "onnx" / "model.onnx"))
    spec = lambda io: IOSpec(io.name, _ORT_DTYPES[io.type], tuple(io.shape))  # noqa: E731
    return write_bundle(
        root / f"{name}-cpu.dse", name=name, target={"name": "cpu"},
        inputs=[spec(i) for i in sess.get_inputs()], outputs=[spec(o) for o in sess.get_outputs()],
        models={"models/fp32.onnx": root / "onnx" / "model.onnx"},
        variants=[Variant("fp32", "fp32", "models/fp32.onnx")], default_variant="fp32", source=source)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(bundle, torch model): Llama, 2 layers, 4 query / 2 K/V heads of 8 dims, vocab 64, 64 positions."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                                   rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    src = {k: v for k, v in cfg.to_dict().items() if k in ("model_type", "rope_theta", "max_position_embeddings",
                                                           "head_dim", "rope_scaling")}
    return _bundle(tmp_path_factory.mktemp("llama"), model, "tiny-llama", src), model


def streaming_reference(model, prompt, fed, window, sinks):
    """Logits [len(fed) + 1, vocab]: the prompt prefilled whole, then each token of ``fed`` decoded with a cache of
    at most ``sinks + window`` entries (first ``sinks`` + most recent), keys rotated at their cache slots."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    cfg, m = model.config, model.model
    hd = cfg.hidden_size // cfg.num_attention_heads
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    ks: list = [None] * cfg.num_hidden_layers
    vs: list = [None] * cfg.num_hidden_layers

    def forward(ids):
        t = ids.shape[1]
        past = 0 if ks[0] is None else ks[0].shape[2]
        h = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(h, torch.arange(past + t)[None])
        allowed = torch.arange(past + t)[None, :] <= torch.arange(past, past + t)[:, None]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(1, t, -1, hd).transpose(1, 2)
            k = a.k_proj(x).view(1, t, -1, hd).transpose(1, 2)
            v = a.v_proj(x).view(1, t, -1, hd).transpose(1, 2)
            ks[i] = k if ks[i] is None else torch.cat([ks[i], k], 2)
            vs[i] = v if vs[i] is None else torch.cat([vs[i], v], 2)
            qr, _ = apply_rotary_pos_emb(q, q, cos[:, past:], sin[:, past:])
            _, kr = apply_rotary_pos_emb(ks[i], ks[i], cos, sin)
            s = qr @ repeat_kv(kr, rep).transpose(2, 3) / hd ** 0.5
            p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
            o = (p @ repeat_kv(vs[i], rep)).transpose(1, 2).reshape(1, t, -1)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(m.norm(h))[0, -1]

    out = []
    with torch.no_grad():
        out.append(forward(torch.tensor([prompt])))
        for tok in fed:
            if ks[0].shape[2] + 1 > sinks + window:
                keep = window - 1
                for i in range(len(ks)):
                    ks[i] = torch.cat([ks[i][:, :, :sinks], ks[i][:, :, -keep:]], 2)
                    vs[i] = torch.cat([vs[i][:, :, :sinks], vs[i][:, :, -keep:]], 2)
            out.append(forward(torch.tensor([[tok]])))
    return torch.stack(out).numpy()


PROMPT = [5, 9, 2, 17, 33, 8, 41, 12]


def test_reference_without_eviction_is_the_model(llama):
    _, model = llama
    fed = [3, 14, 15, 9, 26]
    ref = streaming_reference(model, PROMPT, fed, window=1000, sinks=4)
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + fed])).logits[0, len(PROMPT) - 1:].numpy()
    np.testing.assert_allclose(ref, full, atol=1e-5)


def test_window_decodes_past_context_with_flat_cache(llama):
    bundle, model = llama
    window, sinks, n = 16, 4, 100  # 8 + 100 tokens: past the window and past the model's 64 positions
    with dsedge.load(bundle, providers=["CPUExecutionProvider"]) as s:
        assert s.generate_stream([1], 1, budget_ms=60_000).wait(60)
        dec = s._decoder
        # each alone, so the feeds are the same until the first eviction
        win = dec.submit(PROMPT, n, 60_000, 60_000, window=window, sink_tokens=sinks, output_scores=True)
        assert win.wait(60)
        windowed = list(dec.stats.cache_bytes)
        full = dec.submit(PROMPT, n, 60_000, 60_000, output_scores=True)
        assert full.wait(60)
        grown = dec.stats.cache_bytes[len(windowed):]
        assert win.finish_reason == "length" and len(win.tokens) == n and win.error is None
        # before any eviction (cache of at most sinks + window entries) the outputs are those of full attention
        clean = sinks + window - len(PROMPT) + 1
        assert win.tokens[:clean] == full.tokens[:clean]
        for a, b in zip(win.scores[:clean], full.scores[:clean]):
            assert np.array_equal(a, b)
        assert win.tokens[clean] != full.tokens[clean] or not np.array_equal(win.scores[clean], full.scores[clean])
        # after eviction: the PyTorch StreamingLLM reference of the same weights
        ref = streaming_reference(model, PROMPT, win.tokens[:-1], window, sinks)
        np.testing.assert_allclose(np.stack(win.scores), ref, atol=1e-4, rtol=0)
        assert win.tokens == [int(t) for t in ref.argmax(-1)]
        assert dec.stats.evicted >= n - clean
        bound = dec.cache_bound_bytes(window, sinks)
        assert bound == (sinks + window) * 2 * 2 * 2 * 8 * 4
        # K/V bytes held after each step, measured on the arrays: flat at the bound once the window is full
        assert len(windowed) == n - 1 and max(windowed) == bound and windowed[-(n - clean):] == [bound] * (n - clean)
        # the full cache grows until the model's 64 positions, where the row ends (an error, not extrapolation)
        assert full.finish_reason == "error" and len(full.tokens) == MAX_POS - len(PROMPT) + 1
        assert grown[-1] == bound * MAX_POS // (sinks + window) > 3 * bound


def test_per_request_windows_batch_together(llama):
    bundle, model = llama
    reqs = [(PROMPT, 12, 4), ([7, 7, 30], 20, 2), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 9, 0)]
    with dsedge.load(bundle, providers=["CPUExecutionProvider"]) as s:
        assert s.generate_stream([1], 1, budget_ms=60_000).wait(60)
        dec = s._decoder
        streams = [dec.submit(p, 60, 60_000, 60_000, window=w, sink_tokens=k, output_scores=True)
                   for p, w, k in reqs]
        streams.append(dec.submit(PROMPT, 40, 60_000, 60_000))
        assert all(x.wait(60) for x in streams)
        assert dec.stats.max_rows >= 3
    for (p, w, k), st in zip(reqs, streams):
        ref = streaming_reference(model, p, st.tokens[:-1], w, k)
        np.testing.assert_allclose(np.stack(st.scores), ref, atol=1e-4, rtol=0)


def test_window_refused_without_rotary_positions(llama, tmp_path):
    bundle, _ = llama
    with dsedge.load(bundle, providers=["CPUExecutionProvider"]) as s:
        with pytest.raises(dsedge.InputError, match="past the model's 64 positions"):
            s.generate_stream(PROMPT, 4, window=62, sink_tokens=4)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    gpt2 = _bundle(tmp_path, transformers.GPT2LMHeadModel(cfg).eval(), "tiny-gpt2", {"model_type": "gpt2"})
    with dsedge.load(gpt2, providers=["CPUExecutionProvider"]) as s:
        with pytest.raises(dsedge.InputError, match="absolute position embeddings"):
            s.generate_stream([1, 2, 3], 4, window=16)
        assert len(list(s.generate_stream([1, 2, 3], 4, budget_ms=60_000))) == 4  # the full cache still decodes
    with pytest.raises(WindowUnsupported, match="ALiBi"):
        RotarySpec.from_config({"model_type": "bloom"}, 8)
    with pytest.raises(WindowUnsupported, match="no model_type"):
        RotarySpec.from_config({}, 8)
    with pytest.raises(WindowUnsupported, match="dynamic"):
        RotarySpec.from_config({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 8)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_rerotation_equals_rotating_at_the_new_position(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=4096,
                                   rope_theta=500000.0, rope_scaling=scaling)
    rope = RotarySpec.from_config(cfg.to_dict(), 32)
    emb = LlamaRotaryEmbedding(cfg)
    np.testing.assert_allclose(rope.inv_freq, emb.inv_freq.double().numpy(), rtol=1e-6)
    k = torch.randn(1, 2, 5, 32)
    cos, sin = emb(k, torch.tensor([[900, 901, 902, 903, 904]]))
    _, at_p = apply_rotary_pos_emb(k, k, cos, sin)
    cos, sin = emb(k, torch.tensor([[4, 5, 6, 7, 8]]))
    _, at_j = apply_rotary_pos_emb(k, k, cos, sin)
    np.testing.assert_allclose(rope.rotate(at_p.numpy(), -896), at_j.numpy(), atol=1e-4)
