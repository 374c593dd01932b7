"""Fixtures for raypai.train: generated token shards, a matching tokenizer, a file-backed logger."""

import json
import os
from pathlib import Path

import pytest
import ray

from raypai.train.synthetic import write_token_shards

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def make_shards(folder: Path, *, vocab: int = 64, block: int = 32, blocks: int = 256, seed: int = 0) -> dict:
    """Token shards of a noisy deterministic "language" (next = (3·t + 1) mod V, 90% of the time)."""
    return write_token_shards(folder, vocab=vocab, block=block, blocks=blocks, seed=seed)


def make_tokenizer(folder: Path, vocab: int = 64) -> Path:
    """A word-level tokenizer whose ids match `make_shards`: "<eos>"=0, "<pad>"=1, "t2".."t{V-1}"."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 0, "<pad>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>").save_pretrained(folder)
    return folder


class FileLogger:
    """A picklable metrics sink (the RunLogger interface) that appends JSON lines to a file."""

    def __init__(self, path):
        self.path = str(path)

    def log_metrics(self, metrics, step=None):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def log_params(self, params):
        pass

    def read(self):
        return [json.loads(line) for line in open(self.path)]


@pytest.fixture(scope="module")
def ray_train():
    # 2 Train workers × 1 CPU + the step/driver: logical CPUs, the machine has 2 cores.
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    return d, make_shards(d)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
