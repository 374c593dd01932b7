"""Distributed, resumable dedup (raypai.data._dedup) on real Ray: the same drops and keepers as
the driver-side dedup clean once ran (tests/data/_oracles.py), and byte-identical outputs after a
SIGKILL of the driver."""

import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from raypai.data import clean, ingest, synth
from raypai.data._dedup import FAULTS_ENV, DedupFaults, run_dedup
from raypai.data.clean import DROP_SCHEMA
from raypai.data.ops.dedup import ExactDedup, MinHashDedup
from raypai.data.recipe import is_dedup, load_recipe
from raypai.data.synth import jaccard, prose
from raypai.errors import DataError

from ._oracles import driver_side_dedup

FILES = 4
BUCKETS = 3
CHAINS, LINKS = 3, 6


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    """The test process's shared local Ray (tests/conftest.py) with 4 CPUs."""
    return shared_ray(num_cpus=4)


def _chain(rng: random.Random, c: int) -> list[str]:
    """LINKS texts, each the previous with 4 more words replaced (fresh positions, 6 words apart):
    neighbours share ≥ 0.82 of their word 5-grams, texts two links apart ≤ 0.75 (not duplicates)."""
    words = prose(rng, 12).replace("\n\n", " ").split(" ")
    out = [" ".join(words)]
    for k in range(1, LINKS):
        for m in range(4):
            words[5 + 6 * (4 * (k - 1) + m)] = f"chainword{c}x{k}x{m}"
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ray_local):
    """The synthetic corpus (exact and near duplicates, near misses) in 4 parts, plus chains of near
    duplicates A~B~C... whose links lie in different parts; filtered by clean (its work folder's
    kept/<part> is the dedup input)."""
    root = tmp_path_factory.mktemp("dedup")
    synth(root / "raw", docs=1200, files=FILES, seed=11)
    rng = random.Random(5)
    chains = [_chain(rng, c) for c in range(CHAINS)]
    for c, chain in enumerate(chains):
        for k, text in enumerate(chain):
            with open(root / "raw" / f"raw-{(c + k) % FILES:03d}.jsonl", "a") as f:
                f.write(json.dumps({"text": text, "chain": f"{c}.{k}"}) + "\n")
    ingest(root / "raw", root / "ingested")
    clean(root / "ingested", root / "clean", work_dir=root / "work", progress=lambda *a: None)
    parts = [p["file"] for p in json.loads((root / "ingested" / "manifest.json").read_text())["parts"]]
    ops = [op for op in load_recipe("default") if is_dedup(op)]
    stats = run_dedup(root / "work", parts, ops, buckets=BUCKETS, progress=lambda m: None)
    return root, parts, ops, stats, chains


def _reference(work: Path, parts: list[str], ops: list) -> tuple[pa.Table, pa.Table]:
    """The driver-side dedup (the oracle) over the same filtered rows: (kept rows, drop records)."""
    kept = pa.concat_tables([pq.read_table(work / "kept" / p) for p in parts]).sort_by("doc_id")
    dropped = []
    for op in ops:
        kept, gone = driver_side_dedup(kept, op)
        dropped.append(gone)
    return kept, pa.concat_tables(dropped)


def _outputs(work: Path, parts: list[str], kind: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(work / "dedup" / kind / p) for p in parts])


def _digests(work: Path) -> dict[str, str]:
    return {
        f"{kind}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
        for kind in ("kept", "dropped")
        for p in sorted((work / "dedup" / kind).iterdir())
    }


def test_same_drops_and_keepers_as_the_driver_side_dedup(corpus):
    root, parts, ops, stats, chains = corpus
    work = root / "work"
    ref_kept, ref_dropped = _reference(work, parts, ops)
    dropped = _outputs(work, parts, "dropped")
    assert dropped.schema == DROP_SCHEMA
    # every drop record (op, keeper, best pair, similarity, reason, text) equal to the reference's
    assert dropped.sort_by("doc_id").to_pylist() == ref_dropped.sort_by("doc_id").to_pylist()
    kept = _outputs(work, parts, "kept")
    assert (
        kept.sort_by("doc_id").to_pylist()
        == ref_kept.drop_columns([c for c in ref_kept.column_names if c.startswith("key.")]).to_pylist()
    )
    by_op = {op.name: sum(r["op"] == op.name for r in dropped.to_pylist()) for op in ops}
    assert stats["dropped"] == by_op and by_op["exact_dedup"] >= 50 and by_op["minhash_dedup"] >= 50, by_op
    assert stats["kept"] == kept.num_rows and stats["candidates"]["minhash_dedup"] > stats["verified"]["minhash_dedup"]

    # each part's outputs hold that part's rows only
    for p in parts:
        own = set(pq.read_table(work / "kept" / p).column("doc_id").to_pylist())
        out = pq.read_table(work / "dedup" / "kept" / p).column("doc_id").to_pylist()
        gone = pq.read_table(work / "dedup" / "dropped" / p).column("doc_id").to_pylist()
        assert set(out) | set(gone) == own and not set(out) & set(gone)

    # the chains: links are verified pairs, texts two links apart are not (J < 0.8), yet the whole
    # chain is one cluster kept by its lowest doc id, across parts
    rows = {r["text"]: r for r in dropped.to_pylist()} | {r["text"]: r for r in kept.to_pylist()}
    for chain in chains:
        assert min(jaccard(a, b) for a, b in zip(chain, chain[1:])) >= 0.82
        assert max(jaccard(a, b) for a, b in zip(chain, chain[2:])) < 0.8
        ids = sorted(rows[t]["doc_id"] for t in chain)
        assert len({rows[t]["source"].split(":")[0] for t in chain}) == FILES
        survivors = [t for t in chain if "op" not in rows[t]]
        assert [rows[t]["doc_id"] for t in survivors] == [ids[0]]
        assert all(rows[t]["cluster_id"] == ids[0] for t in chain if t not in survivors)
        # some member's best pair is not the keeper: it joined the cluster through the chain
        assert any(f"near-duplicate of {ids[0]} " not in rows[t]["reason"] for t in chain if t not in survivors)
    assert stats["cc_rounds"]["minhash_dedup"] >= 4


_DRIVER = """
import json, sys
import ray
from raypai.data._dedup import run_dedup
from raypai.data.recipe import is_dedup, load_recipe
ray.init(address=sys.argv[1], log_to_driver=False)
run_dedup(sys.argv[2], json.loads(sys.argv[3]), [op for op in load_recipe("default") if is_dedup(op)],
          buckets=int(sys.argv[4]), progress=lambda m: None)
"""


def _settled(work: Path) -> list[Path]:
    """The committed units, once no task of the killed driver is still committing (unchanged for 2 s).
    A `.tmp-*` folder is not a unit: it is what a task killed with its driver left before its rename,
    and the resumed run clears it (counting it made the test fail on the vanished file, seen once)."""
    seen, since = None, time.monotonic()
    while time.monotonic() - since < 2:
        now = sorted(
            m for m in (work / "dedup").glob("**/meta.json") if not any(part.startswith(".tmp-") for part in m.parts)
        )
        if now != seen:
            seen, since = now, time.monotonic()
        time.sleep(0.2)
    return seen


# units before the components (4 parts, 3 buckets): exact map 4, reduce 3; bands 4, cand 3, siga 4, est 4, exact 4
BEFORE_CC = 26


@pytest.mark.parametrize("where", ["exact map", "signature join", "components", "final write"])
def test_sigkill_of_the_driver_resumes_to_identical_outputs(corpus, tmp_path, where):
    """The dedup driver runs in its own process joined to this Ray and SIGKILLs itself once a given
    number of units are committed (RAYPAI_DEDUP_FAULTS); a resumed run in this process skips the
    committed rounds and units and writes byte-identical outputs to the uninterrupted run's."""
    root, parts, ops, stats, _ = corpus
    rounds = stats["cc_rounds"]["minhash_dedup"]
    kill_after = {
        "exact map": 2,
        "signature join": 17,
        "components": BEFORE_CC + 3 * 2 + 1,
        "final write": BEFORE_CC + 3 * rounds + 4 + 2,
    }[where]
    assert stats["units_run"] == BEFORE_CC + 3 * rounds + 4 + 4
    work = tmp_path / "work"
    shutil.copytree(root / "work" / "kept", work / "kept")
    env = os.environ | {FAULTS_ENV: json.dumps({"kill_after_units": kill_after})}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _DRIVER,
            ray.get_runtime_context().gcs_address,
            str(work),
            json.dumps(parts),
            str(BUCKETS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (work / "dedup" / "_DONE.json").exists()
    units = _settled(work)
    assert len(units) >= kill_after  # committed before the kill (a task in flight may add some)
    before = {p: p.stat().st_mtime_ns for p in units}

    resumed = run_dedup(work, parts, ops, buckets=BUCKETS, progress=lambda m: None)
    assert {p: p.stat().st_mtime_ns for p in units} == before, "committed units were redone"
    assert resumed["units_run"] == stats["units_run"] - len(units)
    assert _digests(work) == _digests(root / "work")
    assert {k: v for k, v in resumed.items() if k not in ("seconds", "write_seconds", "units_run")} == {
        k: v for k, v in stats.items() if k not in ("seconds", "write_seconds", "units_run")
    }
    # a finished run is not redone
    assert run_dedup(work, parts, ops, buckets=BUCKETS, progress=lambda m: None)["units_run"] == 0


@pytest.mark.parametrize("unit", ["1-minhash_dedup/est/p00001", "1-minhash_dedup/cc/r001/b00002", "write/p00003"])
def test_sigkill_of_a_worker_is_retried_to_identical_outputs(corpus, tmp_path, monkeypatch, unit):
    """A worker SIGKILLed after writing its unit's temporary folder, before the rename: Ray retries
    the task, the half-written folder is discarded, the outputs are byte-identical."""
    root, parts, ops, stats, _ = corpus
    work = tmp_path / "work"
    shutil.copytree(root / "work" / "kept", work / "kept")
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"kill_worker_in": unit}))
    again = run_dedup(work, parts, ops, buckets=BUCKETS, progress=lambda m: None)
    stage, name = unit.rsplit("/", 1)
    assert (work / "dedup" / stage / f".killed-{name}").exists(), "the fault did not fire"
    assert again["units_run"] == stats["units_run"]
    assert _digests(work) == _digests(root / "work")
    assert not list((work / "dedup").glob("**/.tmp-*"))


@pytest.mark.parametrize("seed", range(6))
def test_star_rounds_find_the_components_with_their_lowest_ids(seed):
    """Large-star / small-star rounds (in one process: each round is local to a node's arcs) on a
    random graph with long chains, trees and random edges over random uint64 ids: at convergence
    every node but its component's lowest id is a leaf labelled with that id (the reference is a
    union-find); the rounds stay within the O(log² n) the paper proves."""
    from raypai.data import _components as cc
    from raypai.data.ops.dedup import UnionFind

    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 2**63, size=700, dtype=np.uint64) * np.uint64(2) + np.uint64(1))[:600]
    ids = ids[rng.permutation(len(ids))]  # distinct odd ids ≥ 2^32 on average: the full uint64 range
    perm = rng.permutation(len(ids))
    edges = [(perm[i], perm[i + 1]) for i in range(199)]  # a chain of 200 nodes
    edges += [(perm[200 + i], perm[200 + rng.integers(0, i)]) for i in range(1, 200)]  # a random tree
    edges += [tuple(rng.integers(400, 600, size=2)) for _ in range(120)]  # random edges, some isolated nodes
    edges = [(a, b) for a, b in edges if a != b]
    a, b = ids[[e[0] for e in edges]], ids[[e[1] for e in edges]]
    uf = UnionFind()
    for x, y in zip(a.tolist(), b.tolist()):
        uf.union(x, y)
    part = (ids % 7).astype(np.int32)  # a node's part travels with it
    part_of = dict(zip(ids.tolist(), part.tolist()))
    arcs = cc.both_ways(
        a, b, np.array([part_of[x] for x in a.tolist()], np.int32), np.array([part_of[x] for x in b.tolist()], np.int32)
    )
    changes, leaves = [], None
    for r in range(200):
        if r % 2 == 0:
            arcs, n = cc.large_star(arcs)
        else:
            arcs, n, leaves = cc.small_star(arcs)
        changes.append(n)
        if r % 2 and changes[-1] == changes[-2] == 0:
            break
    got = {x: (c, p) for x, c, p in zip(*(leaves.column(k).to_pylist() for k in ("id", "cluster", "part")))}
    want = {x: uf.find(x) for x in uf.parent if uf.find(x) != x}
    assert {x: c for x, (c, _) in got.items()} == want
    assert all(p == part_of[x] for x, (_, p) in got.items())
    assert 4 <= len(changes) <= 2 * (math.log2(len(ids)) ** 2), len(changes)


def test_star_rounds_on_a_bucket_with_no_arcs():
    """A bucket that received no arcs (a corpus with few duplicates, many buckets) gives empty
    rounds, no changes and no leaves, not an error."""
    from raypai.data import _components as cc

    arcs = cc.ARCS.empty_table()
    out, n = cc.large_star(arcs)
    assert out.num_rows == 0 and n == 0
    out, n, leaves = cc.small_star(arcs)
    assert out.num_rows == 0 and n == 0 and leaves.num_rows == 0


def test_single_ops_empty_part_and_plan_change(tmp_path, ray_local, corpus):
    """A recipe with MinHash dedup only, a part with no rows, and a changed bucket count (the old
    rounds are discarded, the result is the same)."""
    root, parts, _, _, _ = corpus
    work = tmp_path / "work"
    shutil.copytree(root / "work" / "kept", work / "kept")
    empty = pq.read_table(work / "kept" / parts[0]).slice(0, 0)
    pq.write_table(empty, work / "kept" / "empty.parquet")
    parts = parts + ["empty.parquet"]
    ops = [MinHashDedup()]
    ref_kept, ref_dropped = _reference(work, parts, ops)
    for buckets in (2, 5):
        stats = run_dedup(work, parts, ops, buckets=buckets, progress=lambda m: None)
        assert stats["buckets"] == buckets and stats["units_run"] > 0
        dropped = _outputs(work, parts, "dropped")
        assert dropped.sort_by("doc_id").to_pylist() == ref_dropped.sort_by("doc_id").to_pylist()
        assert (
            sorted(_outputs(work, parts, "kept").column("doc_id").to_pylist()) == ref_kept.column("doc_id").to_pylist()
        )
    assert pq.read_table(work / "dedup" / "kept" / "empty.parquet").num_rows == 0
    assert pq.read_table(work / "dedup" / "dropped" / "empty.parquet").schema == DROP_SCHEMA


def test_bad_inputs_are_refused_with_the_fix(tmp_path, ray_local, corpus):
    root, parts, _, _, _ = corpus
    with pytest.raises(DataError, match=r"dedup input missing: .*nowhere.*run clean's filter pass"):
        run_dedup(tmp_path, ["nowhere.parquet"], [ExactDedup()])
    with pytest.raises(DataError, match="exact_dedup/minhash_dedup ops only"):
        run_dedup(tmp_path, [], [load_recipe(["word_count"])[0]])
    t = pq.read_table(root / "work" / "kept" / parts[0]).slice(0, 5)
    (tmp_path / "kept").mkdir()
    pq.write_table(t.set_column(0, "doc_id", pa.array(["doc-1"] * 5)), tmp_path / "kept" / "x.parquet")
    with pytest.raises(DataError, match=r"ingest's doc ids .*re-ingest.*'doc-1'"):
        run_dedup(tmp_path, ["x.parquet"], [ExactDedup()], progress=lambda m: None)
    good = pq.read_table(root / "work" / "kept" / parts[0]).slice(0, 50)
    pq.write_table(good.drop_columns(["key.minhash_dedup"]), tmp_path / "kept" / "y.parquet")
    with pytest.raises(DataError, match=r"lacks columns \{'y.parquet': \['key.minhash_dedup'\]\}.*same dedup ops"):
        run_dedup(tmp_path, ["y.parquet"], [ExactDedup(), MinHashDedup()], progress=lambda m: None)
    # a unit that fails (here: a signature column of the wrong width) names its round; the rest is kept
    sigs = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(50 * 3, np.uint32)), 3)
    pq.write_table(
        good.set_column(good.schema.get_field_index("key.minhash_dedup"), "key.minhash_dedup", sigs),
        tmp_path / "kept" / "z.parquet",
    )
    with pytest.raises(DataError, match=r"dedup round 1-minhash_dedup/bands failed.*run again to resume"):
        run_dedup(tmp_path, ["z.parquet"], [ExactDedup(), MinHashDedup()], progress=lambda m: None)
    assert (tmp_path / "dedup" / "0-exact_dedup" / "reduce" / "_DONE.json").exists()
    assert DedupFaults.from_env() == DedupFaults()


def test_the_kill_drills_are_private_not_run_dedup_arguments(monkeypatch):
    import inspect

    assert list(inspect.signature(run_dedup).parameters) == ["work", "parts", "dedup_ops", "buckets", "progress"]
    monkeypatch.setenv(FAULTS_ENV, '{"kill_after": 3}')
    with pytest.raises(ValueError, match=r"unknown keys \['kill_after'\]"):
        DedupFaults.from_env()
