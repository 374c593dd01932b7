"""Synthetic token shards in the raypai.data format, for tests, benchmarks and fault drills.

python -c "from raypai.train.synthetic import write_token_shards; write_token_shards('shards/')"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raypai.token_shards import ShardFile, TokenShardsManifest
from raypai.train.data import write_shard


def write_token_shards(
    folder: str | Path,
    *,
    vocab: int = 64,
    block: int = 32,
    blocks: int = 256,
    eval_fraction: float = 0.125,
    noise: float = 0.1,
    seed: int = 0,
    shard_blocks: int = 1 << 16,
) -> dict:
    """A noisy deterministic "language": the next token is (3·t + 1) mod V with probability
    1 − noise, else uniform. Its unigram entropy is ≈ log V, but a model that learns the rule reaches
    about noise·log V + H(noise) nats. Blocks 0 … n_eval − 1 are the eval split. Written
    `shard_blocks` blocks at a time (memory stays bounded for token sets of any size) into
    shard-*.parquet (train) and eval-*.parquet, plus manifest.json."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_eval = max(1, int(blocks * eval_fraction))
    files = {"train": [], "eval": []}
    counts = np.zeros(vocab, dtype=np.int64)
    for lo in range(0, blocks, shard_blocks):
        n = min(shard_blocks, blocks - lo)
        seqs = np.empty((n, block), dtype=np.int32)  # (n, T)
        t = rng.integers(2, vocab, size=n)
        for i in range(block):  # all blocks advance together: (n,) per position
            seqs[:, i] = t
            follow = rng.random(n) >= noise
            t = np.where(follow, (3 * t + 1) % vocab, rng.integers(2, vocab, size=n))
        ids = np.arange(lo, lo + n)
        for split, keep in (("eval", ids < n_eval), ("train", ids >= n_eval)):
            if not keep.any():
                continue
            name = f"{'shard' if split == 'train' else 'eval'}-{len(files[split]):05d}.parquet"
            write_shard(folder / name, ids[keep], seqs[keep])
            files[split].append(ShardFile(name, split, int(keep.sum())))
        counts += np.bincount(seqs[ids >= n_eval].reshape(-1), minlength=vocab)
    p = counts[counts > 0] / counts.sum()
    manifest = TokenShardsManifest(
        block_size=block,
        vocab_size=vocab,
        files=(*files["train"], *files["eval"]),
        num_blocks=blocks - n_eval,
        num_eval_blocks=n_eval,
        num_tokens=(blocks - n_eval) * block,
        eos_id=0,
        tokenizer_digest="synthetic",
        unigram_entropy_nats=float(-(p * np.log(p)).sum()),
    )
    manifest.write(folder)
    return manifest.to_dict()
