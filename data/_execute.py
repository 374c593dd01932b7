"""Batch functions that run inside the Ray Data workers of `clean`."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypai.data.ops.base import AnnotatingFilter, Filter, Mapper
from raypai.data.ops.dedup import ExactDedup, MinHashDedup

# Per-op worker seconds travel with the rows (no counter actor, one process fewer): each row of a
# batch carries its share, batch seconds / rows, so summing a shard's column gives the shard's time.
SECONDS_COLUMN = "op_seconds"


def clean_shards(batch: pa.Table, raw_dir: str, batch_size: int, **row_ops_kwargs):
    """Read each shard named in `batch["shard"]`, tag its rows with the shard name and run
    `apply_row_ops` over it `batch_size` rows at a time, yielding each result.

    One Ray Data task per shard, on purpose: reading in a separate `map_batches` gets fused with
    the row ops, and the fused task then bundles input rows up to the row ops' batch size — all the
    one-row shard names in one task, on one core, with nothing back until every shard is done.
    (Listing shards with `from_items` and reading them here also starts in milliseconds, where
    `read_parquet` spends seconds on metadata tasks before the first row.)"""
    for name in batch.column("shard").to_pylist():
        table = pq.read_table(f"{raw_dir}/{name}")
        table = table.append_column("shard", pa.array([name] * table.num_rows, pa.string()))
        for start in range(0, table.num_rows, batch_size):
            yield apply_row_ops(table.slice(start, batch_size), **row_ops_kwargs)


def apply_row_ops(batch: pa.Table, ops: list[Mapper | Filter],
                  dedup_ops: list[ExactDedup | MinHashDedup]) -> pa.Table:
    """Run mappers and filters over one batch, then compute the dedup keys of the surviving rows.

    Rows a filter rejects stay in the batch, marked with the op, the reason and the stat value (the
    first op that rejects a row owns it). Dedup keys are computed here, in parallel and once per
    shard (so a resumed run keeps them); the driver only merges them: `key.exact_dedup` (string)
    and `key.minhash_dedup` (fixed-size list of num_perm uint32 MinHash values; zeros on dropped rows)."""
    texts = batch.column("text").to_pylist()
    n = len(texts)
    alive = np.ones(n, dtype=bool)
    drop_op = [None] * n
    drop_reason = [None] * n
    drop_stat = np.full(n, np.nan)
    extra: dict[str, pa.Array] = {}
    secs = []
    for op in ops:
        t0 = time.perf_counter()
        idx = np.flatnonzero(alive)
        sub = [texts[i] for i in idx]
        if isinstance(op, Mapper):
            for i, t in zip(idx, op.map_texts(sub)):
                texts[i] = t
        else:
            if isinstance(op, AnnotatingFilter):
                ann = op.annotate(sub)
                stats = op.stats(sub, ann)
            else:
                ann, stats = {}, op.stats(sub)
            col = np.full(n, np.nan)
            col[idx] = stats
            extra[f"stats.{op.name}"] = pa.array(col)
            for k, vals in ann.items():
                full = [None] * n
                for i, v in zip(idx, vals):
                    full[i] = v
                extra[k] = pa.array(full)
            keep = op.keep(stats)
            for i, s in zip(idx[~keep], stats[~keep]):
                alive[i] = False
                drop_op[i] = op.name
                drop_stat[i] = s
                drop_reason[i] = f"{op.name}={s:.4g} fails {_bounds(op)}"
        secs.append(time.perf_counter() - t0)
    idx = np.flatnonzero(alive)
    sub = [texts[i] for i in idx]
    for op in dedup_ops:
        t0 = time.perf_counter()
        if isinstance(op, ExactDedup):
            keys = [None] * n
            for i, k in zip(idx, op.keys(sub)):
                keys[i] = k
            extra[f"key.{op.name}"] = pa.array(keys, pa.string())
        else:
            sigs = np.zeros((n, op.num_perm), dtype=np.uint32)  # (N, num_perm)
            sigs[idx] = op.signatures(sub)
            extra[f"key.{op.name}"] = pa.FixedSizeListArray.from_arrays(pa.array(sigs.reshape(-1)), op.num_perm)
        secs.append(time.perf_counter() - t0)
    share = np.tile(np.asarray(secs) / max(n, 1), n)  # (N · n_ops,) each row's share of the batch's op time
    out = batch.set_column(batch.column_names.index("text"), "text", pa.array(texts, pa.string()))
    out = out.append_column("drop_op", pa.array(drop_op, pa.string()))
    out = out.append_column("drop_reason", pa.array(drop_reason, pa.string()))
    out = out.append_column("drop_stat", pa.array(drop_stat, pa.float64()))
    for k, v in extra.items():
        out = out.append_column(k, v)
    return out.append_column(SECONDS_COLUMN, pa.FixedSizeListArray.from_arrays(pa.array(share), len(secs)))


def _bounds(op) -> str:
    lo, hi = getattr(op, "min_value", None), getattr(op, "max_value", None)
    if hasattr(op, "min_score"):
        return f"min_score={op.min_score} for {list(op.languages)}"
    if lo is not None and hi is not None:
        return f"[{lo}, {hi}]"
    if hi is not None:
        return f"≤ {hi}"
    return "its rules (0 failed rules required)"
