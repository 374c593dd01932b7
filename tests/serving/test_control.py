"""The control plane's refusals name what exists and what to do next (the Serve paths themselves
run in tests/serving/test_serving.py)."""

import pytest

from raypai.deployment import DeploymentSpec
from raypai.errors import DeployError, DeploymentConflict, NotFoundError, RaypaiError
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tracking import Tracker


def test_unknown_deployment_names_the_known_ones_and_the_next_step(tmp_path, monkeypatch):
    from raypai.serving.control import Controller

    monkeypatch.setenv("RAYPAI_HOME", str(tmp_path))
    settings = Settings.load()
    store = MetadataStore(settings.database_url)
    ctl = Controller(settings, store=store, tracker=Tracker(settings.mlflow_tracking_uri))
    with pytest.raises(
        NotFoundError,
        match=r"deployment 'chat' not found \(known deployments: none yet\); "
        r"list them with `raypai deploy list`",
    ):
        ctl.describe("chat")
    store.save_deployment("chatbot", DeploymentSpec(model="m", version=1), "running")
    store.save_deployment("summary", DeploymentSpec(model="m", version=2), "running")
    with pytest.raises(NotFoundError, match=r"known deployments: chatbot, summary\)"):
        ctl.rollback("chat")
    with pytest.raises(DeploymentConflict, match="`raypai deploy update chatbot ...`"):
        ctl.create("chatbot", "m", 1)


def test_a_serve_application_that_never_runs_says_where_to_look():
    from raypai.serving.control import _wait_running

    with pytest.raises(DeployError) as err:
        _wait_running("raypai-chat-v1", timeout_s=0)
    text = str(err.value)
    assert "raypai-chat-v1 not running after 0s (status MISSING)" in text
    assert "`ray status`" in text and "logs/serve/" in text and "Serve tab" in text


def test_deployment_conflict_is_a_raypai_error():
    assert issubclass(DeploymentConflict, DeployError) and issubclass(DeploymentConflict, RaypaiError)
    from raypai.serving import control

    assert control.DeploymentConflict is DeploymentConflict  # one class, however it is imported
