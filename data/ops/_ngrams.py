"""Vectorised n-gram counting shared by the repetition filters.

Words become integer ids, consecutive ids are folded into one uint64 per n-gram with a polynomial
hash (mod 2^64; two distinct n-grams collide with probability ~2^-64), and `np.unique` over a whole
batch counts them — the C-speed equivalent of `Counter(tuple(w[i:i+n]) ...)` per document.
"""

from __future__ import annotations

import numpy as np

_P = np.uint64(1_000_003)


def token_ids(tokens: list[str]) -> np.ndarray:
    """(T,) uint64 ids, equal for equal tokens. Python's string hash (64-bit, computed in C and
    cached on the string) is enough: ids only need to agree within this call, in this process."""
    return np.fromiter(map(hash, tokens), dtype=np.int64, count=len(tokens)).view(np.uint64)


class BatchNgrams:
    """Word n-gram keys of a whole batch of documents at once (one `np.unique` per n for the batch
    instead of one per document: the per-call cost of numpy dominates ~200-word documents).

    Every document's ids are salted, so equal n-grams of different documents get different keys.
    `keys(n)` must be called with increasing n: the hash of the n-gram at i is rolled from the
    (n-1)-gram's, h_n[i] = h_{n-1}[i]·P + id[i+n-1] + 1."""

    def __init__(self, ids: np.ndarray, doc_lengths: np.ndarray):
        self.ids = ids  # (W,) all words of the batch
        self.doc = np.repeat(np.arange(len(doc_lengths)), doc_lengths)  # (W,) document of each word
        self.ends = np.cumsum(doc_lengths)  # (D,) one past each doc's last word
        self.starts = self.ends - doc_lengths
        salt = (self.doc.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            self._h = salt * _P + ids + np.uint64(1)
        self._n = 1

    def keys(self, n: int, where: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(keys, positions) of the n-grams that lie inside one document, restricted to the
        sorted global word positions `where` if given."""
        with np.errstate(over="ignore"):
            while self._n < n:
                self._h = self._h[:-1] * _P + self.ids[self._n :] + np.uint64(1)
                self._n += 1
        pos = np.arange(len(self._h)) if where is None else where[where < len(self._h)]
        pos = pos[pos + n <= self.ends[self.doc[pos]]]
        return self._h[pos], pos


def group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first index of each element's key, occurrence count of each element's key, inverse) for (M,) keys."""
    _, first, inv, cnt = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    return first[inv], cnt[inv], inv
