"""Sliding-window K/V cache for exported rotary decoders (StreamingLLM, Xiao et al., arXiv:2309.17453).

A windowed stream keeps its first ``sink_tokens`` entries ("attention sinks") and its most recent entries, evicting
the middle, so that at most ``sink_tokens + window`` entries are held. Positions are assigned within the cache: the
entry in slot ``j`` is at position ``j`` and a new token at position ``len(cache)``, so positions never pass
``sink_tokens + window`` however long the generation runs.

Exported decoders (optimum's ``text-generation-with-past``) cache keys *after* the rotary embedding, rotated by the
position they had when computed. RoPE rotations compose — R(j) = R(j − p)·R(p) — so when eviction shifts kept keys
left by ``e`` slots, each is rotated by ``−e`` (in float64, cast back), which is what re-rotating the unrotated key at
its new slot gives. Values carry no position and are only moved. Decoders with absolute position embeddings (GPT-2,
OPT, …) or ALiBi cannot be re-positioned that way and are refused.

Rotary convention: "rotate half" (Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX): the first ``rotary_dim`` channels
of ``head_dim`` form pairs (i, i + rotary_dim/2) rotated by angle ``position · inv_freq[i]``,
``inv_freq[i] = theta ** (−2i / rotary_dim)``, with linear or Llama-3 frequency scaling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

# model types whose exported keys are rotated with the rotate-half convention
ROTATE_HALF = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                         "phi3", "gpt_neox", "phi", "stablelm", "olmo", "olmo2", "granite", "smollm3"})
_ABSOLUTE = frozenset({"gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt", "xglm", "codegen_abs"})
_ALIBI = frozenset({"bloom", "mpt"})


class WindowUnsupported(ValueError):
    """The decoder's positions cannot be re-assigned within a cache (the message says why)."""


@dataclass(frozen=True)
class RotarySpec:
    """How a decoder's cached keys were rotated.

    Attributes:
        head_dim: channels per head of the cached keys.
        rotary_dim: leading channels that are rotated (even, ≤ head_dim; partial rotary when smaller).
        inv_freq: float64 [rotary_dim / 2], radians per position of each channel pair.
    """

    head_dim: int
    rotary_dim: int
    inv_freq: np.ndarray

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, head_dim: int) -> "RotarySpec":
        """The rotary layout from a Hugging Face style config (``model_type``, ``rope_theta``, ``head_dim``,
        ``partial_rotary_factor`` or ``rotary_pct``, ``rope_scaling``).

        Raises:
            WindowUnsupported: no config, absolute or ALiBi positions, an unknown model type, interleaved or
                length-dependent (dynamic, YaRN, LongRoPE) rotary scaling.
        """
        if not config or "model_type" not in config:
            raise WindowUnsupported("the bundle does not say which positional encoding the decoder uses "
                                    "(no model_type in its source)")
        mt = str(config["model_type"])
        if mt in _ABSOLUTE:
            raise WindowUnsupported(f"{mt} uses absolute position embeddings; cached entries cannot be moved to "
                                    "new positions")
        if mt in _ALIBI:
            raise WindowUnsupported(f"{mt} uses ALiBi position biases, not rotary embeddings")
        if mt not in ROTATE_HALF:
            raise WindowUnsupported(f"model_type {mt!r} is not a known rotate-half RoPE decoder "
                                    f"(supported: {', '.join(sorted(ROTATE_HALF))})")
        hd = int(config.get("head_dim") or head_dim)
        if hd != head_dim:
            raise WindowUnsupported(f"config head_dim {hd} differs from the cached keys' {head_dim}")
        frac = float(config.get("partial_rotary_factor", config.get("rotary_pct", 1.0)))
        rdim = int(head_dim * frac)
        rdim -= rdim % 2
        theta = float(config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
        inv = 1.0 / theta ** (np.arange(0, rdim, 2, dtype=np.float64) / rdim)
        scaling = config.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
        elif kind != "default":
            raise WindowUnsupported(f"rope_scaling {kind!r} depends on sequence length; only default, linear and "
                                    "llama3 rotary scaling can be re-rotated")
        return cls(head_dim, rdim, inv)

    def rotate(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """Keys [..., head_dim] rotated by ``delta`` positions (negative: towards the start); same dtype."""
        if delta == 0 or self.rotary_dim == 0:
            return keys
        ang = float(delta) * self.inv_freq
        cos, sin = np.cos(ang), np.sin(ang)
        h = self.rotary_dim // 2
        x = keys.astype(np.float64)
        x1, x2 = x[..., :h], x[..., h:self.rotary_dim]
        out = x.copy()
        out[..., :h] = x1 * cos - x2 * sin
        out[..., h:self.rotary_dim] = x2 * cos + x1 * sin
        return out.astype(keys.dtype)


def _llama3(inv: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def cache_bound_bytes(sink_tokens: int, window: int, layers: int, kv_heads: int, head_dim: int,
                      itemsize: int) -> int:
    """Most bytes a windowed stream's cache holds: (sinks + window) · layers · 2 · kv_heads · head_dim · itemsize."""
    return (sink_tokens + window) * layers * 2 * kv_heads * head_dim * itemsize


def evict_row(kv: dict[str, np.ndarray], mask: np.ndarray, row: int, length: int, sink_tokens: int, keep: int,
              rope: RotarySpec) -> int:
    """Evict the middle of one left-padded row so it holds at most ``keep`` entries; returns how many went.

    ``kv`` maps ``past_key_values.{i}.key|value`` to [batch, kv_heads, L, head_dim] arrays (modified in place;
    they must be writable), ``mask`` is the [batch, L] int64 attention mask, ``length`` the row's real entries
    (its last ``length`` columns). The first ``sink_tokens`` entries stay; the most recent
    ``keep − sink_tokens`` stay in their columns with keys re-rotated; the sinks move right next to them.
    """
    e = length - keep
    if e <= 0:
        return 0
    L = mask.shape[1]
    start = L - length
    for name, v in kv.items():
        sinks = v[row, :, start:start + sink_tokens].copy()
        if name.endswith(".key"):
            v[row, :, start + sink_tokens + e:] = rope.rotate(v[row, :, start + sink_tokens + e:], -e)
        v[row, :, start + e:start + e + sink_tokens] = sinks
        v[row, :, :start + e] = 0
    mask[row, :start + e] = 0
    return e
