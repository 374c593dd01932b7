"""Byte-level BPE tokenizer (HF `tokenizers`) trained on a sample streamed from a cleaned dataset,
and packing documents into fixed-length token blocks (token shards) by Ray tasks.

    train_tokenizer("cleaned/", "tok/", vocab_size=2048, sample_bytes=1 << 30)
    tokenize("cleaned/", "tok/", "shards/", block_size=128)

Both read the dataset's `part-*.parquet` files row group by row group, so memory is bounded by a
batch of texts whatever the dataset's size. `tokenize` runs on the Ray this process is connected
to (a local loop without one); its workers write the files, the driver holds counters only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray

from raypai.artifacts import digest_dir
from raypai.chat import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS
from raypai.data import _token_blocks as tb
from raypai.errors import ConfigError, DataError
from raypai.token_shards import TokenShardsManifest

# raypai's own chat format lives in raypai.chat (one home for special tokens and the template)

TASK_BYTES = 64 << 20  # text bytes (Parquet's uncompressed size) one tokenize task reads: ~10^7 tokens
SCRATCH = "_streams"  # per-task token streams inside out_dir while tokenizing; removed at the end


def _row_groups(dataset_dir: Path) -> list[tb.RowGroups]:
    """Every row group of the dataset, in dataset order (files sorted, groups in file order), with
    its row count and text bytes read from the Parquet footers."""
    parts = sorted(dataset_dir.glob("part-*.parquet"))
    if not parts:
        raise DataError(f"{dataset_dir} has no part-*.parquet files; pass a cleaned dataset artifact")
    groups = []
    for p in parts:
        meta = pq.read_metadata(p)
        names = meta.schema.to_arrow_schema().names
        if "text" not in names:
            raise DataError(f"{p} has no text column (columns: {', '.join(names)}); pass a cleaned dataset artifact")
        col = names.index("text")
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            groups.append(tb.RowGroups(str(p), (g,), rg.num_rows, rg.column(col).total_uncompressed_size))
    return groups


def _sample(groups: list[tb.RowGroups], sample_bytes: int | None, seed: int, taken: dict):
    """Texts to train on: every text in dataset order, or (with a cap) whole row groups in a seeded
    random order until `sample_bytes` UTF-8 bytes, so the sample spreads over the whole dataset
    instead of its first files. Counts what it yields in `taken` (documents, bytes, row_groups)."""
    order = range(len(groups)) if sample_bytes is None else np.random.default_rng(seed).permutation(len(groups))
    taken.update(documents=0, bytes=0, row_groups=0)
    for i in order:
        taken["row_groups"] += 1
        for text in tb.texts(groups[i]):
            n = len(text.encode())
            if sample_bytes is not None and taken["bytes"] + n > sample_bytes:
                return
            taken["documents"] += 1
            taken["bytes"] += n
            yield text


def train_tokenizer(
    dataset_dir: str | Path,
    out_dir: str | Path,
    *,
    vocab_size: int = 2048,
    min_frequency: int = 2,
    sample_bytes: int | None = None,
    seed: int = 0,
    extra_texts: list[str] | None = None,
) -> dict:
    """Train and save a tokenizer that `PreTrainedTokenizerFast.from_pretrained(out_dir)` loads.

    `sample_bytes`: train on at most this many bytes of text, whole row groups drawn in a seeded
    order (None: all of it). The texts stream in batches; the trainer keeps word counts only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    problems = []
    if vocab_size < 300:
        problems.append(
            f"vocab_size must be ≥ 300 (got {vocab_size}): byte-level BPE needs 256 byte tokens "
            "plus the special tokens and some merges"
        )
    if sample_bytes is not None and sample_bytes < 1:
        problems.append(f"sample_bytes must be ≥ 1 or None for the whole dataset (got {sample_bytes})")
    if problems:
        raise ConfigError(problems, what="tokenizer config")
    dataset_dir, out = Path(dataset_dir), Path(out_dir)
    groups = _row_groups(dataset_dir)
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
    taken: dict[str, int] = {}  # filled by _sample as the trainer reads

    def corpus():
        yield from _sample(groups, sample_bytes, seed, taken)
        yield from (extra_texts or [])

    tok.train_from_iterator(corpus(), trainer=trainer)
    if not taken["documents"]:
        raise DataError(
            f"{dataset_dir}: no text to train a tokenizer on"
            + (f" within sample_bytes={sample_bytes}; raise it" if sample_bytes else "")
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=EOS,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return {
        "vocab_size": len(fast),
        "special_tokens": SPECIAL_TOKENS,
        "sample": {**taken, "of_row_groups": len(groups)},
    }


def _units(groups: list[tb.RowGroups], task_bytes: int) -> list[tb.RowGroups]:
    """Consecutive row groups of one file joined until `task_bytes`: the input of one tokenize task."""
    units: list[tb.RowGroups] = []
    for g in groups:
        last = units[-1] if units else None
        if last and last.path == g.path and last.text_bytes + g.text_bytes <= task_bytes:
            units[-1] = tb.RowGroups(g.path, last.groups + g.groups, last.rows + g.rows, last.text_bytes + g.text_bytes)
        else:
            units.append(g)
    return units


def _run(calls: list[tuple]):
    """fn(*args) for each (fn, args) in `calls`, as Ray tasks (one CPU each) when this process is
    connected to a Ray, else one after another here. Yields (index in calls, result) as each finishes."""
    if not ray.is_initialized():
        yield from ((i, fn(*args)) for i, (fn, args) in enumerate(calls))
        return
    remotes = {fn: ray.remote(num_cpus=1)(fn) for fn, _ in calls}
    index = {remotes[fn].remote(*args): i for i, (fn, args) in enumerate(calls)}
    pending = list(index)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        yield index[done[0]], ray.get(done[0])


def tokenize(
    dataset_dir: str | Path,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    block_size: int = 128,
    shard_blocks: int = 4096,
    eval_fraction: float = 0.05,
    seed: int = 0,
    task_bytes: int = TASK_BYTES,
) -> dict:
    """Pack EOS-separated documents into `block_size` blocks; write `shard-*.parquet` (block_id,
    input_ids) for training and `eval-*.parquet` for a held-out split, plus a manifest.

    Three rounds of tasks, each writing files under `out_dir` (a folder every Ray node can reach):
    tokenize (one task per `task_bytes` of row groups: its token stream), split (which blocks are
    held out), write (one task per shard file: its blocks gathered from the streams). The blocks,
    their ids and the files are those of one process concatenating every document in dataset order.
    Returns the manifest plus `work` (tasks run, distinct worker processes)."""
    from transformers import PreTrainedTokenizerFast

    problems = []
    if block_size < 8:
        problems.append(f"block_size must be ≥ 8 (got {block_size})")
    if shard_blocks < 1:
        problems.append(f"shard_blocks must be ≥ 1 (got {shard_blocks})")
    if not 0 < eval_fraction < 1:
        problems.append(f"eval_fraction must be in (0, 1) (got {eval_fraction})")
    if task_bytes < 1:
        problems.append(f"task_bytes must be ≥ 1 (got {task_bytes})")
    if problems:
        raise ConfigError(problems, what="tokenize config")
    tokenizer_dir, out = str(tokenizer_dir), Path(out_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)  # vocab size and EOS id only
    vocab, eos = len(tok), int(tok.convert_tokens_to_ids(EOS))
    units = _units(_row_groups(Path(dataset_dir)), task_bytes)
    scratch = out / SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    workers: set[tuple[str, int]] = set()  # (node, pid) of each task's process

    # round 1: each task tokenizes its row groups into scratch/unit-<i>.i32; the driver keeps counts
    counts, docs = np.zeros(len(units), dtype=np.int64), 0
    for i, (n_tokens, n_docs, worker) in _run(
        [(tb.tokenize_unit, (i, u, tokenizer_dir, eos, str(scratch))) for i, u in enumerate(units)]
    ):
        counts[i], docs = n_tokens, docs + n_docs
        workers.add(worker)
    streams = tb.Streams(str(scratch), np.concatenate([[0], np.cumsum(counts)]))
    n_blocks = int(streams.total // block_size)  # the tail shorter than a block is dropped
    if n_blocks < 2:
        shutil.rmtree(scratch)
        raise DataError(
            f"{dataset_dir}: only {streams.total} tokens, fewer than two blocks of {block_size}; "
            "use more data or a smaller block_size"
        )

    # round 2: the held-out block ids (a seeded permutation's first eval_fraction), saved sorted
    n_eval = max(1, int(round(n_blocks * eval_fraction)))
    next(_run([(tb.hold_out, (n_blocks, n_eval, seed, str(scratch)))]))
    n_train = n_blocks - n_eval

    # round 3: one task per shard file; with them, one task hashing every block in id order
    files, calls = [], []
    for prefix, split, n in (("shard", "train", n_train), ("eval", "eval", n_eval)):
        for k, first in enumerate(range(0, n, shard_blocks)):
            name, count = f"{prefix}-{k:05d}.parquet", min(shard_blocks, n - first)
            files.append({"file": name, "split": split, "blocks": count})
            calls.append((tb.write_shard, (str(out / name), split, first, count, streams, block_size, vocab)))
    calls.append((tb.content_digest, (streams, n_blocks * block_size)))
    unigram, digest = np.zeros(vocab, dtype=np.int64), None
    for i, result in _run(calls):
        if i == len(files):
            digest = result
            continue
        shard_unigram, worker = result  # (vocab,) token counts of a train shard, None for eval
        workers.add(worker)
        if shard_unigram is not None:
            unigram += shard_unigram
    shutil.rmtree(scratch)

    tok_digest, _ = digest_dir(tokenizer_dir)
    p = unigram[unigram > 0] / unigram.sum()
    manifest = {
        "kind": "token_shards",
        "block_size": block_size,
        "num_blocks": int(n_train),
        "num_eval_blocks": int(n_eval),
        "num_tokens": int(n_train * block_size),
        "documents": docs,
        "vocab_size": vocab,
        "eos_id": eos,
        "tokenizer_digest": tok_digest,
        "files": files,
        "unigram_entropy_nats": float(-(p * np.log(p)).sum()),
        "content_sha256": digest,
    }
    typed = TokenShardsManifest.from_dict(manifest)  # the one format (raypai.token_shards), checked as written
    typed.write(out)
    return {
        **typed.to_dict(),
        "work": {"tokenize_tasks": len(units), "write_tasks": len(files), "processes": len(workers)},
    }
