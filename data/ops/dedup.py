"""Deduplication: exact (normalised-text hash) and fuzzy MinHash-LSH.

MinHash (Broder 1997) over word 5-gram shingles after normalisation; LSH banding (Leskovec,
Rajaraman & Ullman, *Mining of Massive Datasets* §3.4): with b bands of r rows, two documents of
Jaccard similarity s become candidates with probability 1 − (1 − s^r)^b. Defaults 14 × 8 = 112
hashes (the datatrove/FineWeb MinHash configuration): ≈ 0.92 at s = 0.8, ≈ 0.99 at s = 0.85,
≈ 0.05 at s = 0.5. Keeper of a cluster = the lowest doc_id.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

import numpy as np

_NORM_PUNCT = re.compile(r"[^\w\s]", re.U)
_SPACES = re.compile(r"\s+")
_MASK32 = np.uint64(0xFFFFFFFF)


def normalize(text: str) -> str:
    """Lower-case, punctuation removed, whitespace collapsed (the text both dedups compare)."""
    return _SPACES.sub(" ", _NORM_PUNCT.sub(" ", text.lower())).strip()


@dataclass(frozen=True)
class ExactDedup:
    """Drop documents whose normalised text equals an earlier (lower doc_id) document's."""

    name: str = "exact_dedup"

    def keys(self, texts: list[str]) -> list[str]:
        return [hashlib.sha1(normalize(t).encode()).hexdigest() for t in texts]


@dataclass(frozen=True)
class MinHashDedup:
    """Fuzzy dedup with MinHash-LSH: `ngram`-word shingles, `num_bands` × `rows_per_band` hashes."""

    ngram: int = 5
    num_bands: int = 14
    rows_per_band: int = 8
    seed: int = 1
    num_shards: int = 2  # union-find actors the band keys are sharded over
    name: str = "minhash_dedup"

    @property
    def num_perm(self) -> int:
        return self.num_bands * self.rows_per_band

    def _params(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(1, 2**63, size=self.num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
        b = rng.integers(0, 2**63, size=self.num_perm, dtype=np.uint64)
        band_mix = rng.integers(1, 2**63, size=self.rows_per_band, dtype=np.uint64) | np.uint64(1)
        return a, b, band_mix

    def shingles(self, text: str) -> np.ndarray:
        """uint64 hashes of the word n-grams of the normalised text (one per distinct shingle)."""
        words = normalize(text).split()
        if not words:
            return np.zeros(0, dtype=np.uint64)
        wh = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
        n = min(self.ngram, len(words))
        # polynomial combination of n consecutive word hashes, vectorised (wraps mod 2^64)
        acc = np.zeros(len(words) - n + 1, dtype=np.uint64)
        for i in range(n):
            acc = acc * np.uint64(1_000_003) + wh[i:len(words) - n + 1 + i]
        return np.unique(acc)

    def signatures(self, texts: list[str], chunk_shingles: int = 1 << 16) -> np.ndarray:
        """(N, num_perm) uint32 MinHash signatures; multiply-shift hashing h(x) = (a·x + b) >> 32.

        Vectorised over documents: the shingles of a chunk of documents are hashed as one
        (S, num_perm) matrix and reduced per document with `np.minimum.reduceat`; `chunk_shingles`
        bounds S (memory ≈ S × num_perm × 8 bytes)."""
        a, b, _ = self._params()
        out = np.full((len(texts), self.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
        sets = [self.shingles(t) for t in texts]
        docs = [i for i, sh in enumerate(sets) if len(sh)]  # empty documents keep the all-max signature
        start = 0
        while start < len(docs):
            stop, total = start, 0
            while stop < len(docs) and (stop == start or total + len(sets[docs[stop]]) <= chunk_shingles):
                total += len(sets[docs[stop]])
                stop += 1
            chunk = docs[start:stop]
            sh = np.concatenate([sets[i] for i in chunk])                              # (S,)
            offsets = np.cumsum([0] + [len(sets[i]) for i in chunk[:-1]])              # first row of each doc
            with np.errstate(over="ignore"):
                hv = np.multiply.outer(a, sh)                                          # (num_perm, S)
                hv += b[:, None]
                hv >>= np.uint64(32)
            # rows are contiguous in S, so the per-document minimum runs along memory
            out[chunk] = np.minimum.reduceat(hv, offsets, axis=1).T.astype(np.uint32)  # (docs, num_perm)
            start = stop
        return out

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """(N, num_bands) uint64 bucket keys: each band's r values mixed into one integer."""
        _, _, mix = self._params()
        bands = sigs.astype(np.uint64).reshape(len(sigs), self.num_bands, self.rows_per_band)
        with np.errstate(over="ignore"):
            keys = (bands * mix[None, None, :]).sum(axis=2, dtype=np.uint64)
        return keys ^ np.arange(self.num_bands, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)


class UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        p = self.parent.setdefault(x, x)
        while p != self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        self.parent[x] = p
        return p

    def union(self, x, y) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:
            lo, hi = (rx, ry) if rx < ry else (ry, rx)
            self.parent[hi] = lo  # the root is always the lowest id: the keeper


class BucketShard:
    """One shard of the LSH buckets (a Ray actor in `clean`): band key → first (lowest) document
    seen, emitting an edge for every later document in the same bucket. Calls from one caller run
    in order and documents arrive in increasing order, so the first holder is the lowest."""

    def __init__(self):
        self.first: dict[int, int] = {}

    def add(self, keys: np.ndarray, docs: np.ndarray) -> np.ndarray:
        """(M, 2) int64 edges (earlier doc, later doc) for keys already held."""
        first, edges = self.first, []
        for key, doc in zip(keys.tolist(), docs.tolist()):
            prev = first.setdefault(key, doc)
            if prev != doc:
                edges.append((prev, doc))
        return np.asarray(edges, dtype=np.int64).reshape(-1, 2)
