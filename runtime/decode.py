"""Continuous batching for decoders exported with past key/values (optimum ``text-generation-with-past``).

One loop thread owns a running batch. Between decode steps it retires finished sequences and admits waiting ones
(iteration-level scheduling, Yu et al., "Orca", OSDI 2022): a new prompt is prefilled alone, then its key/value
cache joins the batch. The batch's caches are kept left-padded to a common length ``L`` — ``[B, heads, L, head_dim]``
per layer with an attention mask ``[B, L]`` marking real positions and explicit ``position_ids`` per row — so rows
of different lengths decode together and give the tokens each would give alone. Columns that are padding in every
row are trimmed when sequences retire. Decoding is greedy (argmax).

Sliding window (per request, ``window=W, sink_tokens=S``): before each step a windowed row keeps its first ``S``
entries and its most recent ``W - 1``, so that with the new token it attends to at most ``S + W``; positions are
assigned within the cache and the kept keys re-rotated (StreamingLLM; see ``kv_cache``). The prompt itself is
prefilled whole (full attention, so it must fit the model's context); its cache is cut at the first step. Only
rotary decoders whose bundle source names the ``model_type`` (and ``rope_theta`` ..., as a Hugging Face config does)
qualify; others are refused with ``InputError``.

Positions: a full-cache sequence ends with finish_reason "error" before a step would use a position past the
model's ``max_position_embeddings`` / ``n_positions`` (when the bundle's source names it), for rotary decoders too
(whose exports would otherwise go on past their trained context without an error, as absolute-position ones do not).

Ending early: ``GenerationStream.cancel()`` (or a reader that stops) ends a request; its row leaves the batch before
the next step. ``close(drain=True)`` waits for running sequences at most ``timeout_s`` (None: ``DRAIN_TIMEOUT_S``),
then ends what is left with "shutdown"; at interpreter exit live loops are stopped (runtime/streaming.py's atexit
hook), so a script that exits mid-generation exits cleanly.

Budgets: ``budget_ms`` bounds the time to first token (TTFT), ``token_budget_ms`` the gap between tokens. A
prompt whose predicted prefill cannot meet its TTFT budget is rejected at once ("budget"); one that waited too long
is rejected when its turn comes ("deadline"). New prompts join only while the predicted step time plus their
prefill keeps every running sequence within its per-token budget. Latencies are learned online per
(batch, length bucket) with ``LatencyProfile``.

Model IO (as optimum exports it): inputs ``input_ids`` [batch, seq] int64, ``attention_mask`` [batch, past+seq]
int64, optional ``position_ids`` [batch, seq] int64, ``past_key_values.{i}.key|value`` [batch, heads, past, dim];
outputs ``logits`` [batch, seq, vocab] and ``present.{i}.key|value`` [batch, heads, past+seq, dim].
"""
from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import BundleError, InputError
from .generation_stream import GenerationStream
from .io import is_integer
from .kv_cache import RotarySpec, WindowUnsupported, cache_bound_bytes, evict_row
from .latency_profile import LatencyProfile
from .results import BUDGET, DEADLINE, OVERLOAD, SHUTDOWN, Rejected
from .streaming import close_at_exit

_clock = time.perf_counter
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
DRAIN_TIMEOUT_S = 30.0  # close(drain=True, timeout_s=None): the longest wait for running sequences, s


def is_decoder(input_names: Sequence[str]) -> bool:
    """True when the model takes ``past_key_values.N.key/value`` and ``input_ids`` (a decoder with past)."""
    return "input_ids" in input_names and any(_PAST.match(n) for n in input_names)


@dataclass(eq=False)
class _Row:
    stream: GenerationStream
    length: int  # real cache entries (prompt + generated - evicted), = next position id
    last: int  # last token, fed at the next step

    @property
    def keep(self) -> int | None:
        """Entries a windowed row may hold before a step (the step adds one), None for a full cache."""
        s = self.stream
        return None if s.window is None else s.sink_tokens + s.window - 1


@dataclass
class DecodeStats:
    """Counters of the loop: steps run, most rows in one step, prompts that joined a running batch."""

    steps: int = 0
    max_rows: int = 0
    joins_while_running: int = 0
    prefills: int = 0
    rows_per_step: list[int] = field(default_factory=list)
    evicted: int = 0
    cache_bytes: list[int] = field(default_factory=list)  # K/V bytes held after each step


class DecodeLoop:
    """Continuous-batching greedy generation over a decoder backend (see the module doc).

    Args:
        backend: an object with ``run(dict) -> dict`` and an ORT ``session`` (for IO names and shapes).
        max_batch: most sequences decoded together.
        max_waiting: most prompts waiting to join; more are rejected with "overload".
        eos_token_id: default end-of-sequence token (a request may name its own; None: only max_new_tokens
            stops a sequence).
        model_config: the decoder's Hugging Face style config (``model_type``, ``rope_theta``,
            ``max_position_embeddings`` ...; a bundle's ``source``): needed for sliding-window requests.
        vocab_size: token ids a prompt may hold are ``0 … vocab_size - 1`` (default: the static last dim of the
            ``logits`` output, if any).
    """

    def __init__(self, backend: Any, max_batch: int = 8, max_waiting: int = 256,
                 eos_token_id: int | None = None, model_config: dict[str, Any] | None = None,
                 vocab_size: int | None = None) -> None:
        self.backend = backend
        ins = {i.name: i for i in backend.session.get_inputs()}
        self.layers = sorted({int(m.group(1)) for n in ins if (m := _PAST.match(n))})
        if not is_decoder(list(ins)):
            raise InputError("this model is not a decoder with past key/values",
                             "export it with optimum's text-generation-with-past task")
        k0 = ins[f"past_key_values.{self.layers[0]}.key"]
        self.heads, self.head_dim = int(k0.shape[1]), int(k0.shape[3])
        self.kv_dtype = np.float16 if "float16" in k0.type else np.float32
        self.has_positions = "position_ids" in ins
        config = model_config or {}
        self.max_positions = config.get("max_position_embeddings") or config.get("n_positions")
        logits = next((o for o in backend.session.get_outputs() if o.name == "logits"), None)
        width = logits.shape[-1] if logits is not None and logits.shape else None
        self.vocab_size = int(vocab_size) if vocab_size else (width if isinstance(width, int) and width > 0 else None)
        self.rope: RotarySpec | None = None
        self._no_window = ""
        try:
            self.rope = RotarySpec.from_config(model_config, self.head_dim)
            if not self.has_positions:
                raise WindowUnsupported("the exported decoder takes no position_ids, so positions cannot be "
                                        "assigned within the cache")
        except WindowUnsupported as e:
            self.rope, self._no_window = None, str(e)
        self.max_batch = int(max_batch)
        self.max_waiting = int(max_waiting)
        self.eos = eos_token_id
        try:
            self.stop_ids = self._stop_ids(eos_token_id) if eos_token_id is not None else frozenset()
        except InputError as e:  # the default comes from the bundle's source: its fault, not the caller's
            raise BundleError(f"the bundle's default {e}", "rebuild the bundle from a config whose eos_token_id is "
                                                           "a token id (or a list of them) within the vocabulary") from None
        self.prefill_profile = LatencyProfile("prefill")
        self.step_profile = LatencyProfile("decode")
        self.stats = DecodeStats()
        self._waiting: list[GenerationStream] = []
        self._rows: list[_Row] = []
        self._kv: dict[str, np.ndarray] = {}
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._cond = threading.Condition()
        self._closing = False
        self._drain = True
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # -- model calls --------------------------------------------------------------------------------------------
    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        z = np.zeros((batch, self.heads, 0, self.head_dim), dtype=self.kv_dtype)
        return {f"past_key_values.{i}.{kv}": z for i in self.layers for kv in ("key", "value")}

    def _prefill(self, prompt: np.ndarray) -> tuple[int, dict[str, np.ndarray], np.ndarray]:
        n = prompt.shape[0]
        feed = {"input_ids": prompt[None, :], "attention_mask": np.ones((1, n), dtype=np.int64),
                **self._empty_past(1)}
        if self.has_positions:
            feed["position_ids"] = np.arange(n, dtype=np.int64)[None, :]
        t0 = _clock()
        out = self.backend.run(feed)
        self.prefill_profile.observe(1, n, (_clock() - t0) * 1e3)
        kv = {f"past_key_values.{i}.{k}": out[f"present.{i}.{k}"] for i in self.layers for k in ("key", "value")}
        return int(np.argmax(out["logits"][0, -1])), kv, out["logits"][0, -1]

    def _join(self, kv: dict[str, np.ndarray], length: int) -> None:
        """Append one prefilled row to the batch, left-padding whichever side is shorter."""
        cur = self._mask.shape[1]
        width = max(cur, length)
        if self._rows:
            if width > cur:
                self._kv = {k: np.pad(v, [(0, 0), (0, 0), (width - cur, 0), (0, 0)]) for k, v in self._kv.items()}
                self._mask = np.pad(self._mask, [(0, 0), (width - cur, 0)])
            new = {k: np.pad(v, [(0, 0), (0, 0), (width - length, 0), (0, 0)]) for k, v in kv.items()}
            self._kv = {k: np.concatenate([self._kv[k], new[k]], axis=0) for k in self._kv}
        else:
            self._kv = dict(kv)
        row_mask = np.concatenate([np.zeros(width - length, np.int64), np.ones(length, np.int64)])[None, :]
        self._mask = row_mask if not self._rows else np.concatenate([self._mask, row_mask], axis=0)

    def _retire(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._kv, self._mask = {}, np.zeros((0, 0), dtype=np.int64)
            return
        idx = np.asarray(keep)
        mask = self._mask[idx]
        first = int(np.argmax(mask.any(axis=0)))  # leading columns that are padding in every row go
        self._mask = mask[:, first:]
        self._kv = {k: v[idx][:, :, first:] for k, v in self._kv.items()}

    @property
    def cache_bytes(self) -> int:
        """Bytes of the running batch's K/V cache (all layers, keys and values)."""
        return sum(v.nbytes for v in self._kv.values())

    def cache_bound_bytes(self, window: int, sink_tokens: int) -> int:
        """Most K/V bytes one stream with this window holds (see ``kv_cache.cache_bound_bytes``)."""
        return cache_bound_bytes(sink_tokens, window, len(self.layers), self.heads, self.head_dim,
                                 np.dtype(self.kv_dtype).itemsize)

    def _evict(self) -> None:
        """Cut windowed rows down to sinks + recent entries, then trim columns that became padding in every row."""
        rows = [(i, r) for i, r in enumerate(self._rows) if r.keep is not None and r.length > r.keep]
        if not rows:
            return
        self._kv = {k: v if v.flags.writeable else v.copy() for k, v in self._kv.items()}
        for i, r in rows:
            e = evict_row(self._kv, self._mask, i, r.length, r.stream.sink_tokens, r.keep, self.rope)
            r.length -= e
            self.stats.evicted += e
        first = int(np.argmax(self._mask.any(axis=0)))
        if first:
            self._mask = self._mask[:, first:]
            self._kv = {k: v[:, :, first:] for k, v in self._kv.items()}

    def _step_feed(self) -> dict[str, np.ndarray]:
        """The next decode step's inputs for every running row (batch axis 0 in every array)."""
        b = len(self._rows)
        mask = np.concatenate([self._mask, np.ones((b, 1), np.int64)], axis=1)
        feed = {"input_ids": np.array([[r.last] for r in self._rows], dtype=np.int64), "attention_mask": mask,
                **self._kv}
        if self.has_positions:
            feed["position_ids"] = np.array([[r.length] for r in self._rows], dtype=np.int64)
        return feed

    def _failing_rows(self) -> dict[int, str]:
        """After a failed step: run each row's step alone and return ``{row index: error}`` for the rows that fail
        alone (empty when none does: then the batch itself failed), so one bad sequence (e.g. past an absolute-
        position model's context) does not end its batch-mates."""
        feed, bad = self._step_feed(), {}
        for i in range(len(self._rows)):
            try:
                self.backend.run({k: v[i:i + 1] for k, v in feed.items()})
            except Exception as e:
                bad[i] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        return bad

    def _step(self) -> tuple[list[int], np.ndarray]:
        self._evict()
        b = len(self._rows)
        feed = self._step_feed()
        mask = feed["attention_mask"]
        t0 = _clock()
        out = self.backend.run(feed)
        self.step_profile.observe(b, mask.shape[1], (_clock() - t0) * 1e3)
        self._kv = {f"past_key_values.{i}.{k}": out[f"present.{i}.{k}"] for i in self.layers for k in ("key", "value")}
        self._mask = mask
        logits = out["logits"][:, -1]
        return [int(t) for t in np.argmax(logits, axis=-1)], logits

    # -- admission ----------------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int, budget_ms: float,
               token_budget_ms: float, id: Any = None, eos_token_id: int | None = None, window: int | None = None,
               sink_tokens: int = 4, output_scores: bool = False) -> GenerationStream:
        """Queue a prompt (1-D token ids); returns its ``GenerationStream`` (maybe already rejected).

        Args:
            window: sliding-window decode: keep ``sink_tokens`` first entries plus the most recent ``window``
                (None: the full cache grows with the sequence).
            sink_tokens: attention-sink entries kept at the start of a windowed cache (StreamingLLM uses 4).
            output_scores: keep each step's logits on ``stream.scores``.
        Raises:
            InputError: empty or non-integer prompt, a token id outside the vocabulary, a prompt longer than the
                model's positions, max_new_tokens not an integer ≥ 1, a non-integer eos_token_id, a window on a
                decoder that is not rotary (or whose bundle does not say), window < 1, sink_tokens < 0, sinks +
                window past the model's ``max_position_embeddings``.
            RuntimeError: after ``close()``.
        Also: window and sink_tokens must be ints (not bool), eos_token_id within the vocabulary.
        """
        p = np.asarray(prompt)
        if p.ndim != 1 or p.size == 0 or p.dtype.kind not in "iu":
            raise InputError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {list(p.shape)} "
                             f"dtype {p.dtype}", "pass a list of ints from your tokenizer (for its [1, n] "
                             "return_tensors='np' array, pass ids[0])")
        if int(p.min()) < 0 or (self.vocab_size is not None and int(p.max()) >= self.vocab_size):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            raise InputError(f"prompt holds token id {bad}, outside the model's vocabulary [0, "
                             f"{'…' if self.vocab_size is None else self.vocab_size - 1}]",
                             "use the tokenizer the decoder was trained with")
        if self.max_positions and p.size > int(self.max_positions):
            raise InputError(f"prompt of {p.size} tokens is longer than the model's {self.max_positions} positions",
                             "the prompt is prefilled whole: shorten it (keep its most recent tokens)")
        if not is_integer(max_new_tokens) or int(max_new_tokens) < 1:
            raise InputError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens!r}",
                             "ask for at least one token")
        stop = self.stop_ids if eos_token_id is None else self._stop_ids(eos_token_id)
        for name, value in (("window", window), ("sink_tokens", sink_tokens)):
            if (value is not None or name == "sink_tokens") and not is_integer(value):
                raise InputError(f"{name} must be an integer, got {type(value).__name__} {value!r}",
                                 "pass window=None (full cache) or an int such as 256, and sink_tokens=4")
        if int(sink_tokens) < 0:
            raise InputError(f"sink_tokens must be ≥ 0, got {int(sink_tokens)}", "StreamingLLM uses 4 sink tokens")
        if window is not None:
            self._check_window(int(window), int(sink_tokens))
        s = GenerationStream(next(self._ids) if id is None else id, p.astype(np.int64), max_new_tokens, budget_ms,
                             token_budget_ms, self.eos if eos_token_id is None else eos_token_id, stop,
                             None if window is None else int(window), int(sink_tokens) if window else 0,
                             output_scores)
        with self._cond:
            if self._closing:
                raise RuntimeError("decode loop is closed")
            self._ensure_thread()
            prefill = self.prefill_profile.predict(1, p.size)
            if not self.prefill_profile.empty and prefill > budget_ms:
                self._reject(s, BUDGET, f"predicted prefill {prefill:.1f} ms > TTFT budget {budget_ms:g} ms")
            elif len(self._waiting) >= self.max_waiting:
                self._reject(s, OVERLOAD, f"{len(self._waiting)} prompts already waiting")
            else:
                self._waiting.append(s)
                self._waiting.sort(key=lambda x: x.deadline)
                self._cond.notify()
        return s

    def _check_window(self, window: int, sink_tokens: int) -> None:
        if self.rope is None:
            raise InputError(f"sliding-window decode needs a rotary (RoPE) decoder: {self._no_window}",
                             "decode with the full cache (window=None), or use a RoPE decoder (Llama, Mistral, "
                             "Qwen, Phi-3 ...) whose bundle source carries its config")
        if window < 1 or sink_tokens < 0:
            raise InputError(f"window must be ≥ 1 and sink_tokens ≥ 0, got window={window} "
                             f"sink_tokens={sink_tokens}", "StreamingLLM uses 4 sink tokens and a window of "
                             "hundreds to thousands of tokens")
        if self.max_positions and sink_tokens + window > int(self.max_positions):
            raise InputError(f"sink_tokens + window = {sink_tokens + window} is past the model's "
                             f"{self.max_positions} positions", "use a smaller window")

    def _reject(self, s: GenerationStream, reason: str, detail: str) -> None:
        s._finish("shutdown" if reason == SHUTDOWN else "rejected",
                  Rejected(s.id, reason, detail, s.budget_ms, (_clock() - s.t_submit) * 1e3))

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsedge-decode", daemon=True)
            self._thread.start()
            close_at_exit(self)  # stopped at interpreter exit if still running

    def _admit(self) -> list[GenerationStream]:
        """Waiting prompts to prefill before the next step, earliest TTFT deadline first (lock held)."""
        now = _clock()
        out: list[GenerationStream] = []
        rows = len(self._rows)
        width = self._mask.shape[1] + 1 if rows else 0
        tight = min((r.stream.token_budget_ms for r in self._rows), default=float("inf"))
        spent = 0.0
        for s in list(self._waiting):
            if s.done():  # cancelled while waiting
                self._waiting.remove(s)
                continue
            if rows + len(out) >= self.max_batch:
                break
            prefill = self.prefill_profile.predict(1, s.prompt.size)
            prefill = 0.0 if prefill == float("inf") else prefill
            if not self.prefill_profile.empty and now + prefill / 1e3 > s.deadline:
                self._waiting.remove(s)
                self._reject(s, DEADLINE, f"TTFT deadline passed while waiting (needs {prefill:.1f} ms more)")
                continue
            step = self.step_profile.predict(rows + len(out) + 1, max(width, s.prompt.size + 1))
            step = 0.0 if step == float("inf") else step
            # running rows wait for this prefill: join only while their per-token budget still holds
            if rows and spent + prefill + step > tight:
                break
            spent += prefill
            out.append(s)
            self._waiting.remove(s)
        return out

    # -- loop ---------------------------------------------------------------------------------------------------
    def _drop_ended(self) -> None:
        """Waiting prompts and running rows whose stream already ended (``cancel()``) leave (lock held)."""
        if any(s.done() for s in self._waiting):
            self._waiting = [s for s in self._waiting if not s.done()]
        keep = [i for i, r in enumerate(self._rows) if not r.stream.done()]
        if len(keep) < len(self._rows):
            self._retire(keep)

    def _end_past_positions(self) -> None:
        """Full-cache rows whose next step would use a position past the model's positions end with "error" (an
        absolute-position export fails there anyway; a rotary one would go on silently past its context)."""
        if not self.max_positions:
            return
        top = int(self.max_positions)
        bad = [i for i, r in enumerate(self._rows) if r.keep is None and r.length >= top]
        for i in bad:
            self._rows[i].stream._finish("error", error=f"PositionLimit: the next token would be at position "
                                         f"{self._rows[i].length}, past the model's {top} positions "
                                         "(max_position_embeddings); use window= on a rotary decoder")
        if bad:
            self._retire([i for i in range(len(self._rows)) if i not in bad])

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._drop_ended()
                while not self._waiting and not self._rows and not self._closing:
                    self._cond.wait()
                if self._closing and not self._drain:
                    for s in self._waiting:
                        self._reject(s, SHUTDOWN, "session closed before this prompt ran")
                    self._waiting.clear()
                    for r in self._rows:
                        r.stream._finish("shutdown")
                    self._rows, self._kv, self._mask = [], {}, np.zeros((0, 0), dtype=np.int64)
                    return
                if self._closing and not self._waiting and not self._rows:
                    return
                joining = self._admit()
            for s in joining:
                try:
                    token, kv, logits = self._prefill(s.prompt)
                except Exception as e:  # fails this prompt only
                    s._finish("error", error=f"{type(e).__name__}: {str(e).strip()[:300]}")
                    continue
                self.stats.prefills += 1
                if self._rows:
                    self.stats.joins_while_running += 1
                reason = self._finish_reason(s, token)
                if not s._emit(token, logits, reason) or reason is not None:
                    continue  # ended by its first token, or cancelled during its prefill
                self._join(kv, s.prompt.size)
                self._rows.append(_Row(s, s.prompt.size, token))
            with self._cond:
                self._drop_ended()  # cancelled during the prefills
            self._end_past_positions()
            if not self._rows:
                continue
            try:
                tokens, logits = self._step()
            except Exception as e:  # a failed step fails the sequences that fail alone; the loop keeps serving
                err = f"{type(e).__name__}: {str(e).strip()[:300]}"
                bad = self._failing_rows() if len(self._rows) > 1 else {}
                bad = bad or {i: err for i in range(len(self._rows))}
                for i, why in bad.items():
                    self._rows[i].stream._finish("error", error=why)
                self._retire([i for i in range(len(self._rows)) if i not in bad])
                continue
            self.stats.steps += 1
            self.stats.max_rows = max(self.stats.max_rows, len(self._rows))
            if len(self.stats.rows_per_step) < 10_000:
                self.stats.rows_per_step.append(len(self._rows))
                self.stats.cache_bytes.append(self.cache_bytes)
            keep = []
            for i, (r, t) in enumerate(zip(self._rows, tokens)):
                reason = self._finish_reason(r.stream, t)
                r.length += 1
                r.last = t
                if r.stream._emit(t, logits[i], reason) and reason is None:
                    keep.append(i)  # else it ended: by this token, or cancelled while the step ran
            if len(keep) < len(self._rows):
                self._retire(keep)

    def _stop_ids(self, eos_token_id: Any) -> frozenset[int]:
        """The stop tokens ``eos_token_id`` names: one id, or a list of them (Hugging Face configs may name
        several: Llama 3's ``[128001, 128008, 128009]``). Raises ``InputError`` for a non-integer id, or one outside
        ``0 … vocab_size - 1`` (it could never stop the sequence)."""
        if isinstance(eos_token_id, np.ndarray) and eos_token_id.ndim <= 1:  # e.g. a tokenizer's array of ids
            eos_token_id = eos_token_id.tolist()
        ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        if not ids:
            raise InputError("eos_token_id is an empty list", "pass the tokenizer's eos_token_id, or None")
        for t in ids:
            if not is_integer(t):
                raise InputError(f"eos_token_id must be an integer token id (or a list of them), got {t!r}",
                                 "pass the tokenizer's eos_token_id, or None")
            if int(t) < 0 or (self.vocab_size is not None and int(t) >= self.vocab_size):
                raise InputError(f"eos_token_id {int(t)} is outside the model's vocabulary [0, "
                                 f"{'…' if self.vocab_size is None else self.vocab_size - 1}]: it could never stop "
                                 "the sequence", "pass the eos_token_id of the tokenizer the decoder was trained with")
        return frozenset(int(t) for t in ids)

    @staticmethod
    def _finish_reason(s: GenerationStream, token: int) -> str | None:
        """How ``token`` (about to be emitted) ends ``s``: "eos", "length", or None when it goes on."""
        if token in s.stop_ids:
            return "eos"
        if len(s.tokens) + 1 >= s.max_new_tokens:
            return "length"
        return None

    def warmup(self, prompt_lens: Sequence[int] = (8, 32), batch_sizes: Sequence[int] = (1, 2, 4, 8),
               past_len: int = 32) -> None:
        """Time prefill at a few prompt lengths and decode steps at a few batch sizes (first run discarded);
        lengths are kept within the model's positions when the config names them."""
        if self.max_positions:
            top = int(self.max_positions)
            prompt_lens = sorted({min(n, top) for n in prompt_lens})
            past_len = min(past_len, top - 1)
        for n in prompt_lens:
            p = np.ones(n, dtype=np.int64)
            for _ in range(3):
                self._prefill(p)
        for b in batch_sizes:
            if b > self.max_batch:
                break
            feed = {"input_ids": np.ones((b, 1), np.int64), "attention_mask": np.ones((b, past_len + 1), np.int64)}
            z = np.zeros((b, self.heads, past_len, self.head_dim), dtype=self.kv_dtype)
            feed.update({f"past_key_values.{i}.{k}": z for i in self.layers for k in ("key", "value")})
            if self.has_positions:
                feed["position_ids"] = np.full((b, 1), past_len, np.int64)
            self.backend.run(feed)
            for _ in range(3):
                t0 = _clock()
                self.backend.run(feed)
                self.step_profile.observe(b, past_len + 1, (_clock() - t0) * 1e3)

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop admitting; finish (drain) or end with "shutdown" every waiting and running sequence.

        Draining waits at most ``timeout_s`` seconds (None: ``DRAIN_TIMEOUT_S``, 30 s: a generation may be
        practically unbounded, and its reader may be gone), then ends what is still waiting or running with
        "shutdown" (their tokens so far stay on the streams) and returns once the step in progress ends."""
        with self._cond:
            self._closing = True
            self._drain = drain
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join((DRAIN_TIMEOUT_S if timeout_s is None else timeout_s) if drain else timeout_s)
            if thread.is_alive():
                with self._cond:
                    self._drain = False
                    self._cond.notify_all()
                thread.join()
        with self._cond:  # never started, or stopped: nothing may stay pending
            for s in self._waiting:
                self._reject(s, SHUTDOWN, "session closed before this prompt ran")
            self._waiting.clear()
