"""Exact and near duplicates.

Exact: a document's key (the text, or for tabular rows the row's values) is hashed with BLAKE2b to 64 bits; a
document whose hash occurred earlier is an exact duplicate.

Near: each document's word 3-gram shingles (lower-cased ``\\w+`` words; a shorter document is one shingle) get a
MinHash signature from ``datasketch.MinHash`` (``scheme="affine32"``, seed 1, ``num_perm`` values of 32 bits). Among
first occurrences, LSH banding with datasketch's optimal (bands, rows) for the threshold (``MinHashLSH(threshold,
num_perm).b/.r``) proposes candidates: documents whose signatures agree on a whole band. The bands are grouped with a
sort over all signatures at the end (not a dict-of-lists index per band), and a candidate pair counts when its
estimated Jaccard similarity (share of equal signature values) is ≥ the threshold. A document is a near duplicate when
an earlier document passes with it. In a band group of more than ``GROUP_ALL_PAIRS`` documents, each member is compared
with the group's first member only.

State (the de-duplication index, the only state that grows with the corpus): per document 8 B hash + 8 B location
+ 4·num_perm B signature + 1 B has-shingles flag (529 B at num_perm = 128). Shards' states concatenate in shard
order, so the merged state equals a single pass over the data, and so do the results.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from ...runtime.errors import DsedgeError

SHINGLE = 3
GROUP_ALL_PAIRS = 64
EXAMPLES = 5
_M32 = np.uint64(0xFFFFFFFF)


def _datasketch():
    try:
        import datasketch
    except ModuleNotFoundError:
        raise DsedgeError("near-duplicate detection needs datasketch, which is not installed",
                          'pip install -e ".[data]"') from None
    return datasketch


@lru_cache(maxsize=8)
def permutations(num_perm: int) -> np.ndarray:
    """[2, num_perm] uint32: datasketch's affine32 permutation parameters (a, b) for seed 1."""
    return np.asarray(_datasketch().MinHash(num_perm=num_perm, seed=1, scheme="affine32").permutations,
                      dtype=np.uint32)


@lru_cache(maxsize=8)
def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's MinHashLSH picks for this threshold and num_perm."""
    lsh = _datasketch().MinHashLSH(threshold=threshold, num_perm=num_perm)
    return int(lsh.b), int(lsh.r)


def exact_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (what datasketch's affine32 scheme applies to each input hash)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def shingles(word_hashes: np.ndarray, doc_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint32 hashes of each document's word 3-grams (a document of fewer words is one shingle, an empty one none),
    concatenated, and the number of shingles per document. ``word_hashes``: uint32 per word, documents concatenated."""
    h = word_hashes.astype(np.uint64)
    n = h.size
    acc = h[: max(0, n - SHINGLE + 1)].copy()
    for j in range(1, SHINGLE):
        acc = (acc * np.uint64(0x9E3779B1) + h[j: n - SHINGLE + 1 + j]) & _M32
    starts = np.concatenate([[0], np.cumsum(doc_lens)[:-1]]).astype(np.int64)
    counts = np.where(doc_lens >= SHINGLE, doc_lens - SHINGLE + 1, (doc_lens > 0).astype(np.int64))
    out = []
    for s0, ln, c in zip(starts.tolist(), doc_lens.tolist(), counts.tolist()):
        if ln >= SHINGLE:
            out.append(acc[s0: s0 + c])
        elif ln:                                            # one shingle of the whole (short) document
            v = np.uint64(0)
            for x in h[s0: s0 + ln]:
                v = (v * np.uint64(0x9E3779B1) + x) & _M32
            out.append(np.array([v], dtype=np.uint64))
    flat = np.concatenate(out).astype(np.uint32) if out else np.zeros(0, np.uint32)
    return flat, counts


def minhash_signatures(sh: np.ndarray, counts: np.ndarray, num_perm: int, chunk: int = 8192,
                       perms: np.ndarray | None = None) -> np.ndarray:
    """[docs, num_perm] uint32 MinHash signatures, bit-identical to ``datasketch.MinHash(num_perm, seed=1,
    scheme="affine32", hashfunc=int).update_batch(shingles)`` per document (its affine permutations applied to the
    fmix32-mixed shingle hashes, min per document), computed for many documents per numpy call (in place, in chunks
    of about ``chunk`` shingles so the [num_perm, chunk] buffer stays in cache). A document without shingles keeps
    datasketch's empty value (all 0xFFFFFFFF). ``perms``: :func:`permutations` computed beforehand (a worker then
    never imports datasketch)."""
    a, b = (p[:, None] for p in (permutations(num_perm) if perms is None else perms))
    sig = np.full((num_perm, counts.size), 0xFFFFFFFF, dtype=np.uint32)
    hv = _fmix32(sh.astype(np.uint32))
    ends = np.cumsum(counts)
    docs = np.nonzero(counts)[0]
    doc_ends = ends[docs]
    doc_starts = doc_ends - counts[docs]
    buf = np.empty((num_perm, chunk), dtype=np.uint32)
    i = 0
    while i < docs.size:                                    # groups of whole documents, ~chunk shingles each
        lo = doc_starts[i]
        j = max(int(np.searchsorted(doc_ends, lo + chunk, side="right")), i + 1)
        hi = doc_ends[j - 1]
        if hi - lo > buf.shape[1]:
            buf = np.empty((num_perm, hi - lo), dtype=np.uint32)
        out = buf[:, : hi - lo]
        np.multiply(a, hv[None, lo:hi], out=out)           # uint32 wraparound is the modulo 2**32
        np.add(out, b, out=out)
        sig[:, docs[i:j]] = np.minimum.reduceat(out, doc_starts[i:j] - lo, axis=1)
        i = j
    return np.ascontiguousarray(sig.T)


class DedupState:
    """The de-duplication index of one shard (or of merged shards, in data order)."""

    def __init__(self, num_perm: int = 128, near: bool = True, perms: np.ndarray | None = None) -> None:
        self.num_perm = num_perm
        self.perms = perms
        self.near = near
        self._hashes: list[np.ndarray] = []
        self._locs: list[np.ndarray] = []
        self._sigs: list[np.ndarray] = []        # one [docs, num_perm] block per batch, never concatenated
        self._nonempty: list[np.ndarray] = []    # bool per document: has at least one shingle

    def update(self, keys: list[str], locs: list[int], word_hashes: np.ndarray | None = None,
                doc_lens: np.ndarray | None = None) -> None:
        """``keys``: what exact duplicates compare; ``word_hashes`` (uint32 per word, documents concatenated) and
        ``doc_lens`` (words per document) feed the MinHash signatures (near duplicates)."""
        self._hashes.append(np.fromiter((exact_hash(k) for k in keys), dtype=np.uint64, count=len(keys)))
        self._locs.append(np.asarray(locs, dtype=np.int64))
        if not (self.near and word_hashes is not None):
            return
        sh, counts = shingles(word_hashes, doc_lens)
        self._sigs.append(minhash_signatures(sh, counts, self.num_perm, perms=self.perms))
        self._nonempty.append(counts > 0)

    def merge(self, other: "DedupState") -> None:
        self._hashes += other._hashes
        self._locs += other._locs
        self._sigs += other._sigs
        self._nonempty += other._nonempty

    def compact(self) -> None:
        """Concatenate the per-batch hash and location arrays (16 B/doc; signature blocks stay as they are, so the
        index is never copied whole)."""
        for name in ("_hashes", "_locs", "_nonempty"):
            parts = getattr(self, name)
            if len(parts) > 1:
                setattr(self, name, [np.concatenate(parts)])

    @property
    def bytes_per_doc(self) -> int:
        return 16 + (4 * self.num_perm + 1 if self.near else 0)

    def index_bytes(self) -> int:
        return sum(a.nbytes for a in self._hashes + self._locs + self._sigs + self._nonempty)

    def result(self, threshold: float) -> dict:
        self.compact()
        hashes = self._hashes[0] if self._hashes else np.zeros(0, np.uint64)
        locs = self._locs[0] if self._locs else np.zeros(0, np.int64)
        n = int(hashes.size)
        uniq, first, counts = np.unique(hashes, return_index=True, return_counts=True)
        exact_dups = n - int(uniq.size)
        groups = np.argsort(-counts, kind="stable")[:EXAMPLES] if exact_dups else []
        exact_ex = []
        for g in groups:
            if counts[g] < 2:
                break
            members = np.sort(np.nonzero(hashes == uniq[g])[0])[:3]
            exact_ex.append({"copies": int(counts[g]), "locs": locs[members].tolist()})
        out = {"docs": n, "exact_duplicates": exact_dups, "exact_examples": exact_ex,
               "index_bytes_per_doc": self.bytes_per_doc, "index_bytes": self.index_bytes()}
        if self.near and self._sigs:
            out.update(self._near(np.sort(first), locs, threshold))
        return out

    def _near(self, firsts: np.ndarray, locs: np.ndarray, threshold: float) -> dict:
        blocks = self._sigs
        starts = np.cumsum([0] + [b.shape[0] for b in blocks])

        def row(i: int) -> np.ndarray:
            k = int(np.searchsorted(starts, i, side="right")) - 1
            return blocks[k][i - starts[k]]

        keep = firsts[self._nonempty[0][firsts]]                          # first occurrences with a shingle
        bands, rows = lsh_params(threshold, self.num_perm)
        near: dict[int, tuple[int, float]] = {}
        checked: set[tuple[int, int]] = set()
        for band in range(bands):
            cols = slice(band * rows, (band + 1) * rows)
            part = np.concatenate([b[:, cols] for b in blocks])[keep]        # [kept docs, rows], one band at a time
            key = part.view(np.dtype((np.void, part.dtype.itemsize * rows))).ravel()
            _, inv = np.unique(key, return_inverse=True)
            order = np.argsort(inv.ravel(), kind="stable")                   # groups, each in data order
            sorted_inv = inv.ravel()[order]
            cuts = np.flatnonzero(np.diff(sorted_inv)) + 1
            gstarts = np.concatenate([[0], cuts])
            gends = np.concatenate([cuts, [order.size]])
            for g in np.nonzero(gends - gstarts > 1)[0]:
                members = keep[order[gstarts[g]:gends[g]]]
                pairs = ([(members[i], members[j]) for j in range(1, len(members)) for i in range(j)]
                         if len(members) <= GROUP_ALL_PAIRS else [(members[0], m) for m in members[1:]])
                for a, b in pairs:
                    if (a, b) in checked:
                        continue
                    checked.add((a, b))
                    j = float((row(a) == row(b)).mean())
                    if j >= threshold and (b not in near or a < near[b][0]):
                        near[int(b)] = (int(a), j)
        ex = [{"locs": [int(locs[a]), int(locs[b])], "jaccard": round(j, 4)}
              for b, (a, j) in sorted(near.items())[:EXAMPLES]]
        return {"near_duplicates": len(near), "near_examples": ex, "near_threshold": threshold,
                "lsh": {"bands": bands, "rows": rows, "num_perm": self.num_perm, "shingle_words": SHINGLE}}
