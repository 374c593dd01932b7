"""Clean a raw dataset on Ray; the driver holds counters and names, never rows.

    from raypai.data import clean
    manifest = clean("ingested/", "cleaned/", recipe="default", work_dir=".raypai/work/clean-x")

1. Filter pass: one Ray task per ingested part (ingest cuts big files into parts of about
   `block_bytes`) runs the mappers and filters and computes the dedup keys and MinHash signatures
   (`raypai.data._execute`), then commits the part's kept and dropped rows to `work_dir` itself.
2. Dedup: `raypai.data._dedup.run_dedup` over the committed parts, as Ray tasks per part and per
   hash bucket, each round committed to `work_dir/dedup`.
3. Outputs: one Ray task per part writes its output shard; one streams the drop records into
   `dropped.parquet`; one writes the report (`raypai.data._write`).

Resumable: a re-run with the same `work_dir` skips every committed shard and dedup round.
Invariant checked on every run: input = kept + Σ dropped per op + rejected.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray

from raypai.data import _execute as ex
from raypai.data import _write as wr
from raypai.data._dedup import SPREAD, run_dedup
from raypai.data._faults import Faults
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
        raise ConfigError(
            [f"ops {late} come after a dedup op; put mappers and filters before exact_dedup/minhash_dedup"],
            what="recipe",
        )
    return ops[:first_dedup], ops[first_dedup:]


def clean(
    raw_dir: str | Path,
    out_dir: str | Path,
    recipe="default",
    *,
    work_dir: str | Path | None = None,
    batch_size: int = 1024,
    logger=None,
    progress=None,
) -> dict:
    """Clean the ingested dataset in `raw_dir` into `out_dir`; return its manifest.

    `recipe`: 'default', a YAML path or a list (see `load_recipe`). `work_dir` holds per-shard
    results; a run that dies part-way resumes from the shards committed there. `logger`: anything
    with `log_metrics(dict)` (a RunLogger). `progress`: called as a step's `ctx.progress` is, with a
    note (`progress("dedup: ...")`) or with counts (`progress(rows_done, rows_total, "rows")`, once
    per filtered shard); default: print them."""
    progress = progress or print_progress
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    faults = Faults.from_env()  # raypai's own tests only (raypai.data._faults)
    ops = load_recipe(recipe)
    row_ops, dedup_ops = _split_recipe(ops)
    if not ray.is_initialized():  # a library never starts Ray itself: the caller says which Ray
        raise DataError(
            "clean() runs on Ray and none is connected in this process: call "
            "raypai.runtime.ensure_ray(Settings.load()) first (raypai's Ray head, RAY_ADDRESS, or a local "
            "Ray); `raypai data clean` and pipeline steps do this for you"
        )
    raw = json.loads((raw_dir / "manifest.json").read_text())
    rows_of = {p["file"]: p["rows"] for p in raw["parts"]}
    parts = list(rows_of)
    work = Path(work_dir) if work_dir else out_dir / "_work"
    _prepare_work(work, describe(ops))
    t0 = time.time()
    pending = [p for p in parts if not (work / "done" / f"{p}.json").exists()]
    progress(f"clean: {len(parts) - len(pending)}/{len(parts)} shards already done; {len(pending)} to filter")
    for p in [p for p in pending if rows_of[p] == 0]:  # an empty shard yields no batch: commit it now
        ex.commit_shard(work, p, None, len(ops), dedup_ops)
    pending = [p for p in pending if rows_of[p] > 0]
    if pending:
        # largest shards first, so the last task to start is a short one
        pending.sort(key=lambda p: -rows_of[p])
        setup = ray.put(
            {
                "raw_dir": str(raw_dir.absolute()),
                "work": str(work.absolute()),
                "batch_size": batch_size,
                "n_ops": len(ops),
                "faults": faults,
                "ops": row_ops,
                "dedup_ops": dedup_ops,
            }
        )
        task = ray.remote(num_cpus=1, max_retries=FILTER_RETRIES, scheduling_strategy=SPREAD)(ex.filter_shard)
        task = task.options(name="raypai.clean.filter")
        _run_filter_pass(
            [task.remote(p, setup) for p in pending],
            {p: rows_of[p] for p in pending},
            progress,
            done_rows=sum(rows_of[p] for p in parts) - sum(rows_of[p] for p in pending),
        )
    # worker seconds per op of every shard's filtering (resumed shards: from the run that did them)
    seconds, tasks, per_node = np.zeros(len(ops)), set(), {}
    for p in parts:
        marker = json.loads((work / "done" / f"{p}.json").read_text())
        seconds += marker.get("seconds", 0.0)
        if marker.get("task_id"):  # None: an empty shard, committed by the driver
            tasks.add(marker["task_id"])
            per_node[marker["node_id"]] = per_node.get(marker["node_id"], 0) + 1
    filter_info = {"shards": len(parts), "tasks": len(tasks), "tasks_per_node": per_node}
    final, pieces = work / "kept", [work / "dropped" / p for p in parts]
    if dedup_ops:  # distributed and resumable: raypai.data._dedup, per-part results under work/dedup
        d = run_dedup(work, parts, dedup_ops, progress=progress)
        for op in dedup_ops:
            seconds[ops.index(op)] += d["seconds"][op.name]
        final = work / "dedup" / "kept"
        pieces = [x for p in parts for x in (work / "dropped" / p, work / "dedup" / "dropped" / p)]
    stats_files = [f for p in parts if (f := work / "done" / f"{p}.stats.parquet").exists()]
    return _write_outputs(
        raw_dir, out_dir, raw, final, parts, pieces, ops, seconds, time.time() - t0, logger, stats_files, filter_info
    )


def _prepare_work(work: Path, recipe_desc: list) -> None:
    marker = work / "recipe.json"
    text = json.dumps(recipe_desc, sort_keys=True)
    if marker.exists() and marker.read_text() != text:
        shutil.rmtree(work)  # another recipe's partial work must not be mixed in
    for sub in ("kept", "dropped", "done"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    marker.write_text(text)


def print_progress(done, total=None, unit: str = "rows") -> None:
    """clean's default progress: notes as they are, counts as 'clean: 148/592 rows'."""
    print(done if total is None else f"clean: {done:,}/{total:,} {unit}")


def _run_filter_pass(refs: list, expected: dict[str, int], progress, done_rows: int = 0) -> None:
    """Wait for the filter tasks, one progress call per shard as it finishes (rows filtered so far,
    shards resumed from an earlier run included), checking each shard's row count. Each task
    commits its shard to the work folder itself and returns (shard, rows, kept).

    Plain Ray tasks, not Ray Data: one task per shard is all this pass needs (ingest already cut big
    files into parts), and Ray Data would add its stats and autoscaling actors and import pandas in
    every worker (memory every run would pay: benchmarks/history/asides.md)."""
    committed, waiting = 0, list(refs)
    total = done_rows + sum(expected.values())
    progress(done_rows, total, "rows")  # the start: the step's line measures its rate from here
    try:
        while waiting:
            (ref,), waiting = ray.wait(waiting, num_returns=1)
            shard, rows, _ = ray.get(ref)
            if rows != expected[shard]:
                raise DataError(
                    f"shard {shard}: {rows} rows came out of the filter pass, {expected[shard]} "
                    "went in; this is a raypai bug, report it"
                )
            committed += 1
            done_rows += rows
            progress(done_rows, total, "rows")
    except ray.exceptions.RayError as exc:
        for ref in waiting:  # shards not committed stay pending for the next run
            ray.cancel(ref)
        ray.wait(waiting, num_returns=len(waiting), timeout=30)  # let cancelled tasks stop before the caller retries
        raise DataError(
            f"the filter pass failed after {committed}/{len(expected)} shards were committed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "the committed shards stay in work_dir: run the same clean again to resume"
        ) from exc


def _op_stats(ops, input_rows: int, by_op: dict[str, int], seconds) -> list[dict]:
    """Rows in/out per op from the drop records' counts, worker seconds per op from the shards' done
    markers and the dedup rounds (both complete across resumed runs)."""
    rows, alive = [], input_rows
    for i, op in enumerate(ops):
        n_drop = int(by_op.get(op.name, 0))
        rows.append(
            {
                "op_index": i,
                "op_name": op.name,
                "rows_in": alive,
                "rows_out": alive - n_drop,
                "dropped": n_drop,
                "seconds": round(float(seconds[i]), 4),
            }
        )
        alive -= n_drop
    return rows


def _write_outputs(
    raw_dir, out_dir, raw, final: Path, parts, pieces, ops, seconds, t_run, logger, stats_files, filter_info
) -> dict:
    """Output shards (one Ray task per non-empty part: its final kept rows), `dropped.parquet`
    (one task streaming the drop records), the report (one task); the driver adds up counters."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*.parquet"):  # a previous run's shards (their number may differ)
        old.unlink()
    rows_of = {p: pq.ParquetFile(final / p).metadata.num_rows for p in parts}  # footers only
    names = {p: f"part-{i:05d}.parquet" for i, p in enumerate(p for p in parts if rows_of[p])}
    write = ray.remote(num_cpus=1, max_retries=FILTER_RETRIES, scheduling_strategy=SPREAD)
    refs = [write(wr.write_shard).remote(str(final / p), str(out_dir / n)) for p, n in names.items()]
    if not names:  # a dataset with no rows left: one empty shard, so readers find the schema
        names, refs = (
            {"": "part-00000.parquet"},
            [write(wr.write_empty_shard).remote(str(out_dir / "part-00000.parquet"))],
        )
    drops = write(wr.merge_dropped).remote([str(x) for x in pieces], str(out_dir / "dropped.parquet"))
    shards = [{"file": n, "rows": r["rows"], "sha256": r["sha256"]} for n, r in zip(names.values(), ray.get(refs))]
    text_bytes = sum(r["text_bytes"] for r in ray.get(refs))
    drops = ray.get(drops)
    shutil.copyfile(raw_dir / "rejected.parquet", out_dir / "rejected.parquet")
    op_stats = _op_stats(ops, raw["rows"], drops["by_op"], seconds)
    kept = sum(s["rows"] for s in shards)
    total_input = raw["rows"] + raw["rejected"]
    accounting = {
        "input_rows": total_input,
        "kept": kept,
        "dropped": sum(drops["by_op"].values()),
        "rejected": raw["rejected"],
        "dropped_by_op": {r["op_name"]: r["dropped"] for r in op_stats},
    }
    if total_input != kept + sum(accounting["dropped_by_op"].values()) + raw["rejected"] or accounting[
        "dropped"
    ] != sum(accounting["dropped_by_op"].values()):
        raise DataError(
            f"accounting invariant broken: input {total_input} != kept {kept} + dropped "
            f"{accounting['dropped_by_op']} + rejected {raw['rejected']}; this is a raypai bug, report it"
        )
    manifest = {
        "kind": "dataset",
        "schema": KEEP_COLUMNS,
        "rows": kept,
        "shards": shards,
        "sources": raw["files"],
        "recipe": describe(ops),
        "op_stats": op_stats,
        "accounting": accounting,
        "seconds": round(t_run, 2),
        "filter": filter_info,
        "text_bytes": text_bytes,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    ray.get(write(write_report).remote(out_dir, manifest, wr.samples_table(drops["samples"]), stats_files))
    if logger is not None:
        logger.log_metrics(
            {
                "kept": kept,
                "dropped": accounting["dropped"],
                "rejected": raw["rejected"],
                **{f"dropped.{k}": v for k, v in accounting["dropped_by_op"].items()},
            }
        )
    return manifest
