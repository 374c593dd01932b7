"""Fixtures for raypai.train: generated token shards, a matching tokenizer, a file-backed logger,
an S3 server, and a Ray whose object store is deliberately small."""

import json
import os
import socket
import uuid
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


def peak_rss_growth(fn):
    """(fn(), how far this process's peak resident memory rose above its RSS at the call) in bytes.
    Linux: writing 5 to /proc/self/clear_refs restarts the peak (VmHWM) at the current RSS."""

    def status(key):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    start = status("VmRSS")
    result = fn()
    return result, status("VmHWM") - start


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


# Ray's smallest allowed object store (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES): the
# pretraining tests train on token sets several times larger, which only streaming can do.
OBJECT_STORE_BYTES = 75 * 2**20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """(endpoint, bucket): moto's S3 server on a free loopback port with a fresh bucket, and the
    AWS variables pointing at it in this process. Start it before Ray: local Ray workers inherit
    the environment of the process that started Ray, as cluster nodes carry their credentials."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "raypai",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            mp.setenv(k, v)
        bucket = f"raypai-train-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield endpoint, bucket
    server.stop()


@pytest.fixture(scope="module")
def ray_train(s3):
    # 2 Train workers × 1 CPU + the step/driver: logical CPUs, the machine has 2 cores. The object
    # store is Ray's minimum, smaller than the token sets trained on.
    # The GCS port is chosen here and RAY_ADDRESS names it for every process of this Ray: Ray
    # Train's PlacementGroupCleaner asks the state API whether the controller lives, and without
    # RAY_ADDRESS it finds "the" cluster by auto-detection, which on a machine running other Ray
    # clusters can be another one, where our controller is unknown, so it removes our workers'
    # placement group mid-run.
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_GCS_SERVER_PORT", str(port))
        mp.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        # dashboard_port: Ray records an API server address even without a dashboard (8265 by default),
        # and the cleaner asks the state API there; another Ray's dashboard on 8265 (an alignment test
        # running beside this file) answered "no such actor" and the cleaner removed the run's workers
        ray.init(
            address="local",
            num_cpus=6,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            dashboard_port=_free_port(),
            log_to_driver=False,
        )
        assert ray.get_runtime_context().gcs_address.endswith(f":{port}")
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    return d, make_shards(d)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
