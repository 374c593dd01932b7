"""Data cleaning and near-duplicate removal: raypai vs datatrove (and datasketch), same input, same run.

    .venv/bin/python benchmarks/data_clean.py                         # milton paragraphs + 200k synthetic docs
    .venv/bin/python benchmarks/data_clean.py --synthetic-docs 20000 --cpus 2 --skip-milton
    .venv/bin/python benchmarks/data_clean.py --dedup-only --dedup-docs 20000   # MinHash dedup, one core each

Needs the `bench` extra (datatrove + spacy/nltk/orjson) and datasketch, installed without moving
torch: `PIP_CONSTRAINT=.ci/constraints.txt .venv/bin/pip install -e ".[bench]" datasketch`.
Every system runs in its own child process; the parent samples the child's process tree (Ray's
GCS, raylet and workers; datatrove's worker pool) for peak memory (summed RSS and PSS) and CPU
seconds, and prints one JSON line per result with the 1-minute load average before and after (the
machine may be shared).

**Cleaning** ("filters" and "filters+minhash"): identical JSONL files for every system,
`/work/shared/corpora/milton` split into blank-line paragraphs and the valid rows of a
`raypai.data.synth` corpus. Equivalent work:
  raypai-equivalent  pii_redact, gopher_repetition, gopher_quality, fineweb_quality [+ minhash_dedup]
  raypai    unicode_nfc, boilerplate_strip, whitespace/punctuation normalize, pii_redact, word_count,
            mean_word_length, alnum/special ratios, char/word repetition, gopher_repetition,
            flagged_words, language (the default recipe) [+ exact_dedup, minhash_dedup]
  datatrove PIIFormatter, GopherRepetitionFilter, GopherQualityFilter, FineWebQualityFilter
            [+ MinhashDedupSignature/Buckets/Cluster/Filter, 14 buckets × 8 hashes, 5-grams, sha1]
datatrove has no download-free language id or bad-words list, so the default recipe does more work
than datatrove's pipeline; `raypai-equivalent` runs the same four rules (same definitions and
defaults; words are whitespace-split where datatrove uses spaCy's tokenizer; raypai's PII op also
redacts phones and IPv6). raypai's minhash_dedup is its default: threshold 0.8, 21 bands × 6 rows
of 128 hashes, every candidate verified.
`seconds` (and docs/s, MB/s) excludes Ray's start-up (a cluster is normally up already; reported as
`startup_s`) and includes raypai's ingest; `cpu_s` counts everything, start-up included.

**Dedup only** (`--dedup-only`): the valid rows of a synthetic corpus (with its planted near
duplicates, exact copies and near misses), MinHash near-duplicate removal on ONE core per system:
  raypai      `MinHashDedup().find(texts)`: shingles, signatures, LSH, verification, union-find
  datasketch  `MinHash(num_perm=128).update_batch` per document + `MinHashLSH(threshold=0.8)`
              query-then-insert (a document matching an earlier one is dropped)
  datatrove   its 4 MinHash stages (14 × 8, 5-grams, sha1) on one task, one worker, JSONL in/out
Truth = the exact word-5-gram Jaccard of every pair (sparse shingle-incidence products, nothing
sampled): recall = of the documents that should go (each cluster of pairs at J ≥ 0.8 keeps one),
the share removed; precision = of the removed documents, the share with a partner at J ≥ 0.8;
`near_misses_kept` = the share of planted near misses (J 0.4–0.7 with their original) kept. `docs_per_s_per_core`
counts the dedup work only (texts already in memory; datatrove's includes its JSONL reading and
writing, which is how it runs); `peak_rss_mb` is the child's peak, `input_rss_mb` its RSS after
loading the texts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MILTON = Path("/work/shared/corpora/milton")


# ----------------------------------------------------------------------------- inputs


def prepare_milton(dst: Path) -> Path:
    """One JSONL file per book, one row per blank-line paragraph (raypai's ingest split)."""
    import pyarrow.parquet as pq

    from raypai.data.ingest import IngestConfig, ingest

    if (dst / "jsonl").exists():
        return dst / "jsonl"
    m = ingest(MILTON, dst / "ing", IngestConfig(text_mode="paragraphs"))
    return _export(dst / "ing", m, dst / "jsonl", pq)


def prepare_synthetic(dst: Path, docs: int) -> Path:
    import pyarrow.parquet as pq

    from raypai.data import ingest, synth

    if (dst / "jsonl").exists():
        return dst / "jsonl"
    synth(dst / "raw", docs=docs, files=16, seed=0)
    m = ingest(dst / "raw", dst / "ing")
    return _export(dst / "ing", m, dst / "jsonl", pq)


def _export(ing: Path, manifest: dict, out: Path, pq) -> Path:
    out.mkdir(parents=True)
    for i, part in enumerate(manifest["parts"]):
        rows = pq.read_table(ing / part["file"], columns=["doc_id", "text"]).to_pylist()
        with open(out / f"in-{i:03d}.jsonl", "w") as fh:
            for r in rows:
                fh.write(json.dumps({"id": r["doc_id"], "text": r["text"]}) + "\n")
    return out


# ----------------------------------------------------------------------------- systems (child side)

# raypai's ops for the same rules datatrove's pipeline applies (its defaults differ in places).
EQUIVALENT_RECIPE = ["pii_redact", "gopher_repetition", "gopher_quality", "fineweb_quality"]


def run_raypai(inp: Path, work: Path, minhash: bool, cpus: int, recipe: list | None = None) -> dict:
    import ray

    from raypai.data import DEFAULT_RECIPE, clean, ingest
    from raypai.runtime import ensure_ray
    from raypai.settings import Settings

    if recipe is None:
        recipe = [op for op in DEFAULT_RECIPE if minhash or op not in ("exact_dedup", "minhash_dedup")]
    t0 = time.perf_counter()
    # a Ray of this run's own (never RAY_ADDRESS or raypai's recorded head): `cpus` is what is compared
    ensure_ray(Settings.load(), local=True, num_cpus=cpus, dashboard=False, log_to_driver=False)
    t1 = time.perf_counter()
    ingest(inp, work / "ing")
    t_ingest = time.perf_counter() - t1
    m = clean(work / "ing", work / "out", recipe, work_dir=work / "w", progress=lambda *_: None)
    t2 = time.perf_counter()
    ray.shutdown()
    # op_seconds: worker time per op summed over batches (manifest `op_stats`), dedup merges included
    return {
        "seconds": t2 - t1,
        "startup_s": t1 - t0,
        "kept": m["rows"],
        "ingest_s": t_ingest,
        "op_seconds": {r["op_name"]: r["seconds"] for r in m["op_stats"]},
    }


def run_datatrove(inp: Path, work: Path, minhash: bool, cpus: int) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    tasks = len(list(inp.glob("*.jsonl")))
    logs = str(work / "logs")
    filtered = work / "filtered"

    def ex(pipeline, name, n, **kw):
        return LocalPipelineExecutor(
            pipeline=pipeline, tasks=n, workers=min(cpus, n), logging_dir=f"{logs}/{name}", skip_completed=False, **kw
        )

    def step_seconds(name: str) -> dict:
        """datatrove's own per-step time (summed over tasks) from LOGS/NAME/stats.json."""
        stats = json.loads((work / "logs" / name / "stats.json").read_text())
        out = {}
        for s in stats:  # a step that never ran has a bare 0 for time_stats
            t = s.get("time_stats")
            key = f"{name}:{re.sub(r' +', ' ', re.sub(r'[^A-Za-z0-9 ]', '', s['name'])).strip()}"
            out[key] = round(float(t["total"] if isinstance(t, dict) else t or 0), 4)
        return out

    t0 = time.perf_counter()
    ex(
        [
            JsonlReader(str(inp)),
            PIIFormatter(),
            GopherRepetitionFilter(),
            GopherQualityFilter(),
            FineWebQualityFilter(),
            JsonlWriter(str(filtered)),
        ],
        "filter",
        tasks,
    ).run()
    if minhash:
        # datatrove 0.10's default xxhash path passes str, which xxhash ≥ 4 refuses; its sha1 option works.
        cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, hash_config=HashConfig(hash_fc="sha1"))
        ex(
            [JsonlReader(str(filtered)), MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg)],
            "sig",
            tasks,
        ).run()
        ex(
            [MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=cfg)],
            "buckets",
            cfg.num_buckets,
        ).run()
        ex(
            [MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"), config=cfg)],
            "cluster",
            1,
        ).run()
        ex(
            [
                JsonlReader(str(filtered)),
                MinhashDedupFilter(input_folder=str(work / "remove")),
                JsonlWriter(str(work / "final")),
            ],
            "final",
            tasks,
        ).run()
    steps = {}
    for name in ("filter", "sig", "buckets", "cluster", "final") if minhash else ("filter",):
        steps.update(step_seconds(name))
    out = work / ("final" if minhash else "filtered")
    kept = 0
    for f in out.glob("*.jsonl*"):
        import gzip

        with gzip.open(f, "rt") if f.suffix == ".gz" else open(f) as fh:
            kept += sum(1 for _ in fh)
    return {"seconds": time.perf_counter() - t0, "startup_s": 0.0, "kept": kept, "op_seconds": steps}


# ----------------------------------------------------------------------------- dedup only


def prepare_dedup(dst: Path, docs: int) -> Path:
    """`dst/docs.jsonl` ({"id": row, "text"}) of the valid rows of a synthetic corpus, and
    `dst/near_misses.json` ((original row, near-miss row) of each planted near miss)."""
    import pyarrow.parquet as pq

    from raypai.data import ingest, synth

    if (dst / "docs.jsonl").exists():
        return dst
    synth(dst / "raw", docs=docs, files=4, seed=0)
    m = ingest(dst / "raw", dst / "ing")
    rows = [
        r
        for part in m["parts"]
        for r in pq.read_table(dst / "ing" / part["file"], columns=["source", "text"]).to_pylist()
    ]
    row_of = {r["source"]: i for i, r in enumerate(rows)}
    truth = [json.loads(line) for line in open(dst / "raw" / "_ground_truth.jsonl")]
    misses = [(row_of[t["near_miss_of"]], row_of[t["source"]]) for t in truth if t["category"] == "near_miss"]
    with open(dst / "docs.jsonl", "w") as fh:
        for i, r in enumerate(rows):
            fh.write(json.dumps({"id": str(i), "text": r["text"]}) + "\n")
    (dst / "near_misses.json").write_text(json.dumps(misses))
    return dst


def _load_texts(inp: Path) -> list[str]:
    with open(inp / "docs.jsonl") as fh:
        return [json.loads(line)["text"] for line in fh]


def exact_truth(texts: list[str], low: float = 0.8, chunk: int = 2000) -> dict[tuple[int, int], float]:
    """{(i, j): J} for every pair i < j with exact word-5-gram Jaccard ≥ `low`, by sparse products
    of the (documents × distinct shingles) incidence matrix, `chunk` rows at a time."""
    import numpy as np
    from scipy import sparse

    from raypai.data.synth import shingle_set

    ids = [np.unique(np.fromiter((hash(g) for g in shingle_set(t)), dtype=np.int64)) for t in texts]
    _, cols = np.unique(np.concatenate(ids), return_inverse=True)
    sizes = np.array([len(x) for x in ids])
    indptr = np.concatenate([[0], np.cumsum(sizes)])
    m = sparse.csr_matrix((np.ones(len(cols), np.float32), cols, indptr), shape=(len(texts), cols.max() + 1))
    mt = m.T.tocsr()
    out = {}
    for lo in range(0, len(texts), chunk):
        inter = (m[lo : lo + chunk] @ mt).tocoo()  # shared shingles per pair
        i, j, k = inter.row + lo, inter.col, inter.data
        keep = j > i
        i, j, k = i[keep], j[keep], k[keep]
        jac = k / (sizes[i] + sizes[j] - k)
        for a, b, v in zip(i[jac >= low].tolist(), j[jac >= low].tolist(), jac[jac >= low].tolist()):
            out[a, b] = v
    return out


def dedup_scores(n: int, removed: set[int], truth: dict, misses: list) -> dict:
    """Recall (per cluster of J ≥ 0.8 pairs, all but one member should go), precision (a removed
    document has a partner at J ≥ 0.8) and the share of planted near misses (J 0.4–0.7 with their
    original, nothing closer) kept."""
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    partner = set()
    for a, b in truth:
        partner.update((a, b))
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    clusters: dict[int, list[int]] = {}
    for d in partner:
        clusters.setdefault(find(d), []).append(d)
    should = sum(len(c) - 1 for c in clusters.values())
    got = sum(min(len(c) - 1, sum(d in removed for d in c)) for c in clusters.values())
    return {
        "should_remove": should,
        "removed": len(removed),
        "recall": round(got / max(should, 1), 4),
        "precision": round(sum(d in partner for d in removed) / max(len(removed), 1), 4),
        # the rewritten member of each planted pair (its original may rightly go as a copy's duplicate)
        "near_misses_kept": round(sum(b not in removed for _, b in misses) / max(len(misses), 1), 4),
    }


def dedup_raypai(inp: Path, work: Path) -> dict:
    from raypai.data.ops.dedup import MinHashDedup

    texts = _load_texts(inp)
    rss0 = psutil.Process().memory_info().rss
    op = MinHashDedup()
    t0 = time.perf_counter()
    sigs = op.signatures(texts)
    t1 = time.perf_counter()
    d = op.find(texts, sigs)
    t2 = time.perf_counter()
    return {
        "seconds": t2 - t0,
        "signature_s": t1 - t0,
        "removed": d.dropped.tolist(),
        "input_rss": rss0,
        "config": f"threshold 0.8, {op.num_bands}x{op.rows_per_band} of {op.num_perm}, verified",
        "candidates": d.candidates,
        "verified": d.verified,
        "exact_checks": int(d.exact.sum()),
    }


def dedup_datasketch(inp: Path, work: Path) -> dict:
    from datasketch import MinHash, MinHashLSH

    texts = _load_texts(inp)
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    lsh = MinHashLSH(threshold=0.8, num_perm=128)
    removed = []
    for i, text in enumerate(texts):
        words = re.findall(r"\w+", text.lower())  # the shingling raypai and the truth use
        m = MinHash(num_perm=128)
        m.update_batch([" ".join(words[k : k + 5]).encode() for k in range(max(1, len(words) - 4))])
        if lsh.query(m):
            removed.append(i)
        lsh.insert(str(i), m)
    return {
        "seconds": time.perf_counter() - t0,
        "removed": removed,
        "input_rss": rss0,
        "config": f"MinHashLSH threshold 0.8, {lsh.b}x{lsh.r} of 128, unverified",
    }


def dedup_datatrove(inp: Path, work: Path) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    rss0 = psutil.Process().memory_info().rss
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, hash_config=HashConfig(hash_fc="sha1"))

    def ex(pipeline, name, n):
        LocalPipelineExecutor(
            pipeline=pipeline, tasks=n, workers=1, logging_dir=str(work / "logs" / name), skip_completed=False
        ).run()

    t0 = time.perf_counter()
    ex(
        [
            JsonlReader(str(inp), glob_pattern="docs.jsonl"),
            MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg),
        ],
        "sig",
        1,
    )
    ex(
        [MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=cfg)],
        "buckets",
        cfg.num_buckets,
    )
    ex(
        [MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "remove"), config=cfg)],
        "cluster",
        1,
    )
    ex(
        [
            JsonlReader(str(inp), glob_pattern="docs.jsonl"),
            MinhashDedupFilter(input_folder=str(work / "remove")),
            JsonlWriter(str(work / "final")),
        ],
        "final",
        1,
    )
    seconds = time.perf_counter() - t0
    import gzip

    kept = set()
    for f in (work / "final").glob("*.jsonl*"):
        with gzip.open(f, "rt") if f.suffix == ".gz" else open(f) as fh:
            kept.update(int(json.loads(line)["id"]) for line in fh)
    n = sum(1 for _ in open(inp / "docs.jsonl"))
    return {
        "seconds": seconds,
        "removed": sorted(set(range(n)) - kept),
        "input_rss": rss0,
        "config": "14x8 of 112 (sha1), unverified",
    }


DEDUP_SYSTEMS = {"raypai": dedup_raypai, "datasketch": dedup_datasketch, "datatrove": dedup_datatrove}


def measure_dedup(system: str, inp: Path, work: Path, truth: dict, misses: list, n: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child-dedup", system, "--input", str(inp), "--work", str(work)]
    res, sampler, load_before = _run_child(cmd, f"{system} dedup")
    removed = json.loads((work / "result.json").read_text())["removed"]
    secs = res["seconds"]
    return {
        "bench": "data_dedup",
        "system": system,
        "config": res["config"],
        "docs": n,
        "cpus": 1,
        "seconds": round(secs, 2),
        "docs_per_s_per_core": round(n / secs, 1),
        **({"signature_docs_per_s": round(n / res["signature_s"], 1)} if "signature_s" in res else {}),
        **{k: res[k] for k in ("candidates", "verified", "exact_checks") if k in res},
        **dedup_scores(n, set(removed), truth, misses),
        "peak_rss_mb": round(sampler.peak_rss / 2**20),
        "input_rss_mb": round(res["input_rss"] / 2**20),
        "peak_pss_mb": round(sampler.peak_pss / 2**20),
        "cpu_s": round(sampler.cpu_seconds, 1),
        "load1_before": round(load_before, 2),
        "load1_after": round(os.getloadavg()[0], 2),
    }


# ----------------------------------------------------------------------------- parent side


class TreeSampler:
    """Samples a process and all its descendants (Ray's GCS, raylet and workers; datatrove's pool):
    peak summed RSS and PSS (PSS splits shared pages, e.g. Ray's object store, between the
    processes that map them, so its sum does not double-count), and CPU seconds (the last
    user+system time seen for every process; a process's final fraction of a second can be missed)."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak_rss = self.peak_pss = 0
        self.cpu: dict[int, float] = {}

    def sample(self, with_pss: bool) -> None:
        rss = pss = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self.cpu[p.pid] = max(self.cpu.get(p.pid, 0.0), t.user + t.system)
                    rss += p.memory_info().rss
                    if with_pss:
                        pss += p.memory_full_info().pss
            except psutil.Error:
                pass
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values())


def _run_child(cmd: list[str], what: str) -> tuple[dict, TreeSampler, float]:
    """Run a child, sampling its process tree 4 times a second; (its last JSON line, sampler, load)."""
    load_before = os.getloadavg()[0]
    child = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"},
    )
    sampler = TreeSampler(child.pid)

    def sample():
        i = 0
        while child.poll() is None:
            sampler.sample(with_pss=i % 4 == 0)  # PSS reads smaps: once a second is enough
            i += 1
            time.sleep(0.25)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, _ = child.communicate()
    t.join()
    if child.returncode != 0:
        raise SystemExit(f"{what} failed (exit {child.returncode}); rerun the child by hand: {' '.join(cmd)}")
    return json.loads(out.strip().splitlines()[-1]), sampler, load_before


def measure(system: str, corpus: str, inp: Path, work: Path, minhash: bool, cpus: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        system,
        "--input",
        str(inp),
        "--work",
        str(work),
        "--cpus",
        str(cpus),
    ] + (["--minhash"] if minhash else [])
    res, sampler, load_before = _run_child(cmd, f"{system} on {corpus}")
    files = list(inp.glob("*.jsonl"))
    docs = sum(sum(1 for _ in open(f)) for f in files)
    mb = sum(f.stat().st_size for f in files) / 1e6
    secs = res["seconds"]
    config = "filters+minhash" if minhash else "filters"
    return {
        "bench": "data_clean",
        "corpus": corpus,
        "system": system,
        "config": config,
        "docs": docs,
        "mb": round(mb, 2),
        "cpus": cpus,
        "kept": res["kept"],
        "seconds": round(secs, 2),
        "docs_per_s": round(docs / secs, 1),
        "docs_per_s_per_core": round(docs / secs / cpus, 1),
        "mb_per_s": round(mb / secs, 3),
        "mb_per_s_per_core": round(mb / secs / cpus, 4),
        # CPU seconds of the whole process tree, start-up included: robust to other load on the machine
        "cpu_s": round(sampler.cpu_seconds, 1),
        "docs_per_cpu_s": round(docs / max(sampler.cpu_seconds, 1e-9), 1),
        "peak_rss_mb": round(sampler.peak_rss / 2**20),
        "peak_pss_mb": round(sampler.peak_pss / 2**20),
        "startup_s": round(res["startup_s"], 2),
        **({"ingest_s": round(res["ingest_s"], 2)} if "ingest_s" in res else {}),
        "load1_before": round(load_before, 2),
        "load1_after": round(os.getloadavg()[0], 2),
        **({"op_seconds": res["op_seconds"]} if "op_seconds" in res else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic-docs", type=int, default=200_000)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/raypai-bench-data"))
    ap.add_argument("--skip-milton", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--systems", default="raypai,raypai-equivalent,datatrove")
    ap.add_argument("--child", choices=["raypai", "raypai-equivalent", "datatrove"])
    ap.add_argument("--input", type=Path)
    ap.add_argument("--minhash", action="store_true")
    ap.add_argument("--dedup-only", action="store_true", help="only the one-core MinHash dedup comparison")
    ap.add_argument("--dedup-docs", type=int, default=20_000)
    ap.add_argument("--child-dedup", choices=list(DEDUP_SYSTEMS))
    a = ap.parse_args()
    if a.child_dedup:
        res = DEDUP_SYSTEMS[a.child_dedup](a.input, a.work)
        (a.work / "result.json").write_text(json.dumps({"removed": res.pop("removed")}))
        print(json.dumps(res), flush=True)
        return
    if a.dedup_only:
        inp = prepare_dedup(a.work / "inputs" / f"dedup-{a.dedup_docs}", a.dedup_docs)
        texts = _load_texts(inp)
        t0 = time.perf_counter()
        truth = exact_truth(texts)
        misses = json.loads((inp / "near_misses.json").read_text())
        print(
            json.dumps(
                {
                    "bench": "data_dedup_truth",
                    "docs": len(texts),
                    "pairs_at_0.8": len(truth),
                    "near_miss_pairs": len(misses),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
        for system in a.systems.split(",") if a.systems != ap.get_default("systems") else DEDUP_SYSTEMS:
            print(
                json.dumps(measure_dedup(system, inp, a.work / "runs" / f"dedup-{system}", truth, misses, len(texts))),
                flush=True,
            )
        return
    if a.child:
        if a.child == "datatrove":
            res = run_datatrove(a.input, a.work, a.minhash, a.cpus)
        else:
            recipe = EQUIVALENT_RECIPE + ["minhash_dedup"] * a.minhash if a.child == "raypai-equivalent" else None
            res = run_raypai(a.input, a.work, a.minhash, a.cpus, recipe)
        print(json.dumps(res), flush=True)
        return
    corpora = []
    if not a.skip_milton:
        corpora.append(("milton-paragraphs", prepare_milton(a.work / "inputs" / "milton")))
    if not a.skip_synthetic:
        name = f"synthetic-{a.synthetic_docs // 1000}k"
        corpora.append((name, prepare_synthetic(a.work / "inputs" / name, a.synthetic_docs)))
    for corpus, inp in corpora:
        for minhash in (False, True):
            for system in a.systems.split(","):
                run = f"{corpus}-{system}-{'minhash' if minhash else 'filters'}"
                print(json.dumps(measure(system, corpus, inp, a.work / "runs" / run, minhash, a.cpus)), flush=True)


if __name__ == "__main__":
    main()
