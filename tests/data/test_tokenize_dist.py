"""Tokenizer training on a streamed sample, and tokenization by Ray tasks writing token shards:
the blocks, block ids, files and manifest are those of the single-process implementation raypai
had before (kept below as the reference), with and without a connected Ray."""

import hashlib
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from raypai.artifacts import digest_dir
from raypai.chat import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS
from raypai.data.tokenizer import SCRATCH, tokenize, train_tokenizer
from raypai.errors import ConfigError, DataError
from raypai.token_shards import TokenShardsManifest
from raypai.train.data import load_blocks, read_manifest, write_shard

# ---- the reference: raypai.data.tokenizer as it was before tokenization ran on Ray tasks ----------


def _ref_texts(dataset_dir: Path):
    for p in sorted(dataset_dir.glob("part-*.parquet")):
        for batch in pq.ParquetFile(p).iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t)


def ref_train_tokenizer(dataset_dir, out_dir, *, vocab_size, min_frequency=2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_ref_texts(Path(dataset_dir)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=EOS,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def ref_tokenize(dataset_dir, tokenizer_dir, out_dir, *, block_size, shard_blocks, eval_fraction=0.05, seed=0):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    eos = tok.convert_tokens_to_ids(EOS)
    stream, docs, batch = [], 0, []
    for text in _ref_texts(Path(dataset_dir)):
        batch.append(text)
        if len(batch) == 512:
            for ids in tok(batch, add_special_tokens=False)["input_ids"]:
                stream.extend(ids + [eos])
            docs += len(batch)
            batch = []
    if batch:
        for ids in tok(batch, add_special_tokens=False)["input_ids"]:
            stream.extend(ids + [eos])
        docs += len(batch)
    n_blocks = len(stream) // block_size
    blocks = np.asarray(stream[: n_blocks * block_size], dtype=np.int32).reshape(n_blocks, block_size)
    order = np.random.default_rng(seed).permutation(n_blocks)
    n_eval = max(1, int(round(n_blocks * eval_fraction)))
    eval_ids, train_ids = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for prefix, ids in (("shard", train_ids), ("eval", eval_ids)):
        for s in range(0, len(ids), shard_blocks):
            chunk = ids[s : s + shard_blocks]
            name = f"{prefix}-{s // shard_blocks:05d}.parquet"
            write_shard(out / name, chunk, blocks[chunk])
            files.append({"file": name, "split": "train" if prefix == "shard" else "eval", "blocks": len(chunk)})
    unigram = np.bincount(blocks[train_ids].reshape(-1), minlength=len(tok)).astype(np.float64)
    p = unigram[unigram > 0] / unigram.sum()
    manifest = {
        "kind": "token_shards",
        "block_size": block_size,
        "num_blocks": int(len(train_ids)),
        "num_eval_blocks": int(n_eval),
        "num_tokens": int(len(train_ids) * block_size),
        "documents": docs,
        "vocab_size": len(tok),
        "eos_id": int(eos),
        "tokenizer_digest": digest_dir(tokenizer_dir)[0],
        "files": files,
        "unigram_entropy_nats": float(-(p * np.log(p)).sum()),
        "content_sha256": hashlib.sha256(blocks.tobytes()).hexdigest(),
    }
    TokenShardsManifest.from_dict(manifest).write(out)
    return manifest


# ---- fixtures ----------------------------------------------------------------------------------

WORDS = (
    "the miller walked over a bridge while river water ran cold under grey stone arches and "
    "every lantern along quiet streets glowed softly near old houses where children slept"
).split()


def make_dataset(folder: Path, docs: int, seed: int = 0) -> Path:
    """Three part files with different row-group sizes; empty and null texts among the rows (skipped)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    texts = [" ".join(rng.choice(WORDS, rng.integers(3, 60))) + rng.choice([".", "!", "?\n"]) for _ in range(docs)]
    texts[5], texts[docs // 2] = "", None
    cuts = [0, docs // 5, docs // 2, docs]
    for k, rows in enumerate((37, 101, 64)):
        table = pa.table({"doc_id": list(range(cuts[k], cuts[k + 1])), "text": texts[cuts[k] : cuts[k + 1]]})
        pq.write_table(table, folder / f"part-{k:05d}.parquet", row_group_size=rows)
    return folder


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokdist")
    ds = make_dataset(root / "ds", docs=900)
    ref_train_tokenizer(ds, root / "tok", vocab_size=400)
    return ds, root / "tok"


@pytest.fixture(scope="module")
def ray_two_cpus():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def assert_same_shards(ours: Path, ref: Path, ref_manifest: dict):
    """Same blocks, ids and order as pretraining reads them, same files, same manifest."""
    got = json.loads((ours / "manifest.json").read_text())
    assert got == ref_manifest
    for split in ("train", "eval"):
        ids, toks = load_blocks(ours, split)
        ref_ids, ref_toks = load_blocks(ref, split)
        assert np.array_equal(ids, ref_ids) and np.array_equal(toks, ref_toks), split
    assert read_manifest(ours) == read_manifest(ref)
    for f in got["files"]:
        assert pq.read_table(ours / f["file"]).equals(pq.read_table(ref / f["file"])), f["file"]
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in ref.iterdir())  # no scratch left


# ---- tokenizer training --------------------------------------------------------------------------


def test_a_sample_covering_the_dataset_trains_the_same_tokenizer_as_reading_it_all(dataset, tmp_path):
    ds, ref_tok = dataset
    for cap in (None, 10**12):  # None: dataset order; a cap above the total: row groups in seeded order
        info = train_tokenizer(ds, tmp_path / f"tok-{cap}", vocab_size=400)
        assert (tmp_path / f"tok-{cap}" / "tokenizer.json").read_text() == (ref_tok / "tokenizer.json").read_text()
        assert info["sample"]["documents"] == 898 and info["sample"]["row_groups"] == info["sample"]["of_row_groups"]


def test_a_capped_sample_is_bounded_spread_and_deterministic(dataset, tmp_path):
    ds, ref_tok = dataset
    cap = 8_000  # of ~ 200 kB of text
    a = train_tokenizer(ds, tmp_path / "a", vocab_size=400, sample_bytes=cap)
    b = train_tokenizer(ds, tmp_path / "b", vocab_size=400, sample_bytes=cap)
    train_tokenizer(ds, tmp_path / "c", vocab_size=400, sample_bytes=cap, seed=1)
    assert 0.8 * cap < a["sample"]["bytes"] <= cap and a["sample"]["documents"] < 898
    folders = {"a": tmp_path / "a", "b": tmp_path / "b", "c": tmp_path / "c", "all": ref_tok}
    vocab = {name: (folder / "tokenizer.json").read_text() for name, folder in folders.items()}
    assert a == b and vocab["a"] == vocab["b"]  # the same cap and seed: the same sample and tokenizer
    assert vocab["a"] != vocab["all"] and vocab["a"] != vocab["c"]  # the cap bites; the seed picks the groups
    with pytest.raises(ConfigError, match=r"(?s)vocab_size must be ≥ 300.*sample_bytes must be ≥ 1"):
        train_tokenizer(ds, tmp_path / "d", vocab_size=100, sample_bytes=0)


# ---- tokenization --------------------------------------------------------------------------------


def test_without_ray_tokenize_runs_here_and_gives_the_reference_shards(dataset, tmp_path):
    if ray.is_initialized():  # another module's Ray must not leak in
        ray.shutdown()
    ds, tok = dataset
    ref = ref_tokenize(ds, tok, tmp_path / "ref", block_size=16, shard_blocks=64)
    m = tokenize(ds, tok, tmp_path / "ours", block_size=16, shard_blocks=64, task_bytes=3000)
    assert not ray.is_initialized()
    assert m.pop("work")["processes"] == 1 and m == ref
    assert_same_shards(tmp_path / "ours", tmp_path / "ref", ref)


def _driver_peak(fn) -> tuple[dict, int]:
    """fn()'s result and the peak of this process's Python allocations (numpy's included) during it."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_on_ray_tasks_write_the_reference_shards(dataset, ray_two_cpus, tmp_path):
    ds, tok = dataset
    for block_size, shard_blocks, eval_fraction, seed in ((16, 64, 0.05, 0), (24, 50, 0.2, 3)):
        out, ref_out = tmp_path / f"ours-{block_size}", tmp_path / f"ref-{block_size}"
        ref = ref_tokenize(
            ds, tok, ref_out, block_size=block_size, shard_blocks=shard_blocks, eval_fraction=eval_fraction, seed=seed
        )
        m = tokenize(
            ds,
            tok,
            out,
            block_size=block_size,
            shard_blocks=shard_blocks,
            eval_fraction=eval_fraction,
            seed=seed,
            task_bytes=3000,
        )
        work = m.pop("work")
        assert m == ref
        assert_same_shards(out, ref_out, ref)
        # the work: row groups split across many tasks (a file's groups over several), both CPUs' workers
        assert work["tokenize_tasks"] > 3 and work["write_tasks"] == len(ref["files"]) > 2
        assert work["processes"] >= 2, work


def test_the_driver_memory_does_not_grow_with_the_token_stream(dataset, ray_two_cpus, tmp_path):
    """Four times the text: the single-process reference's driver peak grows by ~45 bytes a token
    (a Python list of ints); ours by less than a quarter of the extra stream's int32 bytes (the
    driver gets counts and token histograms, never tokens)."""
    ds, tok = dataset
    big = make_dataset(tmp_path / "big", docs=3600, seed=1)

    def run(folder, name):
        return tokenize(folder, tok, tmp_path / name, block_size=16, shard_blocks=256, task_bytes=20_000)

    run(ds, "warm")  # Ray exports the task functions once per driver: not part of the comparison
    small_m, small_peak = _driver_peak(lambda: run(ds, "small"))
    big_m, big_peak = _driver_peak(lambda: run(big, "big"))
    extra_tokens = big_m["num_tokens"] - small_m["num_tokens"]
    assert extra_tokens > 50_000, extra_tokens
    assert big_peak - small_peak < extra_tokens * 4 / 4, (small_peak, big_peak, extra_tokens)


def test_bad_settings_are_listed_together_and_too_little_text_leaves_nothing_behind(dataset, tmp_path):
    ds, tok = dataset
    with pytest.raises(ConfigError, match=r"(?s)block_size must be ≥ 8.*shard_blocks must be ≥ 1.*eval_fraction"):
        tokenize(ds, tok, tmp_path / "o", block_size=4, shard_blocks=0, eval_fraction=1.0)
    small = tmp_path / "small"
    small.mkdir()
    pq.write_table(pa.table({"text": ["a few words", ""]}), small / "part-00000.parquet")
    with pytest.raises(DataError, match="fewer than two blocks of 64; use more data or a smaller block_size"):
        tokenize(small, tok, tmp_path / "o2", block_size=64)
    assert not (tmp_path / "o2" / SCRATCH).exists()
    with pytest.raises(DataError, match="has no part-\\*.parquet files"):
        tokenize(tmp_path / "nothing", tok, tmp_path / "o3")
