"""Token statistics: length distribution, unknown-token rate and the Zipf coefficient.

Tokens are the model's (``--tokenizer DIR``: a Hugging Face tokenizer directory, read offline) or, without one,
lower-cased words (``\\w+``). Frequencies are counts per token id (a tokenizer's vocabulary) or per word hashed to one
of ``WORD_BUCKETS`` buckets (crc32), so the state is a fixed-size array whatever the corpus size; word collisions
merge a few tail types and leave the head of the rank-frequency curve, where the fit is made, unchanged.

Zipf coefficient (``zipf_fit``): frequencies sorted descending give f(r) at rank r = 1..R, where R is the last rank
with f ≥ 2 (hapax legomena tie at arbitrary ranks and are left out). The fit is ordinary least squares of log10 f on
log10 r at up to 50 ranks spaced evenly in log r (so each decade weighs the same, not the crowded tail); the
coefficient is s = −slope (f ∝ r^−s; natural language is near 1).
"""
from __future__ import annotations

import os
import re
from functools import lru_cache

import numpy as np

from ...runtime.errors import DsedgeError

WORD_RE = re.compile(r"\w+")
WORD_BUCKETS = 1 << 20
FIT_POINTS = 50


def words_of(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


class TokenizerError(DsedgeError):
    """The ``--tokenizer`` directory cannot be loaded."""


class ModelTokenizer:
    """A tokenizer directory: ``tokenizer.json`` through the ``tokenizers`` library (fast to import), else
    transformers' ``AutoTokenizer`` (a vocab.txt-only directory). ``encode`` gives ids without special tokens."""

    def __init__(self, path: str) -> None:
        import json
        from pathlib import Path

        d = Path(path)
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        mml = cfg.get("model_max_length")
        self.model_max_length = int(mml) if isinstance(mml, (int, float)) and mml < 1_000_000 else None
        if (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            try:
                self._tk = Tokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # the Rust side raises plain Exception for a malformed file
                raise TokenizerError(f"cannot load {d / 'tokenizer.json'}: {str(e).splitlines()[0]}",
                                     "pass a directory saved by save_pretrained()") from None
            self._tk.no_padding()          # a saved file may pad/truncate to a fixed length: count real tokens
            self._tk.no_truncation()
            unk = cfg.get("unk_token") or getattr(self._tk.model, "unk_token", None)
            if isinstance(unk, dict):
                unk = unk.get("content")
            self.unk_id = self._tk.token_to_id(unk) if unk else None
            pp = self._tk.post_processor
            self.specials = pp.num_special_tokens_to_add(False) if pp is not None else 0
            self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
            self._hf = None
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError:
            raise TokenizerError(f"{d} has no tokenizer.json and transformers is not installed",
                                 'pip install -e ".[toolchain]"') from None
        try:
            self._hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for a bad directory
            raise TokenizerError(f"cannot load a tokenizer from {d}: {str(e).splitlines()[0]}",
                                 "pass a directory with tokenizer.json or vocab.txt + tokenizer_config.json") from None
        self.unk_id = self._hf.unk_token_id
        self.specials = self._hf.num_special_tokens_to_add(pair=False)
        self.vocab_size = len(self._hf)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self._hf is not None:
            return self._hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=False)]


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> ModelTokenizer:
    """The tokenizer in a local directory (never downloads). Raises TokenizerError."""
    if not os.path.isdir(path):
        raise TokenizerError(f"{path} is not a directory", "pass a tokenizer directory (tokenizer.json)")
    return ModelTokenizer(path)


class TokenState:
    """Length counts, token and unknown-token totals, and frequency counts; merges by addition."""

    def __init__(self, vocab_size: int | None = None) -> None:
        self.unit = "tokens" if vocab_size else "words"
        self.lengths = np.zeros(64, dtype=np.int64)
        self.tokens = 0
        self.unknown = 0
        self.freq = np.zeros(vocab_size or WORD_BUCKETS, dtype=np.int64)

    def _add_lengths(self, lens: np.ndarray) -> None:
        if lens.size == 0:
            return
        top = int(lens.max()) + 1
        if top > self.lengths.size:
            self.lengths = np.pad(self.lengths, (0, top - self.lengths.size))
        self.lengths += np.bincount(lens, minlength=self.lengths.size)

    def update_words(self, doc_lens: np.ndarray, word_hashes: np.ndarray, counts: np.ndarray) -> None:
        """``doc_lens``: words per document; ``word_hashes``: crc32 of each distinct word of the batch, ``counts``
        its occurrences."""
        self._add_lengths(doc_lens)
        if counts.size:
            np.add.at(self.freq, word_hashes.astype(np.int64) & (WORD_BUCKETS - 1), counts.astype(np.int64))
        self.tokens += int(doc_lens.sum())

    def update_ids(self, ids: list[list[int]], unk_id: int | None, specials: int) -> None:
        """``ids``: token ids without special tokens; a document's length adds the ``specials`` the model adds."""
        self._add_lengths(np.fromiter((len(d) + specials for d in ids), dtype=np.int64, count=len(ids)))
        flat = np.fromiter((t for d in ids for t in d), dtype=np.int64)
        if flat.size:
            self.freq += np.bincount(flat, minlength=self.freq.size)[: self.freq.size]
            self.tokens += int(flat.size)
            if unk_id is not None:
                self.unknown += int((flat == unk_id).sum())

    def merge(self, other: "TokenState") -> None:
        n = max(self.lengths.size, other.lengths.size)
        self.lengths = np.pad(self.lengths, (0, n - self.lengths.size)) + np.pad(other.lengths,
                                                                                   (0, n - other.lengths.size))
        self.tokens += other.tokens
        self.unknown += other.unknown
        self.freq += other.freq

    def length_summary(self, max_tokens: int) -> dict:
        n = int(self.lengths.sum())
        if not n:
            return {"docs": 0}
        cum = np.cumsum(self.lengths)
        pct = {f"p{q}": int(np.searchsorted(cum, q / 100 * n)) for q in (50, 90, 99)}
        lens = np.arange(self.lengths.size)
        nz = np.nonzero(self.lengths)[0]
        return {"docs": n, "unit": self.unit, "mean": float((lens * self.lengths).sum() / n), **pct,
                "min": int(nz[0]), "max": int(nz[-1]), "max_tokens": max_tokens,
                "over_max": int(self.lengths[max_tokens + 1:].sum()), "empty": int(self.lengths[0])}

    def length_histogram(self, bins: int = 40) -> dict:
        nz = np.nonzero(self.lengths)[0]
        if not nz.size:
            return {"edges": [], "counts": []}
        hi = int(nz[-1]) + 1
        edges = np.unique(np.linspace(0, hi, min(bins, hi) + 1).round().astype(np.int64))
        cum = np.concatenate([[0], np.cumsum(self.lengths[:hi])])
        counts = cum[edges[1:]] - cum[edges[:-1]]
        return {"edges": edges.tolist(), "counts": counts.tolist(), "unit": self.unit}


def zipf_fit(freq: np.ndarray) -> dict:
    """Fit f(r) ∝ r^−s on the rank-frequency curve (see the module docstring). Returns s, the fit's R², the rank
    range, plot points (≤ 400 log-spaced ranks) and the fitted line's end points; ``s`` is None with fewer than 3 ranks."""
    f = np.sort(freq[freq > 0])[::-1].astype(np.float64)
    types = int(f.size)
    ranks_ge2 = int((f >= 2).sum())
    top = ranks_ge2 if ranks_ge2 >= 3 else types
    plot_r = np.unique(np.geomspace(1, max(types, 1), 400).round().astype(np.int64)) if types else np.array([], int)
    out = {"types": types, "fit_ranks": [1, top], "s": None, "r2": None,
           "points": {"rank": plot_r.tolist(), "freq": f[plot_r - 1].tolist() if types else []}}
    if top < 3:
        return out
    r = np.unique(np.geomspace(1, top, FIT_POINTS).round().astype(np.int64))
    x, y = np.log10(r.astype(np.float64)), np.log10(f[r - 1])
    slope, icpt = np.polyfit(x, y, 1)
    pred = slope * x + icpt
    ss_tot = float(((y - y.mean()) ** 2).sum())
    out.update(s=float(-slope), r2=float(1 - ((y - pred) ** 2).sum() / ss_tot) if ss_tot else 1.0,
               fit_line={"rank": [1, top], "freq": [float(10 ** icpt), float(10 ** (icpt + slope * np.log10(top)))]})
    return out
