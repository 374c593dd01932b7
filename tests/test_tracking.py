"""MLflow behind Tracker/RunLogger with a real SQLite backend store."""

import pickle

import pytest

from raypai.artifacts import ArtifactStore, digest_dir
from raypai.errors import NotFoundError, StoreError
from raypai.tracking import RunLogger, Tracker


def test_runs_metrics_datasets_and_registry(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_root=tmp_path / "mlart")
    parent = tracker.start_run("exp", "parent")
    child = tracker.start_run("exp", "child", parent_run_id=parent)
    logger = pickle.loads(pickle.dumps(RunLogger(tracker.uri, child)))  # as shipped into an actor
    logger.log_metrics({"loss": 2.5, "note": "skipped"}, step=3)
    logger.log_params({"opt": {"lr": 0.1}})
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.txt").write_text("x")
    art = ArtifactStore(str(tmp_path / "store")).put_dir(src, kind="dataset", name="data")
    logger.log_dataset(art)
    run = tracker.get_run(child)
    assert run.data.metrics == {"loss": 2.5} and run.data.params == {"opt.lr": "0.1"}
    assert run.inputs.dataset_inputs[0].dataset.digest == art.digest[:36]
    assert [r.info.run_id for r in tracker.child_runs(parent)] == [child]

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    v1 = tracker.register_model(model, "tiny", run_id=child, tags={"raypai.artifact_id": art.id}, alias="champion")
    v2 = tracker.register_model(model, "tiny")
    assert (v1, v2) == (1, 2)
    # every version records its files' digest (what a download is checked against)
    assert tracker.resolve_model("tiny", "champion") == (
        1,
        {"raypai.artifact_id": art.id, "raypai.digest": digest_dir(model)[0]},
    )
    local = tracker.download_model("tiny", "2", cache_dir=tmp_path / "cache")
    assert (local / "config.json").read_text() == '{"model_type": "llama"}'
    with pytest.raises(NotFoundError, match="no version or alias 'prod'"):
        tracker.resolve_model("tiny", "prod")
    with pytest.raises(StoreError, match="not a Hugging Face model folder"):
        tracker.register_model(tmp_path / "data", "tiny")


def test_library_functions_read_no_settings(tmp_path, monkeypatch):
    """download_model without a cache folder uses the user cache, not raypai's Settings: it works
    while the raypai environment is invalid (Settings.load() would raise)."""
    from raypai.errors import ConfigError
    from raypai.settings import Settings

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_root=tmp_path / "mlart")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    tracker.register_model(tmp_path / "model", "tiny")
    monkeypatch.setenv("RAYPAI_RAY_NUM_CPUS", "lots")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ConfigError):
        Settings.load()
    local = tracker.download_model("tiny", "1")
    assert local.parent.parent == tmp_path / "xdg" / "raypai" / "models"


def test_importing_tracking_leaves_the_environment_alone(tmp_path):
    """Telemetry is switched off when the first MLflow client is made, not as an import side effect."""
    import subprocess
    import sys

    code = (
        "import os, raypai.tracking as t; assert 'MLFLOW_DISABLE_TELEMETRY' not in os.environ, 'import wrote it'; "
        f"t.Tracker('sqlite:///{tmp_path}/m.db').client; assert os.environ['MLFLOW_DISABLE_TELEMETRY'] == 'true'"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
