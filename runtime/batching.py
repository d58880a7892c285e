"""Stack requests into one batch and split the outputs back: the batch axis, the sequence axis and padding.

A model batches dynamically when every input and output has the same symbolic first dim (``"batch"``); otherwise
each request runs alone. Requests of different sequence lengths share a batch only when the model takes an
attention mask over that sequence axis: the shorter ones are right-padded with zeros (mask 0, token 0, the
BERT/HF convention), and outputs that carry the sequence axis are cut back to each request's own length.
Without a mask, only requests of identical shapes are batched together. Nor is a request padded that has a row
whose mask is all zero (no real token): attention then spreads over every masked key, padding included, so its
answer would depend on the longest batch-mate (a MiniLM ``last_hidden_state`` moved by 3.0); it batches only with
requests of its own length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from .bundle import IOSpec


@dataclass(frozen=True)
class BatchLayout:
    """How a model's IO lines up for batching.

    Attributes:
        batch_symbol: the symbolic first dim shared by all IO (``"batch"``), or None (no dynamic batch axis).
        seq_symbol: the symbolic dim at axis 1 of the inputs that varies per request (``"sequence"``), or None.
        can_pad: True when an input named ``*mask*`` carries ``seq_symbol`` (padding is then harmless).
    """

    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    batch_symbol: str | None
    seq_symbol: str | None
    can_pad: bool
    # group_key per (padded, input shapes): it runs on every submit, and a model sees a handful of shapes
    _keys: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> "BatchLayout":
        firsts = {s.shape[0] if s.shape else None for s in [*inputs, *outputs]}
        batch = next(iter(firsts)) if len(firsts) == 1 and isinstance(next(iter(firsts)), str) else None
        seq = None
        seconds = [s.shape[1] for s in inputs if len(s.shape) > 1 and isinstance(s.shape[1], str)]
        if seconds and len(set(seconds)) == 1 and seconds[0] != batch:
            seq = seconds[0]
        can_pad = seq is not None and any("mask" in s.name.lower() and len(s.shape) > 1 and s.shape[1] == seq
                                          for s in inputs)
        return cls(tuple(inputs), tuple(outputs), batch, seq, can_pad)

    @property
    def dynamic(self) -> bool:
        return self.batch_symbol is not None

    def rows(self, feed: dict[str, np.ndarray]) -> int:
        """Rows a request holds along the batch axis (1 for models without one)."""
        return int(feed[self.inputs[0].name].shape[0]) if self.dynamic else 1

    def seq_len(self, feed: dict[str, np.ndarray]) -> int | None:
        """The request's sequence length (tokens), or None for models without a sequence axis."""
        if self.seq_symbol is None:
            return None
        for s in self.inputs:
            if len(s.shape) > 1 and s.shape[1] == self.seq_symbol:
                return int(feed[s.name].shape[1])
        return None

    def group_key(self, feed: dict[str, np.ndarray]) -> tuple:
        """Requests with equal keys can share a batch: shapes without the batch axis (and the padded axis)."""
        pad = self.can_pad and self.dynamic and not self._empty_mask_row(feed)
        shapes = tuple(feed[s.name].shape for s in self.inputs)
        got = self._keys.get((pad, shapes))
        if got is not None:
            return got
        key = []
        for s, full in zip(self.inputs, shapes):
            shape = list(full[1:] if self.dynamic else full)
            if pad and len(s.shape) > 1 and s.shape[1] == self.seq_symbol:
                shape[0] = -1
            key.append((s.name, tuple(shape)))
        if len(self._keys) >= 256:  # bounded: every length of a text model is a shape
            self._keys.clear()
        self._keys[(pad, shapes)] = key = tuple(key)
        return key

    @cached_property
    def _mask_names(self) -> tuple[str, ...]:
        # the ``*mask*`` inputs over the sequence axis
        return tuple(s.name for s in self.inputs
                     if "mask" in s.name.lower() and len(s.shape) > 1 and s.shape[1] == self.seq_symbol)

    def _empty_mask_row(self, feed: dict[str, np.ndarray]) -> bool:
        """True when a row of a ``*mask*`` input over the sequence axis is all zero (see the module doc)."""
        for name in self._mask_names:
            m = feed[name]
            if m.ndim == 2 and m.shape[1]:
                if m.shape[0] == 1:  # one row (the common request): a count, cheaper than a reduction cold
                    if not np.count_nonzero(m):
                        return True
                elif not m.any(axis=1).all():
                    return True
        return False

    def stack(self, feeds: Sequence[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], int | None]:
        """Concatenate ``feeds`` on axis 0, right-padding the sequence axis with zeros to the longest.

        Returns ``(batch_feed, padded_seq_len)``.
        """
        if len(feeds) == 1:
            return feeds[0], self.seq_len(feeds[0])
        seq = max(self.seq_len(f) or 0 for f in feeds) if self.seq_symbol else None
        out = {}
        for s in self.inputs:
            arrs = [f[s.name] for f in feeds]
            if seq and len(s.shape) > 1 and s.shape[1] == self.seq_symbol:
                arrs = [a if a.shape[1] == seq else
                        np.pad(a, [(0, 0), (0, seq - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in arrs]
            out[s.name] = np.concatenate(arrs, axis=0)
        return out, seq

    def split(self, outputs: dict[str, np.ndarray], feeds: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Cut batch outputs back into one dict per request (rows by offset; padded sequence axes trimmed)."""
        if len(feeds) == 1:
            return [outputs]
        seq_axes = {o.name: [i for i, d in enumerate(o.shape) if i > 0 and d == self.seq_symbol]
                    for o in self.outputs} if self.seq_symbol else {}
        parts, start = [], 0
        for f in feeds:
            n, length = self.rows(f), self.seq_len(f)
            part = {}
            for name, arr in outputs.items():
                piece = arr[start:start + n]
                for ax in seq_axes.get(name, []):
                    piece = np.take(piece, np.arange(length), axis=ax)
                part[name] = piece
            parts.append(part)
            start += n
        return parts


def example_feed(layout: BatchLayout, batch: int, seq: int | None, rng: np.random.Generator | None = None,
                 dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Synthetic inputs for timing: ``batch`` rows, ``seq`` tokens; ints are 1 (mask 1, token 1), floats N(0, 1).

    Other symbolic dims take ``dims[symbol]`` or 1.
    """
    rng = rng or np.random.default_rng(0)
    feed = {}
    for s in layout.inputs:
        shape = []
        for i, d in enumerate(s.shape):
            if isinstance(d, int) and d >= 0:
                shape.append(d)
            elif i == 0 and layout.dynamic:
                shape.append(batch)
            elif d == layout.seq_symbol:
                shape.append(seq or 1)
            else:
                shape.append((dims or {}).get(str(d), 1))
        dt = np.dtype(s.dtype)
        if dt.kind in "iub":
            feed[s.name] = np.ones(shape, dtype=dt)
        else:
            feed[s.name] = rng.standard_normal(shape).astype(dt)
    return feed
