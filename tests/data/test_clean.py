"""Cleaning on real Ray against the synthetic corpus's ground truth; resume; bad input; tokenizer."""

import json
import re
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from raypai.artifacts import digest_dir
from raypai.data import IngestConfig, clean, ingest, synth
from raypai.data.tokenizer import tokenize, train_tokenizer
from raypai.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def ray_local(shared_ray):
    """The test process's shared local Ray (tests/conftest.py) with 4 CPUs."""
    return shared_ray(num_cpus=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("corpus")
    synth(root / "raw", docs=1500, files=4, seed=7)
    ingest(root / "raw", root / "ingested", IngestConfig(block_bytes=64 << 10))  # ~3 ranges per file
    manifest = clean(root / "ingested", root / "clean", work_dir=root / "work")
    truth = [json.loads(line) for line in open(root / "raw" / "_ground_truth.jsonl")]
    return root, manifest, truth


def _kept(root):
    shards = json.loads((root / "clean" / "manifest.json").read_text())["shards"]
    return [r for s in shards for r in pq.read_table(root / "clean" / s["file"]).to_pylist()]


def test_ground_truth_dedup_pii_and_accounting(corpus):
    root, manifest, truth = corpus
    kept = {r["source"]: r for r in _kept(root)}
    dropped = {r["source"]: r for r in pq.read_table(root / "clean" / "dropped.parquet").to_pylist()}
    rejected = pq.read_table(root / "clean" / "rejected.parquet").to_pylist()

    acc = manifest["accounting"]
    # worker seconds per op travel with the rows (no counter actor): every filter and dedup op has some
    secs = {r["op_name"]: r["seconds"] for r in manifest["op_stats"]}
    assert all(secs[op] > 0 for op in ("word_count", "language", "exact_dedup", "minhash_dedup")), secs
    assert acc["input_rows"] == len(truth) == acc["kept"] + sum(acc["dropped_by_op"].values()) + acc["rejected"]
    assert len(kept) + len(dropped) + len(rejected) == len(truth)
    assert {r["source"] for r in rejected} == {t["source"] for t in truth if t["expected"] == "reject"}

    # duplicate groups: an original and its planted copies; exactly one member may survive
    groups = defaultdict(set)
    for t in truth:
        if t["dup_of"]:
            groups[t["dup_of"]].update({t["dup_of"], t["source"]})
    exact_groups = [
        g for o, g in groups.items() if any(t["dup_of"] == o and t["category"] == "exact_dup" for t in truth)
    ]
    assert all(len(g & kept.keys()) <= 1 for g in exact_groups), "an exact duplicate survived"
    near = [t for t in truth if t["category"] == "near_dup"]
    recall = sum(1 for t in near if not ({t["source"], t["dup_of"]} <= kept.keys())) / len(near)
    assert recall >= 0.95, recall
    fuzzy = [s for s, r in dropped.items() if r["op"] == "minhash_dedup"]
    in_group = {s for g in groups.values() for s in g}
    precision = sum(s in in_group for s in fuzzy) / len(fuzzy)
    assert precision >= 0.99, precision
    assert all(dropped[s]["cluster_id"] for s in fuzzy)

    text = " ".join(r["text"] for r in kept.values())
    assert not re.search(r"[\w.]+@example\.org|192\.168\.\d+\.\d+|415-555-\d{4}|2001:db8", text)
    assert "Project Gutenberg" not in text
    # the mapped text of every PII / boilerplate row (kept, or dropped later by dedup) was rewritten
    after_mappers = {s: r["text"] for s, r in (dropped | kept).items()}
    pii = [after_mappers[t["source"]] for t in truth if t["category"] == "pii"]
    assert len(pii) >= 50 and all(re.search(r"<(EMAIL|IP|PHONE)>", t) for t in pii), "a PII row was not redacted"
    boiler = [after_mappers[t["source"]] for t in truth if t["category"] == "boilerplate"]
    assert len(boiler) >= 30 and not any("Gutenberg" in t or "Updated editions" in t for t in boiler)

    # the report's op table has one row per op with the manifest's own counts
    report = (root / "clean" / "report.md").read_text()
    for r in manifest["op_stats"]:
        assert f"| {r['op_index']} | {r['op_name']} | {r['rows_in']} | {r['rows_out']} | {r['dropped']} |" in report


# which ops may drop each "drop" category of the synthetic corpus (filters, not dedup)
LABEL_OPS = {
    "short": {"word_count"},
    "repetitive": {"char_repetition", "word_repetition", "gopher_repetition"},
    "gibberish": {
        "language",
        "mean_word_length",
        "word_repetition",
        "char_repetition",
        "gopher_repetition",
        "alnum_ratio",
        "special_char_ratio",
        "flagged_words",
    },
}


def test_ground_truth_labels_match_what_cleaning_does(corpus):
    """Every row of the synthetic corpus ends where its ground-truth label says: short/repetitive/
    gibberish → dropped by a filter of the right kind; broken → rejected; clean, PII, boilerplate
    and near-miss rows → kept, except that in a duplicate group (an original and its exact and near
    copies) exactly one member survives, the lowest doc_id, and every other member's cluster_id
    chain leads to it."""
    root, _, truth = corpus
    kept = {r["source"]: r for r in _kept(root)}
    dropped = {r["source"]: r for r in pq.read_table(root / "clean" / "dropped.parquet").to_pylist()}
    rejected = {r["source"] for r in pq.read_table(root / "clean" / "rejected.parquet").to_pylist()}
    doc_id = {s: r["doc_id"] for s, r in (dropped | kept).items()}
    drop_by_id = {r["doc_id"]: r for r in dropped.values()}
    groups = defaultdict(set)
    for t in truth:
        if t["dup_of"]:
            groups[t["dup_of"]].update({t["dup_of"], t["source"]})
    in_group = {s for g in groups.values() for s in g}
    cats = defaultdict(int)
    for t in truth:
        src, cat = t["source"], t["category"]
        cats[cat] += 1
        if t["expected"] == "reject":
            assert src in rejected, f"{cat} row {src} should be rejected"
        elif cat in LABEL_OPS:
            assert src in dropped and dropped[src]["op"] in LABEL_OPS[cat], (
                f"{cat} row {src} should be dropped by one of {LABEL_OPS[cat]}; got {dropped.get(src)}"
            )
        elif src not in in_group:
            assert t["expected"] == "keep" and src in kept, (
                f"{cat} row {src} should be kept; dropped: {dropped.get(src, {}).get('reason')}"
            )
    assert len(groups) >= 100
    for original, group in groups.items():
        survivor = min(group, key=doc_id.get)
        assert group & kept.keys() == {survivor}, f"group of {original}: kept {group & kept.keys()}, not {survivor}"
        for src in group - {survivor}:
            assert dropped[src]["op"] in ("exact_dedup", "minhash_dedup"), dropped[src]
            link, hops = dropped[src]["cluster_id"], 0
            while link in drop_by_id and hops < 5:  # an exact dedup keeper may itself be a near duplicate
                link, hops = drop_by_id[link]["cluster_id"], hops + 1
            assert link == doc_id[survivor], f"{src} in the group of {original} leads to {link}, not {survivor}"
    # every category is present, so none of the checks above ran over nothing
    assert all(
        cats[c] >= 20
        for c in (
            "clean",
            "pii",
            "boilerplate",
            "near_miss",
            "short",
            "repetitive",
            "gibberish",
            "exact_dup",
            "near_dup",
        )
    ), dict(cats)


def _similar_pairs(texts: dict[str, str], low: float) -> dict[tuple[str, str], float]:
    """Exact word-5-gram Jaccard of every pair of documents with Jaccard ≥ `low` (all pairs that
    share a shingle are counted through an inverted index, so nothing is sampled)."""
    from itertools import combinations

    from raypai.data.synth import shingle_set

    sets = {d: shingle_set(t) for d, t in texts.items()}
    index = defaultdict(list)
    for d in sorted(sets):
        for g in sets[d]:
            index[g].append(d)
    shared = defaultdict(int)
    for docs in index.values():
        for a, b in combinations(docs, 2):
            shared[a, b] += 1
    out = {}
    for (a, b), k in shared.items():
        j = k / (len(sets[a]) + len(sets[b]) - k)
        if j >= low:
            out[a, b] = j
    return out


def test_minhash_recall_precision_and_near_misses_against_exact_jaccard(corpus):
    """Truth = exact word-5-gram Jaccard over all pairs of the documents that reach minhash_dedup.
    Recall ≥ 0.97 over documents with an earlier partner at J ≥ 0.8; precision ≥ 0.99 (a dropped
    document's J with its recorded keeper ≥ 0.8); every planted near miss (J 0.4–0.7) is kept; each
    drop record's similarity is verified."""
    root, manifest, truth = corpus
    kept = {r["doc_id"]: r for r in _kept(root)}
    dropped = pq.read_table(root / "clean" / "dropped.parquet").to_pylist()
    fuzzy = {r["doc_id"]: r for r in dropped if r["op"] == "minhash_dedup"}
    texts = {d: r["text"] for d, r in kept.items()} | {d: r["text"] for d, r in fuzzy.items()}
    pairs = _similar_pairs(texts, 0.4)
    should_drop = {b for (a, b), j in pairs.items() if j >= 0.8}  # b has an earlier partner a
    assert len(should_drop) >= 50
    recall = len(should_drop & fuzzy.keys()) / len(should_drop)
    assert recall >= 0.97, recall

    def jac(a, b):
        return pairs.get((min(a, b), max(a, b)), 0.0)

    precision = sum(jac(d, r["cluster_id"]) >= 0.8 for d, r in fuzzy.items()) / len(fuzzy)
    assert precision >= 0.99, precision
    # the hard negatives are there (most are LSH candidates at 21 x 6) and none was merged
    from raypai.data.synth import jaccard

    rows = {r["source"]: r for r in dropped} | {r["source"]: r for r in kept.values()}
    misses = [(rows[t["source"]], rows[t["near_miss_of"]]) for t in truth if t["category"] == "near_miss"]
    assert len(misses) >= 50 and all(0.35 <= jaccard(a["text"], b["text"]) <= 0.75 for a, b in misses)
    assert not {a["doc_id"] for a, _ in misses} & fuzzy.keys(), "a near miss (J < 0.7) was dropped as a duplicate"
    # drop records: the keeper is kept and earlier, the similarity is verified and matches the pair's
    for d, r in fuzzy.items():
        assert r["cluster_id"] in kept and r["cluster_id"] < d
        partner = re.match(r"near-duplicate of (\S+) \(Jaccard ([\d.]+), (exact|MinHash estimate)\)", r["reason"])
        assert partner and r["stat"] >= 0.8, r["reason"]
        tol = 1e-3 if partner[3] == "exact" else 0.15
        assert abs(r["stat"] - jac(d, partner[1])) <= tol, (r["reason"], jac(d, partner[1]))


def _digests(manifest):
    return [(s["file"], s["rows"], s["sha256"]) for s in manifest["shards"]]


def _pending_order(root):
    """The shards in the order clean submits their filter tasks (largest first, then by name)."""
    parts = json.loads((root / "ingested" / "manifest.json").read_text())["parts"]
    return [p["file"] for p in sorted((p for p in parts if p["rows"]), key=lambda p: -p["rows"])]


def test_worker_sigkilled_mid_shard_fails_the_run_and_the_rerun_resumes_to_the_same_digests(
    corpus, tmp_path, monkeypatch
):
    """A Ray worker SIGKILLs itself while filtering the last shard handed out, on every attempt:
    Ray retries the task FILTER_RETRIES times, the run fails naming the resume; the shards committed
    by then are not redone and the re-run's output shards have the uninterrupted run's digests."""
    from raypai.data._faults import ENV, Faults
    from raypai.data.clean import FILTER_RETRIES

    root, manifest, _ = corpus
    work, target = tmp_path / "work", _pending_order(root)[-1]
    fault = Faults(sigkill_shard=target, sigkill_times=FILTER_RETRIES + 1)
    monkeypatch.setenv(ENV, fault.to_env())
    with pytest.raises(DataError, match="run the same clean again to resume"):
        clean(root / "ingested", tmp_path / "first", work_dir=work)
    monkeypatch.delenv(ENV)
    assert fault.kills(work) == FILTER_RETRIES + 1  # the first attempt and each retry died
    done = sorted(p.name for p in (work / "done").glob("*.json"))
    assert done and f"{target}.json" not in done, done  # some shards committed, never the killed one
    before = {p: (work / "kept" / p.removesuffix(".json")).stat().st_mtime_ns for p in done}
    resumed = clean(root / "ingested", tmp_path / "resumed", work_dir=work)
    after = {p: (work / "kept" / p.removesuffix(".json")).stat().st_mtime_ns for p in done}
    assert before == after, "finished shards were redone"
    assert _digests(resumed) == _digests(manifest)


def test_worker_sigkilled_once_is_retried_by_ray_to_the_same_digests(corpus, tmp_path, monkeypatch):
    from raypai.data._faults import ENV, Faults

    root, manifest, _ = corpus
    fault = Faults(sigkill_shard=_pending_order(root)[0], sigkill_times=1)
    monkeypatch.setenv(ENV, fault.to_env())
    m = clean(root / "ingested", tmp_path / "out", work_dir=tmp_path / "work")
    assert fault.kills(tmp_path / "work") == 1
    assert _digests(m) == _digests(manifest)


def test_a_single_large_file_is_filtered_by_several_tasks(tmp_path, ray_local):
    """One input file, cut by ingest into ranges, is filtered by one Ray task per range: the done
    markers the workers wrote name distinct tasks, and the manifest counts them."""
    synth(tmp_path / "raw", docs=300, files=1, seed=3)
    m = ingest(tmp_path / "raw", tmp_path / "ing", IngestConfig(block_bytes=8 << 10))
    assert m["files"] == ["raw-000.jsonl"] and len(m["parts"]) >= 4, m["parts"]
    calls = []
    out = clean(
        tmp_path / "ing",
        tmp_path / "out",
        recipe=["whitespace_normalize", "word_count"],
        work_dir=tmp_path / "w",
        progress=lambda *a: calls.append(a),
    )
    counts = [c for c in calls if len(c) == 3]  # (rows done, rows in all, "rows"): at the start, then per shard
    assert len(counts) == len(m["parts"]) + 1 and counts[-1] == (m["rows"], m["rows"], "rows"), calls
    assert [c[0] for c in counts] == sorted(c[0] for c in counts) and counts[0][0] == 0 < counts[1][0]
    markers = [json.loads(f.read_text()) for f in (tmp_path / "w" / "done").glob("*.json")]
    assert len(markers) == len(m["parts"]) and sum(x["rows"] for x in markers) == m["rows"]
    tasks = {x["task_id"] for x in markers}
    assert None not in tasks and len(tasks) == len(m["parts"]), tasks
    assert out["filter"]["tasks"] == len(m["parts"]) and sum(out["filter"]["tasks_per_node"].values()) == len(tasks)


def test_cross_shard_duplicates_are_found(tmp_path, ray_local):
    raw = tmp_path / "raw"
    raw.mkdir()
    import random

    from raypai.data.synth import near_duplicate, prose

    rng = random.Random(1)
    docs = [prose(rng, 10) for _ in range(6)]
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (raw / "b.jsonl").write_text(
        json.dumps({"text": near_duplicate(docs[0], rng, 1)}) + "\n" + json.dumps({"text": docs[1].upper()}) + "\n"
    )
    ingest(raw, tmp_path / "ing")
    m = clean(tmp_path / "ing", tmp_path / "out", work_dir=tmp_path / "w", batch_size=2)
    assert m["accounting"]["dropped_by_op"]["exact_dedup"] == 1
    assert m["accounting"]["dropped_by_op"]["minhash_dedup"] == 1
    assert m["rows"] == 6


def test_a_batch_whose_rows_all_fall_before_an_annotating_filter_joins_its_shard(tmp_path, ray_local):
    """A shard of several batches where one batch loses every row to an earlier filter: that
    batch's annotation columns (the language filter's `lang`, `lang_score`) have no values, and the
    shard's batches must still join into one table (they failed to: null vs string columns)."""
    import random

    from raypai.data.synth import prose

    rng = random.Random(2)
    rows = ["too short"] * 2 + [prose(rng, 12) for _ in range(4)]  # batch 1 of 2 rows: all dropped by word_count
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    ingest(raw, tmp_path / "ing")
    m = clean(
        tmp_path / "ing", tmp_path / "out", recipe=["word_count", "language"], work_dir=tmp_path / "w", batch_size=2
    )
    assert m["accounting"]["dropped_by_op"]["word_count"] == 2
    kept = [r for s in m["shards"] for r in pq.read_table(tmp_path / "out" / s["file"]).to_pylist()]
    assert len(kept) + m["accounting"]["dropped_by_op"]["language"] == 4
    assert all(r["lang"] == "en" and r["lang_score"] > 0 for r in kept), kept


def test_no_rows_left_is_a_valid_empty_dataset(tmp_path, ray_local):
    """Every row rejected at ingest, or dropped by a filter: one empty shard with the schema, the
    invariant holds, and the empty parts go through the dedup pass (their key columns exist)."""
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.jsonl").write_bytes(b'{"text": 1}\n{"oops"\n')
    (junk / "b.jsonl").write_text(json.dumps({"text": "too short"}) + "\n")
    ingest(junk, tmp_path / "ing")
    m = clean(tmp_path / "ing", tmp_path / "out", work_dir=tmp_path / "w")
    assert m["rows"] == 0 and [s["rows"] for s in m["shards"]] == [0]
    assert pq.read_table(tmp_path / "out" / m["shards"][0]["file"]).column_names == m["schema"]
    assert m["accounting"] | {"dropped_by_op": None} == {
        "input_rows": 3,
        "kept": 0,
        "dropped": 1,
        "rejected": 2,
        "dropped_by_op": None,
    }
    assert m["accounting"]["dropped_by_op"]["word_count"] == 1


def test_bad_inputs_are_clear(tmp_path, ray_local):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .jsonl"):
        ingest(tmp_path / "empty", tmp_path / "o1")
    with pytest.raises(DataError, match="does not exist"):
        ingest(tmp_path / "nowhere", tmp_path / "o2")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "garbage.jsonl").write_bytes(bytes(range(256)) * 40 + b"\n\x00\xff\n")
    m = ingest(junk, tmp_path / "o3")
    assert m["rows"] == 0 and m["rejected"] >= 1
    with pytest.raises(ConfigError, match="unknown op"):
        clean(tmp_path / "o3", tmp_path / "o4", recipe=["bogus_op"])
    with pytest.raises(ConfigError, match="'min_value' must be float"):
        clean(tmp_path / "o3", tmp_path / "o4", recipe=[{"word_count": {"min_value": "x"}}])
    with pytest.raises(ConfigError, match="after a dedup"):
        clean(tmp_path / "o3", tmp_path / "o4", recipe=["exact_dedup", "word_count"])


def test_tokenizer_and_token_shards(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    root, _, _ = corpus
    info = train_tokenizer(root / "clean", tmp_path / "tok", vocab_size=512)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == info["vocab_size"] == 512
    assert tok.decode(tok("The miller walked.")["input_ids"]) == "The miller walked."
    chat = tok.apply_chat_template([{"role": "user", "content": "2+3="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\n2+3=<|end|>\n<|assistant|>\n"
    m = tokenize(root / "clean", tmp_path / "tok", tmp_path / "shards", block_size=64)
    assert m["num_blocks"] > 10 and m["num_eval_blocks"] >= 1 and m["vocab_size"] == 512
    t = pq.read_table(tmp_path / "shards" / "shard-00000.parquet")
    assert t.column_names == ["block_id", "input_ids"] and {len(x) for x in t.column("input_ids").to_pylist()} == {64}
    assert m["tokenizer_digest"] == digest_dir(tmp_path / "tok")[0]
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(root / "clean", tmp_path / "t2", vocab_size=100)


def test_the_resume_drills_kill_is_private_not_a_clean_option(monkeypatch, tmp_path):
    """The kill drill is set through RAYPAI_DATA_FAULTS (raypai.data._faults), never through
    clean()'s signature, the clean step's or `raypai data clean`'s options."""
    import inspect

    import typer
    from typer.testing import CliRunner

    from raypai.cli.main import app
    from raypai.data import steps

    for fn in (clean, steps.clean.fn):
        assert not {p for p in inspect.signature(fn).parameters if "kill" in p or "fault" in p}, fn
    data_cli = typer.main.get_command(app).commands["data"].commands["clean"]
    assert {p.name for p in data_cli.params} == {"input_dir", "output_dir", "recipe", "text_mode"}
    help_text = CliRunner().invoke(app, ["data", "clean", "--help"], env={"COLUMNS": "200"}).output
    assert "--recipe" in help_text and "kill" not in help_text and "FAULTS" not in help_text, help_text

    from raypai.data._faults import ENV, Faults

    monkeypatch.delenv(ENV, raising=False)
    assert Faults.from_env() == Faults()
    monkeypatch.setenv(ENV, Faults(sigkill_shard="part-00001-00000.parquet", sigkill_times=2).to_env())
    assert Faults.from_env() == Faults(sigkill_shard="part-00001-00000.parquet", sigkill_times=2)
    Faults.from_env().in_worker("part-00000-00000.parquet", tmp_path)  # another shard: this process lives on
    assert Faults.from_env().kills(tmp_path) == 0
    monkeypatch.setenv(ENV, '{"kill_shard": "x"}')
    with pytest.raises(ValueError, match=r"unknown keys \['kill_shard'\]"):
        Faults.from_env()
