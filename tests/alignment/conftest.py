import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import ray


@pytest.fixture(scope="module")
def ray_align():
    """A local Ray with its dashboard (the state API behind `list_actors` lives there); yields the GCS
    address so state queries reach *this* instance even when colleagues run other Ray clusters."""
    ctx = ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_plain():
    """A local Ray without the dashboard, for modules that never query the state API: the dashboard's
    processes take seconds of CPU to start and keep a little busy all module long."""
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Llama and a byte-level BPE tokenizer with the chat tokens, made here (no downloads)."""
    from raypai.alignment.tasks.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
