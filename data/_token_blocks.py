"""The tasks of `raypai.data.tokenizer.tokenize`: each reads and writes files, so a worker holds one
batch of texts, one token stream slice or one shard's blocks, and the driver only counters.

The token stream is every document's ids followed by EOS, documents in dataset order. Task i of
round 1 writes its part of the stream to `unit-<i>.i32` (raw int32); with the token counts the
driver knows where each part starts (`Streams.starts`), so block b = stream tokens
[b·T, (b+1)·T) can be read back from whichever files hold them, by any task.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

HELD_OUT = "held_out.npy"  # sorted ids of the eval blocks, written by `hold_out`
ENCODE_BATCH = 512  # texts per tokenizer call


@dataclass(frozen=True)
class RowGroups:
    """Row groups of one Parquet file, in file order: a sample unit or one tokenize task's input."""

    path: str
    groups: tuple[int, ...]
    rows: int
    text_bytes: int  # uncompressed size of the text column chunks (footer figure)


def texts(unit: RowGroups, batch_size: int = 1024):
    """The non-empty texts of `unit`, in order, read a batch at a time."""
    f = pq.ParquetFile(unit.path)
    for batch in f.iter_batches(columns=["text"], row_groups=list(unit.groups), batch_size=batch_size):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _worker() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


def _unit_file(folder: str, i: int) -> Path:
    return Path(folder) / f"unit-{i:06d}.i32"


def tokenize_unit(i: int, unit: RowGroups, tokenizer_dir: str, eos: int, folder: str) -> tuple[int, int, tuple]:
    """Round 1: encode `unit`'s texts, each followed by EOS, into `unit-<i>.i32`.
    Returns (tokens written, documents, worker)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    n_tokens = n_docs = 0
    batch: list[str] = []
    with open(_unit_file(folder, i), "wb") as f:

        def flush():
            ids = tok(batch, add_special_tokens=False)["input_ids"]
            flat = np.fromiter(chain.from_iterable(x + [eos] for x in ids), dtype=np.int32)
            f.write(flat.tobytes())
            batch.clear()
            return flat.size

        for text in texts(unit):
            batch.append(text)
            n_docs += 1
            if len(batch) == ENCODE_BATCH:
                n_tokens += flush()
        if batch:
            n_tokens += flush()
    return n_tokens, n_docs, _worker()


def hold_out(n_blocks: int, n_eval: int, seed: int, folder: str) -> None:
    """Round 2: the eval blocks are the first `n_eval` of `default_rng(seed).permutation(n_blocks)`;
    saved sorted. The one step holding O(n_blocks) memory (4 bytes a block: an int32 arange shuffles
    with the same swaps as `permutation(n)`)."""
    dtype = np.int32 if n_blocks < 2**31 else np.int64
    order = np.random.default_rng(seed).permutation(np.arange(n_blocks, dtype=dtype))
    np.save(Path(folder) / HELD_OUT, np.sort(order[:n_eval]).astype(np.int64))


@dataclass(frozen=True)
class Streams:
    """Round 1's output: `folder` with `unit-<i>.i32`; `starts` (units + 1,) the stream offset of
    each unit's first token, `starts[-1]` the total."""

    folder: str
    starts: np.ndarray

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def tokens(self, lo: int, hi: int, maps: dict) -> np.ndarray:
        """Stream tokens [lo, hi) (hi - lo,) int32, from the unit files holding them (memory-mapped
        once per call site through `maps`)."""
        out = np.empty(hi - lo, dtype=np.int32)
        pos, u = lo, int(np.searchsorted(self.starts, lo, side="right")) - 1
        while pos < hi:
            start, end = int(self.starts[u]), int(self.starts[u + 1])
            take = min(hi, end) - pos
            if take > 0:  # an empty unit has no file content to map
                if u not in maps:
                    maps[u] = np.memmap(_unit_file(self.folder, u), dtype=np.int32, mode="r")
                out[pos - lo : pos - lo + take] = maps[u][pos - start : pos - start + take]
                pos += take
            u += 1
        return out

    def blocks(self, ids: np.ndarray, block_size: int) -> np.ndarray:
        """Blocks `ids` (sorted ascending) as (n, block_size) int32; each run of consecutive ids is
        one read."""
        out = np.empty((len(ids), block_size), dtype=np.int32)
        maps: dict = {}
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(ids)]])):
            lo, hi = int(ids[a]) * block_size, (int(ids[b - 1]) + 1) * block_size
            out[a:b] = self.tokens(lo, hi, maps).reshape(b - a, block_size)
        return out


def block_ids(split: str, first: int, count: int, folder: str) -> np.ndarray:
    """Ids of the `split` blocks ranked first … first + count - 1 (ascending), from the held-out ids:
    eval blocks are read off directly; the train block of rank r is r + #{eval ids before it}, and
    eval id j has E[j] - j train blocks before it, so that count is #{j : E[j] - j ≤ r}."""
    held = np.load(Path(folder) / HELD_OUT, mmap_mode="r")
    if split == "eval":
        return np.array(held[first : first + count], dtype=np.int64)
    ranks = np.arange(first, first + count, dtype=np.int64)
    return ranks + np.searchsorted(held - np.arange(len(held)), ranks, side="right")


def write_shard(
    path: str, split: str, first: int, count: int, streams: Streams, block_size: int, vocab: int
) -> tuple[np.ndarray | None, tuple]:
    """Round 3: one shard file of `count` blocks. Returns the train blocks' token counts (vocab,)
    (None for eval) and the worker."""
    from raypai.train.data import write_shard as write_parquet

    ids = block_ids(split, first, count, streams.folder)
    toks = streams.blocks(ids, block_size)
    write_parquet(path, ids, toks)  # row groups sized for block-level reads
    unigram = np.bincount(toks.reshape(-1), minlength=vocab) if split == "train" else None
    return unigram, _worker()


def content_digest(streams: Streams, n_tokens: int, chunk: int = 1 << 22) -> str:
    """sha256 of every block's int32 bytes in block-id order = of the stream's first `n_tokens`
    tokens (sequential by nature: one task reads the whole token set once)."""
    h, maps = hashlib.sha256(), {}
    for lo in range(0, n_tokens, chunk):
        h.update(streams.tokens(lo, min(n_tokens, lo + chunk), maps).tobytes())
    return h.hexdigest()
