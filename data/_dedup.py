"""Distributed, resumable dedup of the filter pass's output: Ray tasks over one part or one hash
bucket each; no process holds all rows, texts, keys or edges; the driver holds counters and names.

    from raypai.data._dedup import run_dedup
    stats = run_dedup(work, parts, dedup_ops)    # after clean's filter pass, with Ray connected

**Inputs**: `<work>/kept/<part>` for each name in `parts` (Parquet, as clean's filter pass commits
it: `doc_id` (ingest's 16-hex id), `text`, `source`, ..., and `key.<op name>` per dedup op: the
exact-dedup key string, or the MinHash signature, a fixed-size list of `num_perm` uint32).
`<work>` must be a folder every Ray node sees (like clean's work_dir).

**Outputs**, per part: `<work>/dedup/kept/<part>` (the rows every dedup op kept, in input order,
without the key.* columns) and `<work>/dedup/dropped/<part>` (one drop record per removed row, in
clean's DROP_SCHEMA, input order). The drops and keepers are those of an in-process dedup
(`MinHashDedup.find`; the oracle in tests/data/_oracles.py): ops run in recipe order over the rows
the earlier ones kept; keeper of a cluster = lowest doc_id; exact: "duplicate of <keeper>"; MinHash:
the same LSH candidates (a document pairs with the first `fanout` lower doc_ids of its bucket, per
band), the same verification (signature estimate, exact shingle Jaccard within `verify_margin` of
the threshold), connected components of the verified edges, and each removed row's best verified
pair (most similar; ties: the lowest partner above it, else the lowest below). Returns counters:
dropped and worker seconds per op, candidates, verified edges and connected-component rounds per
MinHash op, rows kept, units run by this call.

**Rounds** (R = `buckets` hash buckets; "→" names where a unit's records go):
- exact: `map` (per part: (doc_id, key) → bucket crc32(key) mod R), `reduce` (per bucket: sort by
  (key, doc_id); the first of each key keeps, the others → their part as drops).
- MinHash: `bands` (per part: band keys of the rows with shingles → bucket of (band, key)),
  `cand` (per bucket: candidate pairs → part of the lower id), `siga` (per part: distinct pairs, the
  lower id's signature attached → part of the higher id), `est` (per part: the other signature, the
  estimate; far from the threshold decided here, near ones with the higher id's text → part of the
  lower id), `exact` (per part: exact shingle Jaccard), `cc/rNNN` (per bucket, the connected
  components, below), `decide` (per part: drops with keeper and best pair).
- `write` (per part): streams the part once, writes its kept rows and drop records.

Connected components: large-star / small-star rounds (Kiveris et al., SoCC 2014) on edges
hash-partitioned by node id, until every component is a star around its lowest id (the keeper);
see `raypai.data._components`. (data-juicer's Ray MinHash dedup partitions its union-find across
actors for the same reason: no process holds all edges.)

**Resume**: every unit commits its files by renaming a temporary folder (`raypai.data._shuffle`);
a stage whose units are all committed gets `_DONE.json`, and the whole run `<work>/dedup/_DONE.json`
with the counters. A re-run (after a crash, SIGKILL of the driver or of a worker) skips committed
stages and units and redoes only the rest; outputs are deterministic, so they are byte-identical
to an uninterrupted run's. `<work>/dedup/plan.json` records parts, ops and R: another plan starts
over. Layout: `<work>/dedup/<k>-<op name>/<round>/<unit>/{meta.json,<kind>.parquet}`, units `pNNNNN`
(parts, by index in `parts`) and `bNNNNN` (buckets).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from raypai._faults import from_env
from raypai.data import _components as cc
from raypai.data import _shuffle as sh
from raypai.data._execute import DROP_SCHEMA
from raypai.data.ops import minhash as mh
from raypai.data.ops.dedup import ExactDedup, MinHashDedup
from raypai.errors import DataError

FAULTS_ENV = "RAYPAI_DEDUP_FAULTS"
MAX_CC_ROUNDS = 200
_U64, _I32 = pa.uint64(), pa.int32()
KEYS = pa.schema([("id", _U64), ("key", pa.string()), ("part", _I32)])
BANDS = pa.schema([("band", pa.uint32()), ("key", _U64), ("id", _U64), ("part", _I32)])
PAIRS = pa.schema([("a", _U64), ("b", _U64), ("pa", _I32), ("pb", _I32)])
EDGES = pa.schema([("a", _U64), ("b", _U64), ("sim", pa.float64()), ("exact", pa.bool_())])
LABELS = pa.schema([("id", _U64), ("cluster", _U64)])
NEAR = PAIRS.append(pa.field("est", pa.float64())).append(pa.field("text_b", pa.large_string()))
ROWS_PER_READ = 16_384  # rows per streamed read of a part
EXACT_CHUNK = 4096  # near pairs shingled at once
DROPS = pa.schema([("id", _U64), ("cluster", _U64), ("partner", _U64), ("sim", pa.float64()), ("exact", pa.bool_())])


@dataclass(frozen=True)
class DedupFaults:
    """Private fault injection for raypai's own tests, read by the driver from RAYPAI_DEDUP_FAULTS
    (a JSON object of these fields) and shipped to the unit tasks; not a user interface.
    - `kill_after_units`: the driver SIGKILLs itself once this many units were committed in this call.
    - `kill_worker_in`: a unit, as "<round>/<unit>" under <work>/dedup (e.g. "1-minhash_dedup/est/p00002"):
      its worker SIGKILLs itself once, after writing the unit's temporary folder and before the
      rename (Ray then retries the task)."""

    kill_after_units: int = -1  # -1: never
    kill_worker_in: str = ""

    @classmethod
    def from_env(cls) -> "DedupFaults":
        return from_env(cls, FAULTS_ENV)

    def after_unit(self, committed: int) -> None:
        if 0 <= self.kill_after_units <= committed:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_rename(self, stage: Path, unit: str, label: str) -> None:
        once = stage / f".killed-{unit}"  # the retry must get through
        if self.kill_worker_in == f"{label}/{unit}" and not once.exists():
            once.touch()
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class _Plan:
    work: str
    parts: tuple[str, ...]
    ops: tuple
    buckets: int

    def part(self, i: int) -> Path:
        return Path(self.work) / "kept" / self.parts[i]

    def stage(self, k: int, name: str) -> Path:
        return Path(self.work) / "dedup" / f"{k}-{self.ops[k].name}" / name

    def drops(self, k: int) -> Path:  # the round holding op k's drop decisions, addressed per part
        return self.stage(k, "reduce" if isinstance(self.ops[k], ExactDedup) else "decide")


def run_dedup(
    work: str | Path, parts: list[str], dedup_ops: list, *, buckets: int | None = None, progress=print
) -> dict:
    """Dedup `<work>/kept/<part>` for each of `parts` with `dedup_ops` (in order) into
    `<work>/dedup/{kept,dropped}/<part>`; return the counters (see the module docstring).
    `buckets`: hash buckets per shuffle (default: one per 250k input rows, 4 to 1024)."""
    work = Path(work)
    bad = [op for op in dedup_ops if not isinstance(op, ExactDedup | MinHashDedup)]
    if bad:
        raise DataError(f"run_dedup takes exact_dedup/minhash_dedup ops only; got {bad}")
    missing = [p for p in parts if not (work / "kept" / p).is_file()]
    if missing:
        raise DataError(
            f"dedup input missing: {[str(work / 'kept' / p) for p in missing]}; run clean's filter "
            "pass into this work folder first"
        )
    need = {"doc_id", "text", "source", *(f"key.{op.name}" for op in dedup_ops)}
    lacking = {p: sorted(need - set(pq.read_schema(work / "kept" / p).names)) for p in parts}
    lacking = {p: cols for p, cols in lacking.items() if cols}
    if lacking:
        raise DataError(
            f"dedup input lacks columns {lacking}: clean's filter pass writes key.<op> for each dedup "
            "op of its recipe; run it with the same dedup ops into this work folder"
        )
    if not ray.is_initialized():
        raise DataError(
            "run_dedup runs on Ray and none is connected in this process: call "
            "raypai.runtime.ensure_ray(Settings.load()) first"
        )
    if buckets is None:
        rows = sum(pq.ParquetFile(work / "kept" / p).metadata.num_rows for p in parts)
        buckets = max(4, min(1024, math.ceil(rows / 250_000)))
    plan = _Plan(str(work), tuple(parts), tuple(dedup_ops), int(buckets))
    _prepare(plan)
    runner = _Runner(work / "dedup", progress, DedupFaults.from_env())  # raypai's own tests only
    done = work / "dedup" / sh.DONE
    if done.exists():
        return json.loads(done.read_text()) | {"units_run": 0}
    result: dict = {
        "dropped": {},
        "seconds": {},
        "candidates": {},
        "verified": {},
        "cc_rounds": {},
        "buckets": plan.buckets,
    }
    for k, op in enumerate(plan.ops):
        seconds = 0.0
        for name, count in (_exact if isinstance(op, ExactDedup) else _minhash)(plan, k, runner):
            c = runner.counters[plan.stage(k, name)]
            seconds += c.get("seconds", 0.0)
            if count:
                result[count][op.name] = c.get(count, 0)
        if isinstance(op, MinHashDedup):
            result["cc_rounds"][op.name] = len([p for p in plan.stage(k, "cc").glob("r*") if p.is_dir()])
        result["dropped"][op.name] = runner.counters[plan.drops(k)].get("dropped", 0)
        result["seconds"][op.name] = round(seconds, 4)
        progress(f"dedup: {op.name} removed {result['dropped'][op.name]} duplicates")
    out = runner.run(Path(work) / "dedup" / "write", _parts_units(plan), _write, plan=plan)
    result |= {"kept": out.get("kept", 0), "write_seconds": round(out.get("seconds", 0.0), 4)}
    for sub in ("kept", "dropped"):  # temporaries of write attempts that were killed
        sh.clear_temporaries(work / "dedup" / sub)
    sh.write_atomic(done, json.dumps(result))
    return result | {"units_run": runner.committed}


def _prepare(plan: _Plan) -> None:
    root = Path(plan.work) / "dedup"
    desc = json.dumps(
        {
            "parts": plan.parts,
            "buckets": plan.buckets,
            "ops": [[type(op).__name__, dataclasses.asdict(op)] for op in plan.ops],
        },
        sort_keys=True,
    )
    marker = root / "plan.json"
    if marker.exists() and marker.read_text() != desc:
        shutil.rmtree(root)  # another plan's rounds must not be mixed in
    for sub in ("kept", "dropped"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    marker.write_text(desc)


class _Runner:
    """Runs a round: one Ray task per uncommitted unit; the fault hook after each commit."""

    def __init__(self, root: Path, progress, faults: DedupFaults):
        self.root, self.progress, self.faults, self.committed = root, progress, faults, 0
        self.counters: dict[Path, dict] = {}

    def run(self, stage: Path, units: list[str], fn, **kwargs) -> dict:
        done = stage / sh.DONE
        if not done.exists():
            stage.mkdir(parents=True, exist_ok=True)
            sh.clear_temporaries(stage)
            todo = [u for u in units if not (stage / u).is_dir()]
            label = str(stage.relative_to(self.root))
            pending = [_unit_task.remote(fn, str(stage), u, kwargs, self.faults, label) for u in todo]
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(ready[0])
                except ray.exceptions.RayError as e:
                    raise DataError(
                        f"dedup round {label} failed in a unit (below); the units committed so far are "
                        f"kept: fix the cause and run again to resume\n{e}"
                    ) from e
                self.committed += 1
                self.faults.after_unit(self.committed)
            sh.clear_temporaries(stage)  # those of killed attempts
            sh.write_atomic(done, json.dumps(sh.counters(stage)))
            self.progress(f"dedup: {label}: {len(todo)} units run, {len(units) - len(todo)} already committed")
        self.counters[stage] = json.loads(done.read_text())
        return self.counters[stage]


# Dedup units (and clean's filter and write tasks) ask for Ray's SPREAD strategy: the default keeps
# short tasks on the submitting node while it keeps up (a two-node run put 131 of 136 units on the
# driver's node); spread, they use every node. On one node it changes nothing.
SPREAD = "SPREAD"


@ray.remote(num_cpus=1, scheduling_strategy=SPREAD)
def _unit_task(fn, stage: str, unit: str, kwargs: dict, faults: DedupFaults, label: str) -> None:
    t0 = time.perf_counter()
    out, counters = fn(unit=unit, **kwargs)
    sh.commit(
        Path(stage),
        unit,
        out,
        counters | {"seconds": time.perf_counter() - t0},
        before_rename=lambda: faults.before_rename(Path(stage), unit, label),
    )


# ---- reading parts --------------------------------------------------------------------------


def _ids(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """(N,) uint64 of ingest's doc ids (16 lower-case hex digits: the order of the strings)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    arr = arr.cast(pa.large_string())
    if len(arr) and not (arr.null_count == 0 and pc.all(pc.match_substring_regex(arr, "^[0-9a-f]{16}$")).as_py()):
        raise DataError(
            "dedup needs ingest's doc ids (16 lower-case hex digits) in the doc_id column; re-ingest "
            f"the data with raypai.data.ingest (got e.g. {arr[0].as_py()!r})"
        )
    if not len(arr):
        return np.zeros(0, np.uint64)
    off = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset]
    digits = np.frombuffer(arr.buffers()[2], np.uint8)[off : off + 16 * len(arr)].reshape(-1, 16)
    digits = np.where(digits >= ord("a"), digits - (ord("a") - 10), digits - ord("0")).astype(np.uint64)
    out = np.zeros(len(arr), np.uint64)
    for k in range(16):
        out = (out << np.uint64(4)) | digits[:, k]
    return out


def _hex(ids: np.ndarray) -> list[str]:
    return [f"{x:016x}" for x in ids.tolist()]


def _scan(plan: _Plan, i: int, columns: list[str]):
    """Part i's `columns`, streamed in batches (a part is never read whole)."""
    yield from pq.ParquetFile(plan.part(i)).iter_batches(batch_size=ROWS_PER_READ, columns=columns)


def _alive(plan: _Plan, k: int, i: int, column: str) -> tuple[np.ndarray, pa.Array]:
    """(ids, `column`) of part i's rows that the ops before op k kept."""
    gone = np.concatenate(
        [np.zeros(0, np.uint64)]
        + [sh.gather([plan.drops(j)], "drops", _part_unit(i), DROPS).column("id").to_numpy() for j in range(k)]
    )
    ids, vals = [], []
    for b in _scan(plan, i, ["doc_id", column]):
        bid = _ids(b.column(0))
        keep = ~np.isin(bid, gone)
        ids.append(bid[keep])
        vals.append(b.column(1).filter(pa.array(keep)))
    typ = pq.ParquetFile(plan.part(i)).schema_arrow.field(column).type
    return np.concatenate([np.zeros(0, np.uint64)] + ids), pa.concat_arrays([pa.array([], typ)] + vals)


def _lookup(plan: _Plan, i: int, ids: np.ndarray, column: str) -> pa.Array:
    """Part i's `column` for the doc ids `ids` (any order, repeats allowed), in that order: one
    streamed read keeping only those rows."""
    want = np.unique(ids)
    got_ids, got = [np.zeros(0, np.uint64)], []
    for b in _scan(plan, i, ["doc_id", column]):
        bid = _ids(b.column(0))
        m = np.isin(bid, want)
        got_ids.append(bid[m])
        got.append(b.column(1).filter(pa.array(m)))
    typ = pq.ParquetFile(plan.part(i)).schema_arrow.field(column).type
    gid, vals = np.concatenate(got_ids), pa.concat_arrays([pa.array([], typ)] + got)
    order = np.argsort(gid)
    pos = np.searchsorted(gid[order], ids)
    if len(ids) and (pos.max() >= len(gid) or (gid[order][pos] != ids).any()):
        raise DataError(
            f"{plan.part(i)} lost rows between dedup rounds; delete {Path(plan.work) / 'dedup'} and run again"
        )
    return vals.take(pa.array(order[pos]))


def _sigs(arr: pa.Array, num_perm: int) -> np.ndarray:
    """(N, num_perm) uint32 from a fixed-size-list column."""
    return pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.uint32).reshape(-1, num_perm)


def _bucket(ids: np.ndarray, buckets: int) -> np.ndarray:
    return (ids % np.uint64(buckets)).astype(np.int64)  # ids are SHA-1 bits: uniform already


def _part_unit(i: int) -> str:
    return f"p{i:05d}"


def _parts_units(plan: _Plan) -> list[str]:
    return [_part_unit(i) for i in range(len(plan.parts))]


def _bucket_units(plan: _Plan) -> list[str]:
    return [f"b{r:05d}" for r in range(plan.buckets)]


def _dests(table: pa.Table, dest: np.ndarray, prefix: str) -> dict[str, pa.Table]:
    return {(f"{prefix}{int(name[len(prefix) :]):05d}"): t for name, t in sh.split(table, dest, prefix).items()}


# ---- exact dedup ------------------------------------------------------------------------------


def _exact(plan: _Plan, k: int, runner: _Runner):
    runner.run(plan.stage(k, "map"), _parts_units(plan), _exact_map, plan=plan, k=k)
    yield "map", None
    runner.run(plan.stage(k, "reduce"), _bucket_units(plan), _exact_reduce, plan=plan, k=k)
    yield "reduce", "dropped"


def _exact_map(unit: str, plan: _Plan, k: int):
    i = int(unit[1:])
    ids, keys = _alive(plan, k, i, f"key.{plan.ops[k].name}")
    crc = np.fromiter((zlib.crc32(s.encode()) for s in keys.to_pylist()), np.uint32, len(ids))
    t = pa.table({"id": ids, "key": keys.cast(pa.string()), "part": np.full(len(ids), i, np.int32)}, schema=KEYS)
    return {"keys": _dests(t, crc.astype(np.int64) % plan.buckets, "b")}, {"rows": len(ids)}


def _exact_reduce(unit: str, plan: _Plan, k: int):
    t = sh.gather([plan.stage(k, "map")], "keys", unit, KEYS).sort_by([("key", "ascending"), ("id", "ascending")])
    keys, ids = t.column("key"), t.column("id").to_numpy()
    first = np.ones(len(ids), dtype=bool)
    if len(ids) > 1:
        first[1:] = pc.not_equal(keys.slice(1), keys.slice(0, len(ids) - 1)).to_numpy(zero_copy_only=False)
    keeper = ids[np.flatnonzero(first)][np.cumsum(first) - 1]  # (N,) the lowest id holding each row's key
    gone = np.flatnonzero(~first)
    drops = pa.table(
        {
            "id": ids[gone],
            "cluster": keeper[gone],
            "partner": keeper[gone],
            "sim": np.full(len(gone), np.nan),
            "exact": np.ones(len(gone), bool),
        },
        schema=DROPS,
    )
    parts = t.column("part").to_numpy()[gone]
    return {"drops": _dests(drops, parts, "p")}, {"dropped": len(gone)}


# ---- MinHash dedup: candidates and verification -------------------------------------------------


def _minhash(plan: _Plan, k: int, runner: _Runner):
    for name, fn, units, count in (
        ("bands", _bands, _parts_units, None),
        ("cand", _cand, _bucket_units, None),
        ("siga", _siga, _parts_units, "candidates"),
        ("est", _est, _parts_units, None),
        ("exact", _exact_jaccard, _parts_units, None),
    ):
        runner.run(plan.stage(k, name), units(plan), fn, plan=plan, k=k)
        yield name, count
    c = runner.counters
    c[plan.stage(k, "verified")] = {
        "verified": c[plan.stage(k, "est")]["verified"] + c[plan.stage(k, "exact")]["verified"]
    }
    yield "verified", "verified"
    rounds = []
    for r in range(MAX_CC_ROUNDS):
        stage = plan.stage(k, "cc") / f"r{r:03d}"
        rounds.append(runner.run(stage, _bucket_units(plan), _cc_round, plan=plan, k=k, r=r)["changes"])
        yield f"cc/r{r:03d}", None
        if r % 2 and rounds[-1] == 0 and rounds[-2] == 0:
            break
    else:
        raise DataError(
            f"connected components of {plan.ops[k].name} did not converge in {MAX_CC_ROUNDS} rounds; "
            "this is a raypai bug, report it"
        )
    runner.run(plan.stage(k, "decide"), _parts_units(plan), _decide, plan=plan, k=k, last=r)
    yield "decide", "dropped"


def _bands(unit: str, plan: _Plan, k: int):
    i, op = int(unit[1:]), plan.ops[k]
    ids, col = _alive(plan, k, i, f"key.{op.name}")
    sigs = _sigs(col, op.num_perm)
    valid = (sigs != np.iinfo(np.uint32).max).any(axis=1)  # texts without shingles are nobody's duplicate
    ids, keys = ids[valid], op.band_keys(sigs[valid])  # (N, bands)
    n, nb = keys.shape
    band = np.tile(np.arange(nb, dtype=np.uint32), n)
    t = pa.table(
        {"band": band, "key": keys.reshape(-1), "id": np.repeat(ids, nb), "part": np.full(n * nb, i, np.int32)},
        schema=BANDS,
    )
    with np.errstate(over="ignore"):
        mixed = keys.reshape(-1) + band.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return {"bands": _dests(t, _bucket(mixed, plan.buckets), "b")}, {"rows": n}


def _cand(unit: str, plan: _Plan, k: int):
    """Candidate pairs of one bucket: as `minhash.candidate_pairs`, per (band, key) bucket sorted by
    doc id, each member pairs with the first `fanout` members before it."""
    t = sh.gather([plan.stage(k, "bands")], "bands", unit, BANDS)
    band, key, ids, part = (t.column(c).to_numpy() for c in ("band", "key", "id", "part"))
    order = np.lexsort((ids, key, band))
    band, key, ids, part = band[order], key[order], ids[order], part[order]
    new = np.ones(len(ids), dtype=bool)
    new[1:] = (band[1:] != band[:-1]) | (key[1:] != key[:-1])
    start = np.maximum.accumulate(np.where(new, np.arange(len(ids)), 0))  # bucket's first position
    rank = np.arange(len(ids)) - start
    a, b = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for m in range(plan.ops[k].fanout):
        sel = np.flatnonzero(rank > m)
        a.append(start[sel] + m)
        b.append(sel)
    a, b = np.concatenate(a), np.concatenate(b)
    pairs = _distinct(pa.table({"a": ids[a], "b": ids[b], "pa": part[a], "pb": part[b]}, schema=PAIRS))
    return {"cand": _dests(pairs, pairs.column("pa").to_numpy(), "p")}, {"pairs": pairs.num_rows}


def _distinct(pairs: pa.Table) -> pa.Table:
    """Rows with distinct (a, b), sorted by (a, b)."""
    a, b = pairs.column("a").to_numpy(), pairs.column("b").to_numpy()
    order = np.lexsort((b, a))
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = (a[order][1:] != a[order][:-1]) | (b[order][1:] != b[order][:-1])
    return pairs.take(pa.array(order[keep]))


def _siga(unit: str, plan: _Plan, k: int):
    i, op = int(unit[1:]), plan.ops[k]
    pairs = _distinct(sh.gather([plan.stage(k, "cand")], "cand", unit, PAIRS))
    sig_a = _lookup(plan, i, pairs.column("a").to_numpy(), f"key.{op.name}")
    t = pairs.append_column("sig_a", sig_a)
    return {"siga": _dests(t, pairs.column("pb").to_numpy(), "p")}, {"candidates": pairs.num_rows}


def _siga_schema(op) -> pa.Schema:
    return PAIRS.append(pa.field("sig_a", pa.list_(pa.uint32(), op.num_perm)))


def _est(unit: str, plan: _Plan, k: int):
    """The signature estimate of each candidate whose higher id lives in this part; pairs far from
    the threshold are decided (as `minhash.verify`), near ones go on with this side's text."""
    i, op = int(unit[1:]), plan.ops[k]
    t = sh.gather([plan.stage(k, "siga")], "siga", unit, _siga_schema(op))
    sig_b = _sigs(_lookup(plan, i, t.column("b").to_numpy(), f"key.{op.name}"), op.num_perm)
    est = (_sigs(t.column("sig_a"), op.num_perm) == sig_b).mean(axis=1)  # as minhash.estimate_jaccard
    near = mh.needs_exact(est, op.threshold, op.verify_margin)
    ok = ~near & (est >= op.threshold)
    pairs = t.select(PAIRS.names)
    out = _edges(pairs.filter(pa.array(ok)), est[ok], exact=False, plan=plan)
    far = pairs.filter(pa.array(near))
    text_b = _lookup(plan, i, far.column("b").to_numpy(), "text")
    near_t = far.append_column("est", pa.array(est[near])).append_column("text_b", text_b.cast(pa.large_string()))
    out["near"] = _dests(near_t, far.column("pa").to_numpy(), "p")
    return out, {"verified": int(ok.sum()), "near": int(near.sum())}


def _exact_jaccard(unit: str, plan: _Plan, k: int):
    """Exact shingle Jaccard of the near-threshold candidates whose lower id lives in this part."""
    i, op = int(unit[1:]), plan.ops[k]
    t = sh.gather([plan.stage(k, "est")], "near", unit, NEAR)
    text_a = _lookup(plan, i, t.column("a").to_numpy(), "text")
    sim = np.zeros(t.num_rows)
    for lo in range(0, t.num_rows, EXACT_CHUNK):
        n = min(EXACT_CHUNK, t.num_rows - lo)
        texts = pa.concat_arrays(
            [text_a.slice(lo, n).cast(pa.large_string()), t.column("text_b").slice(lo, n).combine_chunks()]
        )
        h, off = op.shingles(texts)
        sim[lo : lo + n] = mh.exact_jaccard(h, off, np.stack([np.arange(n), n + np.arange(n)], axis=1))
    ok = sim >= op.threshold
    out = _edges(t.select(PAIRS.names).filter(pa.array(ok)), sim[ok], exact=True, plan=plan)
    return out, {"verified": int(ok.sum())}


def _edges(pairs: pa.Table, sim: np.ndarray, *, exact: bool, plan: _Plan) -> dict:
    """Verified edges, addressed to the parts of both ends ("edges", for `decide`) and, as arcs in
    both directions, to the buckets of their sources ("cc", for the first component round)."""
    a, b = pairs.column("a").to_numpy(), pairs.column("b").to_numpy()
    pa_, pb = pairs.column("pa").to_numpy(), pairs.column("pb").to_numpy()
    e = pa.table({"a": a, "b": b, "sim": sim, "exact": np.full(len(a), exact)}, schema=EDGES)
    other = pb != pa_
    to_parts = pa.concat_tables([e, e.filter(pa.array(other))])
    arcs = cc.both_ways(a, b, pa_, pb)
    return {
        "edges": _dests(to_parts, np.concatenate([pa_, pb[other]]), "p"),
        "cc": _dests(arcs, _bucket(arcs.column("src").to_numpy(), plan.buckets), "b"),
    }


# ---- MinHash dedup: connected components and decisions ---------------------------------------


def _cc_round(unit: str, plan: _Plan, k: int, r: int):
    """One large-star (even r) or small-star (odd r) round (`raypai.data._components`) over the
    arcs whose source hashes to this bucket; the small-star rounds also send their leaves' labels
    to the parts holding them (final once a round pair has converged)."""
    src_stages = [plan.stage(k, "est"), plan.stage(k, "exact")] if r == 0 else [plan.stage(k, "cc") / f"r{r - 1:03d}"]
    arcs = sh.gather(src_stages, "cc", unit, cc.ARCS)
    out: dict = {}
    if r % 2 == 0:
        new, changes = cc.large_star(arcs)
    else:
        new, changes, leaves = cc.small_star(arcs)
        out["labels"] = _dests(leaves.select(LABELS.names), leaves.column("part").to_numpy(), "p")
    out["cc"] = _dests(new, _bucket(new.column("src").to_numpy(), plan.buckets), "b")
    return out, {"changes": changes}


def _decide(unit: str, plan: _Plan, k: int, last: int):
    """This part's removed rows: each leaf of a converged star, with its keeper (the centre) and
    its best verified pair, chosen as `MinHashDedup.find` does."""
    labels = sh.gather([plan.stage(k, "cc") / f"r{last:03d}"], "labels", unit, LABELS)
    e = sh.gather([plan.stage(k, "est"), plan.stage(k, "exact")], "edges", unit, EDGES)
    a, b, sim, ex = (e.column(c).to_numpy(zero_copy_only=False) for c in ("a", "b", "sim", "exact"))
    node, partner = np.concatenate([a, b]), np.concatenate([b, a])
    side = np.concatenate([np.zeros(len(a), np.int8), np.ones(len(a), np.int8)])  # 0: partner above
    sim2, ex2 = np.concatenate([sim, sim]), np.concatenate([ex, ex])
    order = np.lexsort((partner, side, -sim2, node))
    node, partner, sim2, ex2 = node[order], partner[order], sim2[order], ex2[order]
    best = np.ones(len(node), dtype=bool)
    best[1:] = node[1:] != node[:-1]
    node, partner, sim2, ex2 = node[best], partner[best], sim2[best], ex2[best]
    ids = labels.column("id").to_numpy()
    pos = np.searchsorted(node, ids)
    if len(ids) and (pos.max() >= len(node) or (node[pos] != ids).any()):
        raise DataError("a removed document has no verified edge; this is a raypai bug, report it")
    drops = pa.table(
        {"id": ids, "cluster": labels.column("cluster"), "partner": partner[pos], "sim": sim2[pos], "exact": ex2[pos]},
        schema=DROPS,
    )
    return {"drops": {unit: drops}}, {"dropped": len(ids)}


# ---- final write ----------------------------------------------------------------------------


def _write(unit: str, plan: _Plan):
    """Stream part i once: its kept rows to dedup/kept/<part>, its drop records (with text) to
    dedup/dropped/<part>; both via a temporary file renamed in place."""
    i = int(unit[1:])
    decided = [sh.gather([plan.drops(k)], "drops", unit, DROPS) for k in range(len(plan.ops))]
    op_of = np.concatenate([np.zeros(0, np.int64)] + [np.full(d.num_rows, k) for k, d in enumerate(decided)])
    d = pa.concat_tables(decided)
    order = np.argsort(d.column("id").to_numpy())
    gone_ids, op_of, d = d.column("id").to_numpy()[order], op_of[order], d.take(pa.array(order))
    src = pq.ParquetFile(plan.part(i))
    keep_cols = [c for c in src.schema_arrow.names if not c.startswith("key.")]
    root, name = Path(plan.work) / "dedup", plan.parts[i]
    tag = uuid.uuid4().hex  # a task of a killed run may still be writing its own temporaries
    tmp_kept, tmp_drop = root / "kept" / f".tmp-{name}-{tag}", root / "dropped" / f".tmp-{name}-{tag}"
    records, kept = [], 0
    with pq.ParquetWriter(tmp_kept, pa.schema([src.schema_arrow.field(c) for c in keep_cols])) as writer:
        for batch in _scan(plan, i, src.schema_arrow.names):
            bid = _ids(batch.column(batch.schema.get_field_index("doc_id")))
            gone = np.isin(bid, gone_ids)
            rows = pa.Table.from_batches([batch]).select(keep_cols)
            writer.write_table(rows.filter(pa.array(~gone)))
            kept += int((~gone).sum())
            if gone.any():
                records.append(_records(rows.filter(pa.array(gone)), bid[gone], gone_ids, op_of, d, plan))
    pq.write_table(pa.concat_tables(records) if records else DROP_SCHEMA.empty_table(), tmp_drop)
    os.replace(tmp_kept, root / "kept" / name)
    os.replace(tmp_drop, root / "dropped" / name)
    return {}, {"kept": kept, "dropped": sum(r.num_rows for r in records)}


def _records(rows: pa.Table, ids: np.ndarray, gone_ids, op_of, d: pa.Table, plan: _Plan) -> pa.Table:
    """Drop records (clean's DROP_SCHEMA) of `rows`, whose doc ids `ids` are all in `gone_ids`."""
    pos = np.searchsorted(gone_ids, ids)
    cluster = _hex(d.column("cluster").to_numpy()[pos])
    partner = _hex(d.column("partner").to_numpy()[pos])
    sim, ex = d.column("sim").to_numpy(zero_copy_only=False)[pos], d.column("exact").to_numpy(zero_copy_only=False)[pos]
    ops = [plan.ops[k] for k in op_of[pos].tolist()]
    reasons = [
        f"duplicate of {c}"
        if isinstance(op, ExactDedup)
        else f"near-duplicate of {p} (Jaccard {s:.3f}, {'exact' if e else 'MinHash estimate'}); cluster kept {c}"
        for op, c, p, s, e in zip(ops, cluster, partner, sim.tolist(), ex.tolist())
    ]
    stat = [None if isinstance(op, ExactDedup) else s for op, s in zip(ops, sim.tolist())]
    return pa.table(
        {
            "doc_id": rows.column("doc_id"),
            "source": rows.column("source"),
            "op": [op.name for op in ops],
            "reason": reasons,
            "stat": pa.array(stat, pa.float64()),
            "cluster_id": cluster,
            "text": rows.column("text"),
        },
        schema=DROP_SCHEMA,
    )
