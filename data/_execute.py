"""What runs inside `clean`'s filter tasks (one plain Ray task per ingested shard): the row ops,
and the commit of each shard's results to the work folder (from the worker: the rows never travel
to the driver)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypai.data.ops.base import AnnotatingFilter, Filter, Mapper
from raypai.data.ops.dedup import ExactDedup, MinHashDedup

# Per-op worker seconds travel with the rows (no counter actor, one process fewer): each row of a
# batch carries its share, batch seconds / rows, so summing a shard's column gives the shard's time.
SECONDS_COLUMN = "op_seconds"
KEEP_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("lang", pa.string()),
        ("lang_score", pa.float64()),
    ]
)
KEEP_COLUMNS = KEEP_SCHEMA.names
DROP_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("source", pa.string()),
        ("op", pa.string()),
        ("reason", pa.string()),
        ("stat", pa.float64()),
        ("cluster_id", pa.string()),
        ("text", pa.string()),
    ]
)


def filter_shard(name: str, setup: dict) -> tuple[str, int, int]:
    """Filter one ingested shard inside a Ray task: read it, run `apply_row_ops` over it
    `setup["batch_size"]` rows at a time, commit the results to the work folder (`commit_shard`)
    and return (shard, rows, kept): counters, not rows, go back to the driver.

    `setup` (raw_dir, work, batch_size, n_ops, faults, ops, dedup_ops) is put in the object store
    once by the driver and shared by every task. A shard's results are held until its commit:
    ingest keeps parts near `block_bytes`, so that is bounded."""
    work = Path(setup["work"])
    table = pq.read_table(f"{setup['raw_dir']}/{name}")
    out = []
    for start in range(0, table.num_rows, setup["batch_size"]):
        out.append(
            apply_row_ops(table.slice(start, setup["batch_size"]), ops=setup["ops"], dedup_ops=setup["dedup_ops"])
        )
        setup["faults"].in_worker(name, work)  # raypai's own kill drill (raypai.data._faults)
    # a batch whose rows all fell before an annotating filter has null-typed annotation columns:
    # promote them to the other batches' types
    rows = pa.concat_tables(out, promote_options="permissive")
    kept = commit_shard(work, name, rows, setup["n_ops"], setup["dedup_ops"])
    return name, rows.num_rows, kept


def key_fields(dedup_ops) -> list[pa.Field]:
    """The `key.<op>` columns `apply_row_ops` adds, for shards that had no rows to add them to."""
    return [
        pa.field(f"key.{op.name}", pa.string() if isinstance(op, ExactDedup) else pa.list_(pa.uint32(), op.num_perm))
        for op in dedup_ops
    ]


def commit_shard(work: Path, part: str, rows: pa.Table | None, n_ops: int, dedup_ops=()) -> int:
    """Write one shard's kept and dropped rows and its stats columns, then its done marker with the
    shard's worker seconds per op and the task that did it (last, so a kill in between leaves the
    shard pending; a retried or resumed task rewrites every file). Returns the rows kept."""
    seconds = [0.0] * n_ops
    if rows is None or not rows.num_rows:
        kept, dropped, stats_cols = KEEP_SCHEMA.empty_table(), DROP_SCHEMA.empty_table(), []
        for field in key_fields(dedup_ops):  # the dedup pass reads every part's key columns
            kept = kept.append_column(field, pa.array([], field.type))
    else:
        is_drop = pc.is_valid(rows.column("drop_op"))
        k, d = rows.filter(pc.invert(is_drop)), rows.filter(is_drop)
        kept = pa.table(
            {c: (k.column(c) if c in k.column_names else pa.nulls(k.num_rows, pa.string())) for c in KEEP_COLUMNS}
        ).cast(KEEP_SCHEMA, safe=False)
        for c in (c for c in rows.column_names if c.startswith("key.")):  # dedup keys, for the dedup pass
            kept = kept.append_column(c, k.column(c))
        dropped = pa.table(
            {
                "doc_id": d.column("doc_id"),
                "source": d.column("source"),
                "op": d.column("drop_op"),
                "reason": d.column("drop_reason"),
                "stat": d.column("drop_stat"),
                "cluster_id": pa.nulls(d.num_rows, pa.string()),
                "text": d.column("text"),
            },
            schema=DROP_SCHEMA,
        )
        stats_cols = [c for c in rows.column_names if c.startswith("stats.")]
        share = pc.list_flatten(rows.column(SECONDS_COLUMN)).to_numpy(zero_copy_only=False)
        seconds = share.reshape(rows.num_rows, n_ops).sum(axis=0).tolist()  # (n_ops,)
    pq.write_table(kept, work / "kept" / part)
    pq.write_table(dropped, work / "dropped" / part)
    if stats_cols:
        pq.write_table(rows.select(stats_cols), work / "done" / f"{part}.stats.parquet")
    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    marker = {
        "rows": 0 if rows is None else rows.num_rows,
        "kept": kept.num_rows,
        "dropped": dropped.num_rows,
        "seconds": seconds,
        "pid": os.getpid(),
        "task_id": ctx.get_task_id() if ctx else None,
        "node_id": ctx.get_node_id() if ctx else None,
    }
    tmp = work / "done" / f".{part}.json.tmp"
    tmp.write_text(json.dumps(marker))
    tmp.replace(work / "done" / f"{part}.json")  # atomic: a marker is whole or absent
    return kept.num_rows


def apply_row_ops(batch: pa.Table, ops: list[Mapper | Filter], dedup_ops: list[ExactDedup | MinHashDedup]) -> pa.Table:
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
