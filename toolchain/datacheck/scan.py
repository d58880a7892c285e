"""One pass over a shard: every check's state, updated batch by batch, and the merge of shards' states.

``ScanPlan`` is everything a worker needs (picklable, resolved once from the first rows); ``scan_shard`` streams one
shard into a ``ShardState``; ``ShardState.merge`` combines states of consecutive shards in data order.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from .config import DataCheckConfig
from .dedup import DedupState, permutations
from .entities import EntityState
from .schema import SchemaState, csv_kinds, json_kind
from .sources import TEXT_FIELD, Batch, DataError, Shard, plan_shards, read_batches
from .tabular import TabularState
from .tokens import TokenState, load_tokenizer, words_of

TEXT_NAMES = ("text", "content", "document", "sentence", "body")
LABEL_NAMES = ("label", "class", "target", "y", "is_fraud")
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class ScanPlan:
    data: str
    fmt: str
    files: tuple[str, ...]
    columns: tuple[str, ...]
    text_field: str | None
    label: str | None
    tokenizer: str | None = None
    entities: tuple[str, ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    near: bool = True
    near_threshold: float = 0.8
    num_perm: int = 128
    ranges: dict = field(default_factory=dict)
    batch_rows: int = 4096
    permutations: np.ndarray | None = None      # MinHash (a, b) from datasketch, computed once by the planner


def _pick(columns: list[str], names: tuple[str, ...]) -> str | None:
    lower = {c.lower(): c for c in reversed(columns)}
    return next((lower[n] for n in names if n in lower), None)


def resolve_plan(data: str, cfg: DataCheckConfig, tokenizer: str | None = None,
                 entities: list[str] | None = None, batch_rows: int = 4096) -> ScanPlan:
    """Read the first batch to learn the columns, then pick the text field and the label.

    The text field is ``cfg.text_field``, else ``text`` for plain text, else a column named text/content/document/
    sentence/body; the label is ``cfg.label``, else a column named label/class/target/y/is_fraud (case-insensitive).
    Raises DataError when a named field is not in the data.
    """
    shards = plan_shards(data)
    first = shards[0]
    columns: list[str] = list(first.header)
    if first.fmt == "text":
        columns = [TEXT_FIELD]
    elif first.fmt in ("jsonl", "parquet"):
        b = next(read_batches(first, batch_rows), Batch())
        columns = list(b.columns)
    text_field = cfg.text_field or (TEXT_FIELD if first.fmt == "text" else _pick(columns, TEXT_NAMES))
    label = cfg.label or _pick([c for c in columns if c != text_field], LABEL_NAMES)
    for what, name in (("text field", cfg.text_field), ("label", cfg.label)):
        if name and columns and name not in columns:
            raise DataError(f"{data}: no {what} {name!r} (columns: {', '.join(columns[:12])})",
                            "check --text-field / [tabular] label")
    unknown = sorted(set(cfg.ranges) - set(columns)) if columns and first.fmt != "jsonl" else []
    if unknown:
        raise DataError(f"{data}: [tabular] ranges names column(s) {unknown} that the data does not have",
                        f"columns: {', '.join(columns[:12])}")
    max_tokens = cfg.max_tokens
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        if max_tokens is None:
            max_tokens = tok.model_max_length
    return ScanPlan(data=str(data), fmt=first.fmt, files=tuple(dict.fromkeys(s.path for s in shards)),
                    columns=tuple(columns), text_field=text_field, label=label, tokenizer=tokenizer,
                    entities=tuple(entities) if entities else None, max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                    near=cfg.near, near_threshold=cfg.near_threshold, num_perm=cfg.num_perm,
                    ranges=dict(cfg.ranges), batch_rows=batch_rows,
                    permutations=permutations(cfg.num_perm) if cfg.near and text_field else None)


def _as_float(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return np.nan
    try:
        return float(v)
    except OverflowError:                      # a JSON integer beyond float64
        return np.inf if v > 0 else -np.inf


def _numeric(values: list) -> np.ndarray:
    return np.fromiter(map(_as_float, values), dtype=np.float64, count=len(values))


def _factorize(flat: list[str]) -> tuple[np.ndarray, list[str]]:
    """(code per word, distinct words in first-seen order), with pandas' C hash table (3x a Counter here)."""
    if not flat:
        return np.zeros(0, np.int64), []
    import pandas as pd

    codes, distinct = pd.factorize(np.array(flat, dtype=object))
    return codes, list(distinct)


def _row_key(cols: list[list], i: int) -> str:
    return "\x1f".join(v if isinstance(v, str) else json.dumps(v, default=str) for v in (c[i] for c in cols))


class ShardState:
    """All checks' state for a run of rows. ``docs`` counts text documents; ``bytes`` the bytes read."""

    def __init__(self, plan: ScanPlan) -> None:
        self.plan = plan
        self.schema = SchemaState()
        vocab = load_tokenizer(plan.tokenizer).vocab_size if plan.tokenizer and plan.text_field else None
        self.tokens = TokenState(vocab) if plan.text_field else None
        self.dedup = DedupState(plan.num_perm, near=plan.near and plan.text_field is not None,
                                perms=plan.permutations)
        self.entities = EntityState(list(plan.entities)) if plan.entities and plan.text_field else None
        self.tabular = TabularState(plan.label, plan.ranges)
        self.docs = 0

    def update(self, batch: Batch) -> None:
        plan = self.plan
        kinds: dict[str, np.ndarray] = {}
        numeric: dict[str, np.ndarray] = {}
        for name, values in batch.columns.items():
            if plan.fmt == "csv":
                kinds[name], numeric[name] = csv_kinds(values)
            else:
                kinds[name] = np.array([json_kind(v) for v in values], dtype=object)
                if name != plan.text_field:
                    numeric[name] = _numeric(values)
        self.schema.update(batch, kinds)
        if plan.text_field:
            self._update_text(batch)
        else:
            cols = list(batch.columns.values())
            self.dedup.update([_row_key(cols, i) for i in range(batch.n)], batch.locs)
        tab = {k: v for k, v in numeric.items() if k != plan.text_field}
        if tab:
            self.tabular.update(batch.columns, tab, kinds)

    def _update_text(self, batch: Batch) -> None:
        plan = self.plan
        values = batch.columns.get(plan.text_field, [])
        sel = [i for i, v in enumerate(values) if isinstance(v, str) and v.strip()]
        texts = [values[i] for i in sel]
        locs = [batch.locs[i] for i in sel]
        self.docs += len(texts)
        words = [words_of(t) for t in texts]
        doc_lens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        codes, distinct = _factorize(list(chain.from_iterable(words)))
        distinct_hash = np.fromiter((zlib.crc32(w.encode()) for w in distinct), dtype=np.uint32, count=len(distinct))
        if plan.tokenizer:
            tok = load_tokenizer(plan.tokenizer)
            self.tokens.update_ids(tok.encode(texts), tok.unk_id, tok.specials)
        else:
            self.tokens.update_words(doc_lens, distinct_hash, np.bincount(codes, minlength=len(distinct)))
        self.dedup.update(texts, locs, distinct_hash[codes], doc_lens)
        if self.entities is not None:
            self.entities.update(words)

    def merge(self, other: "ShardState") -> "ShardState":
        """Append ``other`` (the shard after this one) to this state; returns self."""
        self.schema.merge(other.schema)
        if self.tokens is not None:
            self.tokens.merge(other.tokens)
        self.dedup.merge(other.dedup)
        if self.entities is not None:
            self.entities.merge(other.entities)
        self.tabular.merge(other.tabular)
        self.docs += other.docs
        return self


def scan_shard(plan: ScanPlan, shard: Shard) -> ShardState:
    """Stream one shard into a fresh state (memory: one batch plus the state)."""
    st = ShardState(plan)
    for batch in read_batches(shard, plan.batch_rows):
        st.update(batch)
    st.dedup.compact()
    return st
