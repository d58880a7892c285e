"""Entity coverage: the share of a user's entity list that occurs in the corpus.

The entity file holds one entity per line (blank lines and lines starting with ``#`` are skipped). An entity occurs
in a document when its lower-cased ``\\w+`` words appear there consecutively (so "New York" matches "new york," but
not "newyork"). State: documents containing each entity (int64 per entity), which merges by addition.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...runtime.errors import DsedgeError
from .tokens import words_of

EXAMPLES = 10
DOCS_LISTED = 1000       # documents per entity are listed for the first entities only


class EntityFileError(DsedgeError):
    """The ``--entities`` file cannot be read or lists no entity."""


def load_entities(path: str | Path) -> list[str]:
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise EntityFileError(f"cannot read the entity list {p}: {e}", "one entity per line, UTF-8") from None
    out = list(dict.fromkeys(s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")))
    if not out or not any(words_of(e) for e in out):
        raise EntityFileError(f"{p} lists no entity", "one entity per line, UTF-8")
    return out


class EntityState:
    def __init__(self, entities: list[str]) -> None:
        self.entities = entities
        self.docs = np.zeros(len(entities), dtype=np.int64)
        self._index: dict[tuple[str, ...], int] = {}
        for i, e in enumerate(entities):
            self._index.setdefault(tuple(words_of(e)), i)
        self._index.pop((), None)
        self._lengths = sorted({len(k) for k in self._index})
        self._firsts = {k[0] for k in self._index}

    def update(self, docs_words: list[list[str]]) -> None:
        index, firsts = self._index, self._firsts
        for words in docs_words:
            hits: set[int] = set()
            for i, w in enumerate(words):
                if w not in firsts:
                    continue
                for n in self._lengths:
                    k = tuple(words[i:i + n])
                    if len(k) == n and k in index:
                        hits.add(index[k])
            if hits:
                self.docs[list(hits)] += 1

    def merge(self, other: "EntityState") -> None:
        self.docs += other.docs

    def result(self) -> dict:
        valid = np.array([bool(words_of(e)) for e in self.entities])
        # an entity equal (in words) to an earlier one shares its counter
        docs = np.array([self.docs[self._index.get(tuple(words_of(e)), i)] for i, e in enumerate(self.entities)])
        found = (docs > 0) & valid
        missing = [e for e, f in zip(self.entities, found) if not f]
        return {"entities": len(self.entities), "found": int(found.sum()),
                "coverage": float(found.sum() / len(self.entities)) if self.entities else None,
                "missing_examples": missing[:EXAMPLES],
                "docs_per_entity": {e: int(d) for e, d in list(zip(self.entities, docs))[:DOCS_LISTED]}}
