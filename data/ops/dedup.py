"""Deduplication: exact (normalised-text hash) and fuzzy, verified MinHash-LSH.

`MinHashDedup` finds pairs of documents whose word-n-gram Jaccard similarity is ≥ `threshold`
(default 0.8): LSH candidates (bands × rows chosen so that a pair at the threshold becomes a
candidate with probability ≥ 0.99, P(s) = 1 − (1 − s^r)^b, Leskovec, Rajaraman & Ullman, *Mining of
Massive Datasets* §3.4.2), each candidate verified (signature estimate; exact shingle Jaccard near
the threshold), then union-find over the verified pairs only. Keeper of a cluster = the lowest
doc_id. The array maths is in `raypai.data.ops.minhash`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from raypai.data.ops import minhash as mh

_NORM_PUNCT = re.compile(r"[^\w\s]", re.U)
_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lower-case, punctuation removed, whitespace collapsed (the text exact dedup compares)."""
    return _SPACES.sub(" ", _NORM_PUNCT.sub(" ", text.lower())).strip()


@dataclass(frozen=True)
class ExactDedup:
    """Drop documents whose normalised text equals an earlier (lower doc_id) document's."""

    name: str = "exact_dedup"

    def keys(self, texts: list[str]) -> list[str]:
        return [hashlib.sha1(normalize(t).encode()).hexdigest() for t in texts]


@dataclass(frozen=True)
class Duplicates:
    """The outcome of near-duplicate detection over N documents (row numbers, lowest kept)."""

    keeper: np.ndarray  # (N,) int64: the row kept for each row's cluster (itself when kept)
    partner: np.ndarray  # (N,) int64: for a dropped row, the row of its best verified pair; -1 otherwise
    similarity: np.ndarray  # (N,) float: that pair's verified Jaccard (NaN for kept rows)
    exact: np.ndarray  # (N,) bool: the similarity is the exact shingle Jaccard (else the estimate)
    candidates: int  # LSH candidate pairs
    verified: int  # of which passed verification

    @property
    def dropped(self) -> np.ndarray:
        return np.flatnonzero(self.keeper != np.arange(len(self.keeper)))


@dataclass(frozen=True)
class MinHashDedup:
    """Verified near-duplicate removal: word `ngram` shingles, `num_perm` MinHash values, LSH with
    `num_bands` × `rows_per_band` (0 and 0: chosen for `threshold`), verification of every candidate.

    `verify_margin`: candidates whose signature estimate lies within it of `threshold` are decided
    by the exact shingle Jaccard. `fanout`: a document pairs with at most that many earlier members
    of each LSH bucket."""

    threshold: float = 0.8
    ngram: int = 5
    num_perm: int = 128
    num_bands: int = 0
    rows_per_band: int = 0
    verify_margin: float = 0.15
    fanout: int = 4
    seed: int = 1
    name: str = "minhash_dedup"

    def __post_init__(self):
        problems = []
        if not 0 < self.threshold <= 1:
            problems.append(f"threshold must be in (0, 1] (got {self.threshold})")
        if self.ngram < 1 or self.num_perm < 1 or self.fanout < 1:
            problems.append(
                f"ngram, num_perm and fanout must be ≥ 1 (got {self.ngram}, {self.num_perm}, {self.fanout})"
            )
        if (self.num_bands > 0) != (self.rows_per_band > 0):
            problems.append("give both num_bands and rows_per_band, or neither (they are then chosen for threshold)")
        elif self.num_bands * self.rows_per_band > self.num_perm:
            problems.append(
                f"num_bands × rows_per_band = {self.num_bands * self.rows_per_band} exceeds num_perm "
                f"{self.num_perm}; raise num_perm or use fewer bands"
            )
        if problems:
            raise ValueError("; ".join(problems))
        if not self.num_bands:
            bands, rows = mh.choose_bands(self.threshold, self.num_perm)
            object.__setattr__(self, "num_bands", bands)
            object.__setattr__(self, "rows_per_band", rows)

    @property
    def lsh_recall(self) -> float:
        """Probability that a pair at exactly `threshold` becomes an LSH candidate."""
        return mh.lsh_probability(self.threshold, self.num_bands, self.rows_per_band)

    def shingles(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """(hashes, offsets) of the texts' word n-grams (see `minhash.shingle_hashes`)."""
        return mh.shingle_hashes(texts, self.ngram)

    def signatures(self, texts, batch: int = 2048) -> np.ndarray:
        """(N, num_perm) uint32 MinHash signatures; a text without words gets all-ones. `batch`
        texts are shingled at once (their word and shingle arrays are the peak memory)."""
        a, b = mh.hash_params(self.num_perm, self.seed)
        out = np.empty((len(texts), self.num_perm), dtype=np.uint32)
        for lo in range(0, len(texts), batch):
            out[lo : lo + batch] = mh.signatures(*self.shingles(texts[lo : lo + batch]), a, b)
        return out

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """(N, num_bands) uint64 LSH bucket keys."""
        return mh.band_keys(sigs, self.num_bands, self.rows_per_band, self.seed)

    def find(self, texts, sigs: np.ndarray | None = None) -> Duplicates:
        """Near-duplicate clusters of `texts` (row order = priority: the lowest row keeps).
        `sigs`, if given, must be `signatures(texts)` (computed elsewhere, e.g. in Ray workers)."""
        sigs = self.signatures(texts) if sigs is None else sigs
        n = len(sigs)
        valid = (sigs != np.iinfo(np.uint32).max).any(axis=1)  # texts without shingles are nobody's duplicate
        cand = mh.candidate_pairs(self.band_keys(sigs), valid, self.fanout)

        def exact(pairs: np.ndarray) -> np.ndarray:
            rows, local = np.unique(pairs, return_inverse=True)
            sub = (
                texts.take(pa.array(rows))
                if isinstance(texts, pa.Array | pa.ChunkedArray)
                else [texts[i] for i in rows.tolist()]
            )
            h, off = self.shingles(sub)
            return mh.exact_jaccard(h, off, local.reshape(-1, 2))

        ok, sim, was_exact = mh.verify(cand, sigs, self.threshold, self.verify_margin, exact)
        edges, sim, was_exact = cand[ok], sim[ok], was_exact[ok]
        uf = UnionFind()
        for i, j in edges.tolist():
            uf.union(i, j)
        keeper = np.arange(n)
        for i in list(uf.parent):
            keeper[i] = uf.find(i)
        # each dropped row's best verified pair (either end of an edge)
        partner, best, ex = np.full(n, -1), np.full(n, np.nan), np.zeros(n, dtype=bool)
        order = np.argsort(-sim, kind="stable")  # verified edges, most similar first
        for col in (0, 1):
            rows, first = np.unique(edges[order, col], return_index=True)  # each row's best edge at this end
            pick = order[first]
            better = ~(best[rows] >= sim[pick])  # unset (NaN) or less similar
            rows, pick = rows[better], pick[better]
            partner[rows], best[rows], ex[rows] = edges[pick, 1 - col], sim[pick], was_exact[pick]
        kept = keeper == np.arange(n)
        partner[kept], best[kept], ex[kept] = -1, np.nan, False
        return Duplicates(keeper, partner, best, ex, len(cand), len(edges))


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
