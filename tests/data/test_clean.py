"""Cleaning on real Ray against the synthetic corpus's ground truth; resume; bad input; tokenizer."""

import json
import re
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import ray

from raypai.artifacts import digest_dir
from raypai.data import clean, ingest, synth
from raypai.data.tokenizer import tokenize, train_tokenizer
from raypai.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("corpus")
    synth(root / "raw", docs=1500, files=4, seed=7)
    ingest(root / "raw", root / "ingested")
    manifest = clean(root / "ingested", root / "clean", work_dir=root / "work")
    truth = [json.loads(line) for line in open(root / "raw" / "_ground_truth.jsonl")]
    return root, manifest, truth


def _kept(root):
    return pq.read_table(root / "clean" / "part-00000.parquet").to_pylist()


def test_ground_truth_dedup_pii_and_accounting(corpus):
    root, manifest, truth = corpus
    kept = {r["source"]: r for r in _kept(root)}
    dropped = {r["source"]: r for r in pq.read_table(root / "clean" / "dropped.parquet").to_pylist()}
    rejected = pq.read_table(root / "clean" / "rejected.parquet").to_pylist()

    acc = manifest["accounting"]
    assert acc["input_rows"] == len(truth) == acc["kept"] + sum(acc["dropped_by_op"].values()) + acc["rejected"]
    assert len(kept) + len(dropped) + len(rejected) == len(truth)
    assert {r["source"] for r in rejected} == {t["source"] for t in truth if t["expected"] == "reject"}

    # duplicate groups: an original and its planted copies; exactly one member may survive
    groups = defaultdict(set)
    for t in truth:
        if t["dup_of"]:
            groups[t["dup_of"]].update({t["dup_of"], t["source"]})
    exact_groups = [g for o, g in groups.items() if any(t["dup_of"] == o and t["category"] == "exact_dup" for t in truth)]
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
    assert "Project Gutenberg" not in text and "<EMAIL>" in text or "<IP>" in text
    assert {r["op"] for s, r in dropped.items() if s in {t["source"] for t in truth if t["category"] == "gibberish"}} \
        <= {"language", "word_repetition", "char_repetition", "mean_word_length", "gopher_repetition"}
    assert (root / "clean" / "report.md").read_text().count("|") > 20


def test_killed_run_resumes_per_shard_to_the_same_digest(corpus, tmp_path):
    root, _, _ = corpus
    work = tmp_path / "work"
    with pytest.raises(DataError, match="resume"):
        clean(root / "ingested", tmp_path / "first", work_dir=work, stop_after_shards=2)
    done = sorted(p.name for p in (work / "done").glob("*.json"))
    assert len(done) == 2  # two shards committed before the "kill"
    before = {p: (work / "kept" / p.removesuffix(".json")).stat().st_mtime for p in done}
    clean(root / "ingested", tmp_path / "resumed", work_dir=work)
    after = {p: (work / "kept" / p.removesuffix(".json")).stat().st_mtime for p in done}
    assert before == after, "finished shards were redone"
    assert digest_dir(tmp_path / "resumed" / "part-00000.parquet") == digest_dir(root / "clean" / "part-00000.parquet")


def test_cross_shard_duplicates_are_found(tmp_path, ray_local):
    raw = tmp_path / "raw"
    raw.mkdir()
    from raypai.data.synth import near_duplicate, prose
    import random

    rng = random.Random(1)
    docs = [prose(rng, 10) for _ in range(6)]
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (raw / "b.jsonl").write_text(json.dumps({"text": near_duplicate(docs[0], rng, 1)}) + "\n" +
                                 json.dumps({"text": docs[1].upper()}) + "\n")
    ingest(raw, tmp_path / "ing")
    m = clean(tmp_path / "ing", tmp_path / "out", work_dir=tmp_path / "w", batch_size=2)
    assert m["accounting"]["dropped_by_op"]["exact_dedup"] == 1
    assert m["accounting"]["dropped_by_op"]["minhash_dedup"] == 1
    assert m["rows"] == 6


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
    with pytest.raises(ConfigError, match="must be a number"):
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
