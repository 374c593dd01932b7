"""Committed units of work on a shared folder: the storage side of `raypai.data._dedup`'s rounds.

A *stage* is a folder; each *unit* of it (one input part or one hash bucket, run as one Ray task)
writes its files into a hidden temporary folder and renames it to `<stage>/<unit>` when they are
complete. The rename is the commit (atomic on one filesystem): a unit folder that exists is whole,
and a re-run skips it. Once every unit is committed, the driver writes `<stage>/_DONE.json` with the
units' summed counters, and a re-run skips the stage without listing it.

A unit's output is addressed to the units of a later stage (a shuffle): for each *kind* of record,
one Parquet file `<kind>.parquet` with one run of row groups per destination, and `meta.json`
mapping kind → destination → row groups (plus the unit's counters). A consumer reads its
destination's row groups from every producer unit, nothing else; so a bucket task holds one
bucket, a part task one part.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP = 1 << 16  # rows per Parquet row group: a destination's records are whole row groups
DONE = "_DONE.json"


def split(table: pa.Table, dest: np.ndarray, prefix: str) -> dict[str, pa.Table]:
    """{f"{prefix}{d}": the rows of `table` whose `dest` (N,) int is d} (row order kept within each)."""
    if not table.num_rows:
        return {}
    order = np.argsort(dest, kind="stable")
    d = dest[order]
    cuts = np.flatnonzero(d[1:] != d[:-1]) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(d)]])
    table = table.take(pa.array(order))
    return {f"{prefix}{int(d[s])}": table.slice(s, e - s) for s, e in zip(starts, ends)}


def commit(
    stage: Path, unit: str, out: dict[str, dict[str, pa.Table]], counters: dict, before_rename=lambda: None
) -> None:
    """Write one unit's output (`out[kind][dest]`) and counters, then commit it by renaming
    (`before_rename`: a test's fault hook)."""
    tmp = stage / f".tmp-{unit}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    index: dict[str, dict[str, list[int]]] = {}
    for kind, by_dest in out.items():
        tables = [(d, t) for d, t in sorted(by_dest.items()) if t.num_rows]
        if not tables:
            continue
        index[kind] = {}
        group = 0
        with pq.ParquetWriter(tmp / f"{kind}.parquet", tables[0][1].schema) as writer:
            for d, t in tables:
                index[kind][d] = []
                for lo in range(0, t.num_rows, ROW_GROUP):
                    writer.write_table(t.slice(lo, ROW_GROUP), row_group_size=ROW_GROUP)  # exactly one row group
                    index[kind][d].append(group)
                    group += 1
    (tmp / "meta.json").write_text(json.dumps({"counters": counters, "index": index}))
    before_rename()
    try:
        os.rename(tmp, stage / unit)
    except OSError:
        # committed meanwhile, by a task of an earlier run that was killed: same inputs, same files
        if not (stage / unit).is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def committed_units(stage: Path) -> list[Path]:
    return sorted(p for p in stage.iterdir() if p.is_dir() and not p.name.startswith("."))


def gather(stages: list[Path], kind: str, dest: str, schema: pa.Schema) -> pa.Table:
    """All records of `kind` addressed to `dest` by the committed units of `stages` (in unit order)."""
    tables = []
    for stage in stages:
        for unit in committed_units(stage):
            groups = json.loads((unit / "meta.json").read_text())["index"].get(kind, {}).get(dest)
            if groups:
                tables.append(pq.ParquetFile(unit / f"{kind}.parquet").read_row_groups(groups))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def counters(stage: Path) -> dict:
    """The summed counters of a stage's committed units."""
    total: dict = {}
    for unit in committed_units(stage):
        for k, v in json.loads((unit / "meta.json").read_text())["counters"].items():
            total[k] = total.get(k, 0) + v
    return total


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


def clear_temporaries(stage: Path) -> None:
    """Remove the half-written unit folders and files a killed run left behind."""
    for tmp in stage.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
