"""Test oracles for the data tests: the in-process dedup that `clean` ran in its driver before the
distributed dedup (raypai.data._dedup). The library no longer calls it; tests/data/test_dedup_dist.py
compares the distributed dedup's drops and keepers against it.

    kept, dropped = driver_side_dedup(kept_rows_sorted_by_doc_id, MinHashDedup())
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypai.data.clean import DROP_SCHEMA
from raypai.data.ops.dedup import ExactDedup


def driver_side_dedup(kept: pa.Table, op) -> tuple[pa.Table, pa.Table]:
    """(rows kept, drop records) of one dedup op over the rows that passed the filters."""
    ids = kept.column("doc_id").to_pylist()  # sorted, so the lowest index in a cluster is its keeper
    keys = kept.column(f"key.{op.name}")
    if isinstance(op, ExactDedup):
        keeper = exact_clusters(ids, keys.to_pylist())
        gone_rows = np.asarray([i for i, k in enumerate(keeper) if k != i], dtype=np.int64)
        stat = pa.nulls(len(gone_rows), pa.float64())
        reasons = [f"duplicate of {ids[keeper[i]]}" for i in gone_rows.tolist()]
    else:
        sigs = np.asarray(pc.list_flatten(keys).to_numpy(zero_copy_only=False), dtype=np.uint32)
        dups = op.find(kept.column("text"), sigs.reshape(kept.num_rows, op.num_perm))  # (N, num_perm) signatures
        keeper, gone_rows = dups.keeper, dups.dropped
        stat = pa.array(dups.similarity[gone_rows], pa.float64())
        reasons = [
            f"near-duplicate of {ids[p]} (Jaccard {s:.3f}, {'exact' if e else 'MinHash estimate'}); "
            f"cluster kept {ids[k]}"
            for p, s, e, k in zip(
                dups.partner[gone_rows].tolist(),
                dups.similarity[gone_rows].tolist(),
                dups.exact[gone_rows].tolist(),
                keeper[gone_rows].tolist(),
            )
        ]
    mask = np.zeros(kept.num_rows, dtype=bool)
    mask[gone_rows] = True
    gone = kept.take(pa.array(gone_rows, pa.int64()))
    records = pa.table(
        {
            "doc_id": gone.column("doc_id"),
            "source": gone.column("source"),
            "op": [op.name] * len(gone_rows),
            "reason": reasons,
            "stat": stat,
            "cluster_id": [ids[k] for k in np.asarray(keeper)[gone_rows].tolist()],
            "text": gone.column("text"),
        },
        schema=DROP_SCHEMA,
    )
    return kept.filter(pa.array(~mask)), records


def exact_clusters(doc_ids: list[str], keys: list[str]) -> list[int]:
    """(N,) row of each row's keeper; `doc_ids` sorted, so the first holder of a key keeps it."""
    first: dict[str, int] = {}
    return [first.setdefault(key, i) for i, key in enumerate(keys)]
