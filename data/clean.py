"""Clean a raw dataset on Ray: mappers and filters with Ray Data `map_batches` (which also compute
the dedup keys and MinHash signatures), then exact and verified MinHash dedup over all shards in
the driver. Every row is accounted for.

    from raypai.data import clean
    manifest = clean("ingested/", "cleaned/", recipe="default", work_dir=".raypai/work/clean-x")

Resumable per input shard: each shard's filtered rows are committed to `work_dir` as soon as the
shard is complete; a re-run skips the committed ones.
Invariant checked on every run: input = kept + Σ dropped per op + rejected.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypai.data import _execute as ex
from raypai.data._faults import Faults
from raypai.data.ops.dedup import ExactDedup
from raypai.data.recipe import describe, is_dedup, load_recipe
from raypai.data.report import write_report
from raypai.errors import ConfigError, DataError

KEEP_SCHEMA, KEEP_COLUMNS, DROP_SCHEMA = ex.KEEP_SCHEMA, ex.KEEP_COLUMNS, ex.DROP_SCHEMA
# Ray retries a filter task whose worker process died (OOM kill, lost node) this many times; a
# shard's files are rewritten whole by the retry and committed by its done marker, so a retry is safe.
FILTER_RETRIES = 2


def _split_recipe(ops: list) -> tuple[list, list]:
    first_dedup = next((i for i, op in enumerate(ops) if is_dedup(op)), len(ops))
    late = [op.name for op in ops[first_dedup:] if not is_dedup(op)]
    if late:
        raise ConfigError([f"ops {late} come after a dedup op; put mappers and filters before "
                           "exact_dedup/minhash_dedup"], what="recipe")
    return ops[:first_dedup], ops[first_dedup:]


def clean(raw_dir: str | Path, out_dir: str | Path, recipe="default", *, work_dir: str | Path | None = None,
          batch_size: int = 1024, logger=None, progress=print) -> dict:
    """Clean the ingested dataset in `raw_dir` into `out_dir`; return its manifest.

    `recipe`: 'default', a YAML path or a list (see `load_recipe`). `work_dir` holds per-shard
    results; a run that dies part-way resumes from the shards committed there. `logger`: anything
    with `log_metrics(dict)` (a RunLogger)."""
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    faults = Faults.from_env()  # raypai's own tests only (raypai.data._faults)
    ops = load_recipe(recipe)
    row_ops, dedup_ops = _split_recipe(ops)
    if not ray.is_initialized():  # a library never starts Ray itself: the caller says which Ray
        raise DataError("clean() runs on Ray and none is connected in this process: call "
                        "raypai.runtime.ensure_ray(Settings.load()) first (raypai's Ray head, RAY_ADDRESS, or a local "
                        "Ray); `raypai data clean` and pipeline steps do this for you")
    raw = json.loads((raw_dir / "manifest.json").read_text())
    rows_of = {p["file"]: p["rows"] for p in raw["parts"]}
    parts = list(rows_of)
    work = Path(work_dir) if work_dir else out_dir / "_work"
    _prepare_work(work, describe(ops))
    t0 = time.time()
    pending = [p for p in parts if not (work / "done" / f"{p}.json").exists()]
    progress(f"clean: {len(parts) - len(pending)}/{len(parts)} shards already done; {len(pending)} to filter")
    for p in [p for p in pending if rows_of[p] == 0]:  # an empty shard yields no batch: commit it now
        ex.commit_shard(work, p, None, len(ops))
    pending = [p for p in pending if rows_of[p] > 0]
    if pending:
        # largest shards first, so the last task to start is a short one
        pending.sort(key=lambda p: -rows_of[p])
        ds = ray.data.from_items([{"shard": p} for p in pending], override_num_blocks=len(pending))
        ds = ds.map_batches(ex.clean_shards, batch_size=1, batch_format="pyarrow",  # one task per shard
                            fn_kwargs={"raw_dir": str(raw_dir.absolute()), "work": str(work.absolute()),
                                       "batch_size": batch_size, "n_ops": len(ops), "faults": faults,
                                       "ops": row_ops, "dedup_ops": dedup_ops},
                            max_retries=FILTER_RETRIES)
        _run_filter_pass(ds, {p: rows_of[p] for p in pending}, progress)
    # worker seconds per op of every shard's filtering (resumed shards: from the run that did them)
    seconds, tasks, per_node = np.zeros(len(ops)), set(), {}
    for p in parts:
        marker = json.loads((work / "done" / f"{p}.json").read_text())
        seconds += marker.get("seconds", 0.0)
        if marker.get("task_id"):  # None: an empty shard, committed by the driver
            tasks.add(marker["task_id"])
            per_node[marker["node_id"]] = per_node.get(marker["node_id"], 0) + 1
    filter_info = {"shards": len(parts), "tasks": len(tasks), "tasks_per_node": per_node}
    kept = _concat([pq.read_table(work / "kept" / f"{p}") for p in parts]).sort_by("doc_id")
    dropped = [pq.read_table(work / "dropped" / f"{p}") for p in parts]
    for op in dedup_ops:
        t1 = time.perf_counter()
        kept, gone = _dedup(kept, op)
        dropped.append(gone)
        seconds[ops.index(op)] += time.perf_counter() - t1
        progress(f"clean: {op.name} removed {gone.num_rows} duplicates")
    dropped_all = _concat(dropped, DROP_SCHEMA)
    op_stats = _op_stats(ops, raw["rows"], dropped_all, seconds)
    stats_files = [f for p in parts if (f := work / "done" / f"{p}.stats.parquet").exists()]
    return _write_outputs(raw_dir, out_dir, raw, kept.select(KEEP_COLUMNS), dropped_all, op_stats, ops,
                          time.time() - t0, logger, stats_files, filter_info)


def _dedup(kept: pa.Table, op) -> tuple[pa.Table, pa.Table]:
    """(rows kept, drop records) of one dedup op over the rows that passed the filters."""
    ids = kept.column("doc_id").to_pylist()  # sorted, so the lowest index in a cluster is its keeper
    keys = kept.column(f"key.{op.name}")
    if isinstance(op, ExactDedup):
        keeper = _exact_clusters(ids, keys.to_pylist())
        gone_rows = np.asarray([i for i, k in enumerate(keeper) if k != i], dtype=np.int64)
        stat = pa.nulls(len(gone_rows), pa.float64())
        reasons = [f"duplicate of {ids[keeper[i]]}" for i in gone_rows.tolist()]
    else:
        sigs = np.asarray(pc.list_flatten(keys).to_numpy(zero_copy_only=False), dtype=np.uint32)
        dups = op.find(kept.column("text"), sigs.reshape(kept.num_rows, op.num_perm))  # (N, num_perm) signatures
        keeper, gone_rows = dups.keeper, dups.dropped
        stat = pa.array(dups.similarity[gone_rows], pa.float64())
        reasons = [f"near-duplicate of {ids[p]} (Jaccard {s:.3f}, {'exact' if e else 'MinHash estimate'}); "
                   f"cluster kept {ids[k]}" for p, s, e, k in zip(dups.partner[gone_rows].tolist(),
                                                                  dups.similarity[gone_rows].tolist(),
                                                                  dups.exact[gone_rows].tolist(),
                                                                  keeper[gone_rows].tolist())]
    mask = np.zeros(kept.num_rows, dtype=bool)
    mask[gone_rows] = True
    gone = kept.take(pa.array(gone_rows, pa.int64()))
    records = pa.table({"doc_id": gone.column("doc_id"), "source": gone.column("source"),
                        "op": [op.name] * len(gone_rows), "reason": reasons, "stat": stat,
                        "cluster_id": [ids[k] for k in np.asarray(keeper)[gone_rows].tolist()],
                        "text": gone.column("text")}, schema=DROP_SCHEMA)
    return kept.filter(pa.array(~mask)), records


def _prepare_work(work: Path, recipe_desc: list) -> None:
    marker = work / "recipe.json"
    text = json.dumps(recipe_desc, sort_keys=True)
    if marker.exists() and marker.read_text() != text:
        shutil.rmtree(work)  # another recipe's partial work must not be mixed in
    for sub in ("kept", "dropped", "done"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    marker.write_text(text)


def _run_filter_pass(ds, expected: dict[str, int], progress) -> None:
    """One Ray Data execution over all pending shards. Each task commits its shard to the work
    folder itself and sends back one summary row; the driver counts them (one progress call per
    shard) and checks every row came through."""
    committed = 0
    try:
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for shard, rows in zip(batch.column("shard").to_pylist(), batch.column("rows").to_pylist()):
                if rows != expected[shard]:
                    raise DataError(f"shard {shard}: {rows} rows came out of the filter pass, {expected[shard]} "
                                    "went in; this is a raypai bug, report it")
                committed += 1
                progress(f"clean: filtered shards {committed}/{len(expected)}")
    except ray.exceptions.RayError as exc:
        raise DataError(f"the filter pass failed after {committed}/{len(expected)} shards were committed "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "the committed shards stay in work_dir: run the same clean again to resume") from exc


def _concat(tables: list[pa.Table], schema: pa.Schema | None = None) -> pa.Table:
    tables = [t for t in tables if t is not None]
    if not tables:
        return schema.empty_table() if schema else pa.table({c: pa.array([], pa.string()) for c in KEEP_COLUMNS})
    return pa.concat_tables(tables, promote_options="permissive")


def _exact_clusters(doc_ids: list[str], keys: list[str]) -> list[int]:
    """(N,) row of each row's keeper; `doc_ids` sorted, so the first holder of a key keeps it."""
    first: dict[str, int] = {}
    return [first.setdefault(key, i) for i, key in enumerate(keys)]


def _op_stats(ops, input_rows: int, dropped: pa.Table, seconds) -> list[dict]:
    """Rows in/out per op from the drop records, worker seconds per op from the shards' done
    markers (both complete across resumed runs), plus the driver's dedup time."""
    by_op = dict(zip(*np.unique(np.asarray(dropped.column("op").to_pylist(), dtype=object), return_counts=True))) \
        if dropped.num_rows else {}
    rows, alive = [], input_rows
    for i, op in enumerate(ops):
        n_drop = int(by_op.get(op.name, 0))
        rows.append({"op_index": i, "op_name": op.name, "rows_in": alive, "rows_out": alive - n_drop,
                     "dropped": n_drop, "seconds": round(float(seconds[i]), 4)})
        alive -= n_drop
    return rows


def _write_outputs(raw_dir, out_dir, raw, kept, dropped, op_stats, ops, seconds, logger, stats_files,
                   filter_info) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    shard_rows = 50_000
    shards = []
    for i in range(max(1, -(-kept.num_rows // shard_rows))):
        name = f"part-{i:05d}.parquet"
        pq.write_table(kept.slice(i * shard_rows, shard_rows), out_dir / name)
        shards.append({"file": name, "rows": min(shard_rows, kept.num_rows - i * shard_rows),
                       "sha256": hashlib.sha256((out_dir / name).read_bytes()).hexdigest()})
    pq.write_table(dropped.sort_by([("op", "ascending"), ("doc_id", "ascending")]), out_dir / "dropped.parquet")
    shutil.copyfile(raw_dir / "rejected.parquet", out_dir / "rejected.parquet")
    total_input = raw["rows"] + raw["rejected"]
    accounting = {"input_rows": total_input, "kept": kept.num_rows, "dropped": dropped.num_rows,
                  "rejected": raw["rejected"],
                  "dropped_by_op": {r["op_name"]: r["dropped"] for r in op_stats}}
    if total_input != kept.num_rows + sum(accounting["dropped_by_op"].values()) + raw["rejected"]:
        raise DataError(f"accounting invariant broken: input {total_input} != kept {kept.num_rows} + dropped "
                        f"{accounting['dropped_by_op']} + rejected {raw['rejected']}; this is a raypai bug, report it")
    manifest = {"kind": "dataset", "schema": KEEP_COLUMNS, "rows": kept.num_rows, "shards": shards,
                "sources": raw["files"], "recipe": describe(ops), "op_stats": op_stats, "accounting": accounting,
                "seconds": round(seconds, 2), "filter": filter_info,
                "text_bytes": int(sum(len(t.encode()) for t in kept.column("text").to_pylist()))}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    write_report(out_dir, manifest, dropped, stats_files)
    if logger is not None:
        logger.log_metrics({"kept": kept.num_rows, "dropped": dropped.num_rows, "rejected": raw["rejected"],
                            **{f"dropped.{k}": v for k, v in accounting["dropped_by_op"].items()}})
    return manifest
