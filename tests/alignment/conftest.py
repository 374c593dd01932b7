import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest


@pytest.fixture(scope="module")
def ray_align(shared_ray):
    """A local Ray with its dashboard (the state API behind `list_actors` lives there); yields the GCS
    address so state queries reach *this* instance even when colleagues run other Ray clusters. The
    test process's shared Ray (tests/conftest.py), started with the dashboard if it has none."""
    return shared_ray(num_cpus=8, dashboard=True)


@pytest.fixture(scope="module")
def ray_plain(shared_ray):
    """A local Ray for modules that never query the state API: the shared one (tests/conftest.py),
    started without the dashboard when none runs, whose processes take seconds of CPU to start."""
    return shared_ray(num_cpus=8)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Llama and a byte-level BPE tokenizer with the chat tokens, made here (no downloads)."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
