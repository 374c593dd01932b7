"""Token shards on disk → blocks in memory, and the deterministic order workers read them in.

Exact resume needs a data order that is a pure function of (seed, step, rank), so we follow
Megatron-LM's indexed dataset (Shoeybi et al. 2019; `megatron/core/datasets/gpt_dataset.py`'s
shuffle index): random access into fixed-length blocks through a per-epoch permutation. The
checkpointed data position is then just the next step. Streaming splits (Ray Data's
`streaming_split`) hand blocks to whichever worker asks first, so their order is not
reproducible across a restart; see docs/train.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raypai.errors import TrainError

SPLITS = ("train", "eval")


def read_manifest(shards_dir: str | Path) -> dict:
    """The token-shards manifest, with the number of blocks per split counted from Parquet footers."""
    shards_dir = Path(shards_dir)
    path = shards_dir / "manifest.json"
    if not path.exists():
        raise TrainError(f"{shards_dir} is not a token-shards artifact (no manifest.json); run the tokenize step "
                         "(raypai.data) or pass the token_shards folder")
    manifest = json.loads(path.read_text())
    missing = [k for k in ("vocab_size", "block_size", "files") if k not in manifest]
    if missing:
        raise TrainError(f"{path} lacks {', '.join(missing)}; re-run the tokenize step to rewrite the shards")
    for split in SPLITS:
        files = [shards_dir / f["file"] for f in manifest["files"] if f.get("split", "train") == split]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise TrainError(f"{shards_dir}: shard files listed in manifest.json are missing: {', '.join(absent)}")
        n = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        if n == 0:
            raise TrainError(f"{shards_dir} has no {split} blocks (empty token shards); clean and tokenize more "
                             "text, or lower the tokenizer's eval fraction")
        manifest[f"_{split}_blocks"] = n
    return manifest


def load_blocks(shards_dir: str | Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """(block_ids (N,), tokens (N, T) int32) of one split, in manifest order."""
    shards_dir = Path(shards_dir)
    manifest = json.loads((shards_dir / "manifest.json").read_text())
    block = manifest["block_size"]
    ids, toks = [], []
    for f in manifest["files"]:
        if f.get("split", "train") != split:
            continue
        t = pq.read_table(shards_dir / f["file"], columns=["block_id", "input_ids"])
        ids.append(t.column("block_id").to_numpy())
        flat = t.column("input_ids").combine_chunks().flatten().to_numpy()  # (N·T,) without Python lists
        if flat.size != t.num_rows * block:
            raise TrainError(f"{shards_dir / f['file']}: input_ids rows are not all {block} tokens long; "
                             "token shards must hold fixed-length blocks")
        toks.append(flat.astype(np.int32).reshape(-1, block))
    return np.concatenate(ids), np.concatenate(toks)


class BlockOrder:
    """Global sample i → block: epoch e = i // N reads permutation(seed + e). Worker r of W at step
    s, micro-step m takes samples s·G + m·(W·b) + r·b … + b − 1, with G = W·b·accum. The order of
    every worker is fixed by (seed, step, rank) alone, whatever happened before."""

    def __init__(self, n_blocks: int, seed: int):
        self.n, self.seed = n_blocks, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng(self.seed + epoch).permutation(self.n)}
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int, world: int, micro_batch: int, accum: int) -> np.ndarray:
        start = step * world * micro_batch * accum + micro * world * micro_batch + rank * micro_batch
        out = np.empty(micro_batch, dtype=np.int64)
        for j in range(micro_batch):
            i = start + j
            out[j] = self._perm(i // self.n)[i % self.n]
        return out
