"""Synthetic token shards in the raypai.data format, for tests, benchmarks and fault drills.

    python -c "from raypai.train.synthetic import write_token_shards; write_token_shards('shards/')"
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_token_shards(folder: str | Path, *, vocab: int = 64, block: int = 32, blocks: int = 256,
                       eval_fraction: float = 0.125, noise: float = 0.1, seed: int = 0) -> dict:
    """A noisy deterministic "language": the next token is (3·t + 1) mod V with probability
    1 − noise, else uniform. Its unigram entropy is ≈ log V, but a model that learns the rule reaches
    about noise·log V + H(noise) nats. Writes manifest.json, shard-00000.parquet, eval-00000.parquet."""
    rng = np.random.default_rng(seed)
    seqs = np.empty((blocks, block), dtype=np.int32)
    t = rng.integers(2, vocab, size=blocks)
    for i in range(block):  # all blocks advance together: (blocks,) per position
        seqs[:, i] = t
        follow = rng.random(blocks) >= noise
        t = np.where(follow, (3 * t + 1) % vocab, rng.integers(2, vocab, size=blocks))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_eval = max(1, int(blocks * eval_fraction))
    files = []
    for name, sl, split in (("shard-00000.parquet", slice(n_eval, None), "train"),
                            ("eval-00000.parquet", slice(0, n_eval), "eval")):
        chunk = seqs[sl]
        ids = np.arange(blocks)[sl]
        arr = pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), block).cast(pa.list_(pa.int32()))
        pq.write_table(pa.table({"block_id": ids, "input_ids": arr}), folder / name)
        files.append({"file": name, "split": split, "blocks": len(chunk)})
    counts = np.bincount(seqs[n_eval:].reshape(-1), minlength=vocab).astype(float)
    p = counts[counts > 0] / counts.sum()
    manifest = {"kind": "token_shards", "block_size": block, "num_blocks": blocks - n_eval, "num_eval_blocks": n_eval,
                "num_tokens": (blocks - n_eval) * block, "vocab_size": vocab, "eos_id": 0,
                "tokenizer_digest": "synthetic", "files": files, "unigram_entropy_nats": float(-(p * np.log(p)).sum())}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest
