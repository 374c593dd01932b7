"""Byte-level BPE tokenizer (HF `tokenizers`) trained on a cleaned dataset, and packing documents
into fixed-length token blocks (token shards).

    train_tokenizer("cleaned/", "tok/", vocab_size=2048)
    tokenize("cleaned/", "tok/", "shards/", block_size=128)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raypai.artifacts import digest_dir
from raypai.chat import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS
from raypai.errors import ConfigError, DataError
from raypai.token_shards import TokenShardsManifest
from raypai.train.data import write_shard

# raypai's own chat format lives in raypai.chat (one home for special tokens and the template)


def _texts(dataset_dir: Path):
    parts = sorted(dataset_dir.glob("part-*.parquet"))
    if not parts:
        raise DataError(f"{dataset_dir} has no part-*.parquet files; pass a cleaned dataset artifact")
    for p in parts:
        for batch in pq.ParquetFile(p).iter_batches(columns=["text"], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if t)


def train_tokenizer(dataset_dir: str | Path, out_dir: str | Path, *, vocab_size: int = 2048,
                    min_frequency: int = 2, extra_texts: list[str] | None = None) -> dict:
    """Train and save a tokenizer that `PreTrainedTokenizerFast.from_pretrained(out_dir)` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ConfigError([f"vocab_size must be ≥ 300 (got {vocab_size}): byte-level BPE needs 256 byte tokens "
                           "plus the special tokens and some merges"], what="tokenizer config")
    dataset_dir, out = Path(dataset_dir), Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def corpus():
        yield from _texts(dataset_dir)
        yield from (extra_texts or [])

    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS,
                                   unk_token=None, additional_special_tokens=SPECIAL_TOKENS[2:])
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return {"vocab_size": len(fast), "special_tokens": SPECIAL_TOKENS}


def tokenize(dataset_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path, *, block_size: int = 128,
             shard_blocks: int = 4096, eval_fraction: float = 0.05, seed: int = 0) -> dict:
    """Pack EOS-separated documents into `block_size` blocks; write `shard-*.parquet` (block_id,
    input_ids) for training and `eval-*.parquet` for a held-out split, plus a manifest."""
    from transformers import PreTrainedTokenizerFast

    if block_size < 8:
        raise ConfigError([f"block_size must be ≥ 8 (got {block_size})"], what="tokenize config")
    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    eos = tok.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    docs = 0
    batch: list[str] = []
    for text in _texts(Path(dataset_dir)):
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
    if n_blocks < 2:
        raise DataError(f"{dataset_dir}: only {len(stream)} tokens, fewer than two blocks of {block_size}; "
                        "use more data or a smaller block_size")
    blocks = np.asarray(stream[: n_blocks * block_size], dtype=np.int32).reshape(n_blocks, block_size)
    order = np.random.default_rng(seed).permutation(n_blocks)
    n_eval = max(1, int(round(n_blocks * eval_fraction)))
    eval_ids, train_ids = np.sort(order[:n_eval]), np.sort(order[n_eval:])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for prefix, ids in (("shard", train_ids), ("eval", eval_ids)):
        for s in range(0, len(ids), shard_blocks):
            chunk = ids[s:s + shard_blocks]
            name = f"{prefix}-{s // shard_blocks:05d}.parquet"
            write_shard(out / name, chunk, blocks[chunk])  # row groups sized for block-level reads
            files.append({"file": name, "split": "train" if prefix == "shard" else "eval", "blocks": len(chunk)})
    tok_digest, _ = digest_dir(tokenizer_dir)
    unigram = np.bincount(blocks[train_ids].reshape(-1), minlength=len(tok)).astype(np.float64)
    p = unigram[unigram > 0] / unigram.sum()
    manifest = {"kind": "token_shards", "block_size": block_size, "num_blocks": int(len(train_ids)),
                "num_eval_blocks": int(n_eval), "num_tokens": int(len(train_ids) * block_size), "documents": docs,
                "vocab_size": len(tok), "eos_id": int(eos), "tokenizer_digest": tok_digest, "files": files,
                "unigram_entropy_nats": float(-(p * np.log(p)).sum()),
                "content_sha256": hashlib.sha256(blocks.tobytes()).hexdigest()}
    typed = TokenShardsManifest.from_dict(manifest)  # the one format (raypai.token_shards), checked as written
    typed.write(out)
    return typed.to_dict()
