"""MLflow behind Tracker/RunLogger with a real SQLite backend store."""

import pickle

import pytest

from raypai.artifacts import ArtifactStore
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
    assert tracker.resolve_model("tiny", "champion") == (1, {"raypai.artifact_id": art.id})
    local = tracker.download_model("tiny", "2", cache_dir=tmp_path / "cache")
    assert (local / "config.json").read_text() == '{"model_type": "llama"}'
    with pytest.raises(NotFoundError, match="no version or alias 'prod'"):
        tracker.resolve_model("tiny", "prod")
    with pytest.raises(StoreError, match="not a Hugging Face model folder"):
        tracker.register_model(tmp_path / "data", "tiny")
