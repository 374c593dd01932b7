"""Ray tasks that write `clean`'s outputs from the per-part files in its work folder: one task per
output shard, one that streams the drop records into `dropped.parquet`, one for the report. The
driver sends names and gets counters back."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raypai.data._execute import DROP_SCHEMA, KEEP_COLUMNS, KEEP_SCHEMA

SAMPLES_PER_OP = 3  # drop records per op the report shows


def write_shard(src: str, dst: str) -> dict:
    """Copy one part's final kept rows (clean's columns, in the part's order) to output shard
    `dst`; return its rows, sha256 and text bytes."""
    table = pq.read_table(src, columns=KEEP_COLUMNS).cast(KEEP_SCHEMA, safe=False)  # one part: ~block_bytes
    pq.write_table(table, dst)
    digest = hashlib.sha256()
    with open(dst, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    text_bytes = pc.sum(pc.binary_length(table.column("text"))).as_py() or 0
    return {"rows": table.num_rows, "sha256": digest.hexdigest(), "text_bytes": int(text_bytes)}


def merge_dropped(pieces: list[str], dst: str) -> dict:
    """Stream the drop-record pieces, in the order given, into `dst` (one piece in memory at a
    time); return the records per op and the first `SAMPLES_PER_OP` records of each op."""
    by_op: dict[str, int] = {}
    samples: dict[str, list[dict]] = {}
    with pq.ParquetWriter(dst, DROP_SCHEMA) as writer:
        for piece in pieces:
            if not Path(piece).exists():
                continue
            table = pq.read_table(piece).cast(DROP_SCHEMA, safe=False)
            writer.write_table(table)
            if not table.num_rows:
                continue
            counts = pc.value_counts(table.column("op"))
            for entry in counts.to_pylist():
                by_op[entry["values"]] = by_op.get(entry["values"], 0) + entry["counts"]
                have = samples.setdefault(entry["values"], [])
                if len(have) < SAMPLES_PER_OP:
                    rows = table.filter(pc.equal(table.column("op"), entry["values"]))
                    have += rows.slice(0, SAMPLES_PER_OP - len(have)).to_pylist()
    return {"by_op": by_op, "samples": samples}


def write_empty_shard(dst: str) -> dict:
    pq.write_table(KEEP_SCHEMA.empty_table(), dst)
    return {"rows": 0, "sha256": hashlib.sha256(Path(dst).read_bytes()).hexdigest(), "text_bytes": 0}


def samples_table(samples: dict[str, list[dict]]) -> pa.Table:
    """The report's sample removals as one small table."""
    rows = [r for op in sorted(samples) for r in samples[op]]
    return pa.Table.from_pylist(rows, schema=DROP_SCHEMA) if rows else DROP_SCHEMA.empty_table()
