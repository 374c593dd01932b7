"""Token shards on disk, read block by block, and the deterministic order workers read them in.

Exact resume needs a data order that is a pure function of (seed, step, rank), so we follow
Megatron-LM's indexed dataset (Shoeybi et al. 2019; `megatron/core/datasets/gpt_dataset.py`'s
shuffle index): random access into fixed-length blocks through a per-epoch permutation. The
checkpointed data position is then just the next step. Streaming splits (Ray Data's
`streaming_split`) hand blocks to whichever worker asks first, so their order is not
reproducible across a restart; see docs/train.md.

Random access comes from Parquet's row groups: a shard file is written in row groups of about
`ROW_GROUP_TOKENS` tokens (`write_shard`), the footers say how many blocks each group holds, and
a worker decodes only the groups that hold the blocks it needs (`TokenShards`), so memory stays
bounded by a few row groups whatever the size of the token set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raypai.errors import ConfigError, TrainError
from raypai.token_shards import MANIFEST, SPLITS, TokenShardsManifest
from raypai.train._fs import read_json, resolve

COLUMNS = ["block_id", "input_ids"]
# 16Ki tokens (64 KiB of int32) per row group: a block read decodes its whole group, so groups stay
# small, while the footer stays small too (one entry per group; benchmarks/history/asides.md).
ROW_GROUP_TOKENS = 1 << 14
OPEN_FILES = 16  # shard files a reader keeps open (a footer and a handle each)


def write_shard(path: str | Path, block_ids: np.ndarray, tokens: np.ndarray) -> None:
    """One shard file: `block_id` (N,) int64 and `input_ids` (N, T) int32 as list<int32>, in
    row groups of about `ROW_GROUP_TOKENS` tokens (what makes block-level reads cheap)."""
    n, block = tokens.shape
    arr = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(tokens, np.int32).reshape(-1)), block)
    table = pa.table(
        {"block_id": pa.array(np.asarray(block_ids), pa.int64()), "input_ids": arr.cast(pa.list_(pa.int32()))}
    )
    pq.write_table(table, path, row_group_size=max(1, ROW_GROUP_TOKENS // block))


def _load(fs, root: str, shards_dir) -> TokenShardsManifest:
    raw = read_json(fs, f"{root}/{MANIFEST}")
    if raw is None:
        raise TrainError(
            f"{shards_dir} is not a token-shards artifact (no {MANIFEST}); run the tokenize step "
            "(raypai.data) or pass the token_shards folder"
        )
    try:
        return TokenShardsManifest.from_dict(raw)
    except ConfigError as err:
        raise TrainError(
            f"{shards_dir}/{MANIFEST} is not a valid token-shards manifest:\n"
            + "\n".join(f"  - {p}" for p in err.problems)
            + "\nre-run the tokenize step to rewrite the shards"
        ) from None


def read_manifest(shards_dir: str | Path) -> TokenShardsManifest:
    """The token-shards manifest, its block counts (`num_blocks`, `num_eval_blocks`) counted from the
    Parquet footers rather than trusted. `shards_dir`: a local folder or a URI (`s3://...`)."""
    fs, root = resolve(shards_dir)
    manifest = _load(fs, root, shards_dir)
    counts = {}
    for split in SPLITS:
        names = manifest.files_of(split)
        infos = fs.get_file_info([f"{root}/{n}" for n in names])
        absent = [f"{shards_dir}/{n}" for n, i in zip(names, infos) if i.type != pafs.FileType.File]
        if absent:
            raise TrainError(f"{shards_dir}: shard files listed in manifest.json are missing: {', '.join(absent)}")
        n = 0
        for name in names:
            with fs.open_input_file(f"{root}/{name}") as f:
                meta = pq.read_metadata(f)
            lacking = [c for c in COLUMNS if c not in meta.schema.to_arrow_schema().names]
            if lacking:
                raise TrainError(
                    f"{shards_dir}/{name} has no {', '.join(lacking)} column; token shards hold "
                    "block_id and input_ids (re-run the tokenize step)"
                )
            n += meta.num_rows
        if n == 0:
            raise TrainError(
                f"{shards_dir} has no {split} blocks (empty token shards); clean and tokenize more "
                "text, or lower the tokenizer's eval fraction"
            )
        counts[split] = n
    return replace(manifest, num_blocks=counts["train"], num_eval_blocks=counts["eval"])


class TokenShards:
    """Random access to the blocks of one split, in manifest order (global index i = i-th row of
    the split's files concatenated), read from the shard files on demand.

    Opening reads only the footers. `take(idx)` decodes the row groups holding the requested
    blocks; the last `cache_groups` decoded groups are kept (a least-recently-used cache), so the
    memory held is at most `cache_groups` row groups. Picklable: a worker gets the location and
    opens the files itself. Not thread-safe; `Prefetcher` calls it from one thread at a time."""

    def __init__(self, shards_dir: str | Path, split: str = "train", *, cache_groups: int = 8):
        self.location, self.split, self.cache_groups = str(shards_dir), split, cache_groups
        self._open()

    def _open(self) -> None:
        self._fs, root = resolve(self.location)
        manifest = _load(self._fs, root, self.location)
        self.block_size = manifest.block_size
        self._files, self._meta, starts, groups = [], [], [], []
        offset = 0
        for name in manifest.files_of(self.split):
            path = f"{root}/{name}"
            with self._fs.open_input_file(path) as fh:
                meta = pq.read_metadata(fh)
            self._files.append(path)
            self._meta.append(meta)
            for g in range(meta.num_row_groups):
                starts.append(offset)
                groups.append((len(self._files) - 1, g))
                offset += meta.row_group(g).num_rows
        self._starts = np.asarray(starts, dtype=np.int64)  # (groups,) global index of each group's first block
        self._groups = groups
        self._n = offset
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._handles: OrderedDict[int, pq.ParquetFile] = OrderedDict()

    def __getstate__(self) -> dict:
        return {"location": self.location, "split": self.split, "cache_groups": self.cache_groups}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self._n

    def _file(self, fi: int) -> pq.ParquetFile:
        """Shard file `fi`, opened once while among the last `OPEN_FILES` used."""
        if fi in self._handles:
            self._handles.move_to_end(fi)
            return self._handles[fi]
        if len(self._handles) >= OPEN_FILES:
            self._handles.popitem(last=False)[1].close(force=True)
        pf = pq.ParquetFile(self._fs.open_input_file(self._files[fi]), metadata=self._meta[fi])
        self._handles[fi] = pf
        return pf

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids (n,), tokens (n, T) int32) of row group g, decoded once while cached."""
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        fi, rg = self._groups[g]
        t = self._file(fi).read_row_group(rg, columns=COLUMNS)
        flat = t.column("input_ids").combine_chunks().flatten().to_numpy()  # (n·T,) without Python lists
        if flat.size != t.num_rows * self.block_size:
            raise TrainError(
                f"{self._files[fi]}: input_ids rows are not all {self.block_size} tokens long; "
                "token shards must hold fixed-length blocks (re-run the tokenize step)"
            )
        out = (t.column("block_id").to_numpy(), flat.astype(np.int32, copy=False).reshape(-1, self.block_size))
        self._cache[g] = out
        if len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return out

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block ids (n,), tokens (n, T) int32, a fresh writable array) of the blocks at `idx`."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"block index out of range 0..{self._n - 1} in {self.location} ({self.split})")
        ids = np.empty(len(idx), dtype=np.int64)
        toks = np.empty((len(idx), self.block_size), dtype=np.int32)
        where = np.searchsorted(self._starts, idx, side="right") - 1  # (n,) row group of each index
        for g in dict.fromkeys(where.tolist()):  # each group once, in first-use order
            gids, gtoks = self._group(g)
            sel = np.nonzero(where == g)[0]
            rows = idx[sel] - self._starts[g]
            ids[sel], toks[sel] = gids[rows], gtoks[rows]
        return ids, toks


def load_blocks(shards_dir: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """(block_ids (N,), tokens (N, T) int32) of a whole split in memory, in manifest order: for
    small token sets (benchmarks' baselines, tests); training streams through `TokenShards`."""
    shards = TokenShards(shards_dir, split)
    return shards.take(np.arange(len(shards)))


class BlockOrder:
    """Global sample i → block: epoch e = i // N reads permutation(seed + e). Worker r of W at step
    s, micro-step m takes samples s·G + m·(W·b) + r·b … + b − 1, with G = W·b·accum. The order of
    every worker is fixed by (seed, step, rank) alone, whatever happened before."""

    def __init__(self, n_blocks: int, seed: int):
        self.n, self.seed = n_blocks, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # int32 below 2^31 blocks: half the memory, and the same order (shuffling an int32
            # arange draws the same swaps as `permutation(n)`)
            dtype = np.int32 if self.n < 2**31 else np.int64
            self._perms = {epoch: np.random.default_rng(self.seed + epoch).permutation(np.arange(self.n, dtype=dtype))}
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int, world: int, micro_batch: int, accum: int) -> np.ndarray:
        start = step * world * micro_batch * accum + micro * world * micro_batch + rank * micro_batch
        out = np.empty(micro_batch, dtype=np.int64)
        for j in range(micro_batch):
            i = start + j
            out[j] = self._perm(i // self.n)[i % self.n]
        return out


class Prefetcher:
    """A worker's micro-batches in training order, the next one read in a background thread while
    the current one trains (pyarrow decodes without the GIL). `get(step, micro)` returns
    (block ids (b,), tokens (b, T)) and starts reading the micro-batch after it."""

    def __init__(self, shards: TokenShards, order: BlockOrder, *, rank: int, world: int, micro_batch: int, accum: int):
        self.shards, self.order = shards, order
        self.rank, self.world, self.micro_batch, self.accum = rank, world, micro_batch, accum
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="raypai-blocks")
        self._lock = threading.Lock()  # the reader is used by one thread at a time
        self._next: tuple[tuple[int, int], object] | None = None

    def _read(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            return self.shards.take(
                self.order.indices(step, micro, self.rank, self.world, self.micro_batch, self.accum)
            )

    def get(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        if self._next is not None and self._next[0] == (step, micro):
            batch = self._next[1].result()
        else:
            if self._next is not None:
                self._next[1].result()  # let a stale read finish before reading on this thread
            batch = self._read(step, micro)
        nxt = (step, micro + 1) if micro + 1 < self.accum else (step + 1, 0)
        self._next = (nxt, self._pool.submit(self._read, *nxt))
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
