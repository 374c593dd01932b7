"""The token-shards manifest: the contract between the tokenizer that writes token shards
(raypai.data.tokenizer, raypai.train.synthetic) and the pretraining that reads them (raypai.train).

    manifest = TokenShardsManifest(block_size=128, vocab_size=512, files=(ShardFile("shard-00000.parquet"),))
    manifest.write(folder)                           # folder/manifest.json
    manifest = TokenShardsManifest.from_dict(json.loads(text))   # ConfigError naming every bad field

A token-shards folder holds `manifest.json` and Parquet files (`shard-*.parquet` for training,
`eval-*.parquet` held out) with a `block_id` int64 column and an `input_ids` list<int32> column of
`block_size` tokens per row (docs/interfaces.md, "Data boundaries").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from raypai.config import parse_config
from raypai.errors import ConfigError

MANIFEST = "manifest.json"
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class ShardFile:
    file: str  # name inside the folder
    split: str = "train"  # train | eval
    blocks: int = 0  # rows (blocks) it holds


@dataclass(frozen=True)
class TokenShardsManifest:
    block_size: int  # tokens per block (row)
    vocab_size: int
    files: tuple[ShardFile, ...]
    num_blocks: int = 0  # train blocks
    num_eval_blocks: int = 0
    num_tokens: int = 0  # train tokens = num_blocks * block_size
    documents: int = 0
    eos_id: int | None = None
    tokenizer_digest: str | None = None  # digest of the tokenizer artifact that produced the ids
    unigram_entropy_nats: float | None = None  # of the train tokens: the loss a model without context reaches
    content_sha256: str | None = None
    kind: str = "token_shards"

    def files_of(self, split: str) -> list[str]:
        """File names of one split, in manifest order (the order blocks are numbered in)."""
        return [f.file for f in self.files if f.split == split]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TokenShardsManifest":
        """The manifest from its JSON; a malformed one is a ConfigError naming every bad field."""
        if not isinstance(d, dict):
            raise ConfigError([f"expected a JSON object, got {type(d).__name__}"], what="token-shards manifest")
        problems, files = [], []
        raw_files = d.get("files", [])
        if not isinstance(raw_files, list):
            problems.append(f"files must be a list of {{file, split, blocks}} (got {type(raw_files).__name__})")
            raw_files = []
        for i, f in enumerate(raw_files):
            try:
                files.append(parse_config(ShardFile, f, what=f"files[{i}]"))
            except ConfigError as err:
                problems += [f"files[{i}]: {p}" for p in err.problems]
        problems += [
            f"files[{i}]: split {f.split!r} is unknown; use one of {', '.join(SPLITS)}"
            for i, f in enumerate(files)
            if f.split not in SPLITS
        ]
        rest = {k: v for k, v in d.items() if k != "files"}
        try:
            manifest = parse_config(cls, {**rest, "files": tuple(files)}, what="token-shards manifest")
        except ConfigError as err:
            problems = err.problems + problems
            manifest = None
        if "files" not in d:
            problems.append("files is required (the shard files and their splits)")
        if manifest is not None and manifest.kind != "token_shards":
            problems.append(f"kind is {manifest.kind!r}, not 'token_shards': this folder holds another artifact")
        if problems:
            raise ConfigError(problems, what="token-shards manifest")
        return manifest

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / MANIFEST
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


__all__ = ["TokenShardsManifest", "ShardFile", "MANIFEST", "SPLITS"]
