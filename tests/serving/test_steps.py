"""The deploy step's metric gate (the step itself runs in tests/e2e/test_tinychat.py)."""


def test_deploy_metric_gate_lists_every_unmet_threshold():
    from raypai.serving.steps import unmet_gates

    assert unmet_gates({"acc": 0.8, "ppl": 3.0}, {"acc": 0.5}) == []
    assert unmet_gates({"acc": 0.4}, {"acc": 0.5, "bleu": 0.1}) == ["acc=0.4 < 0.5", "bleu=None < 0.1"]
    assert unmet_gates(None, None) == []


def test_a_cached_deploy_holds_only_while_its_deployment_serves_that_version(tmp_path):
    """The deploy step's cache check (Serve's own status is checked in tests/test_runtime.py's demo run)."""
    from raypai.deployment import DeploymentSpec
    from raypai.serving.steps import still_serving
    from raypai.store import MetadataStore

    store = MetadataStore(f"sqlite:///{tmp_path}/meta.db")
    cached = {"deployed": True, "deployment": "chat", "model": "m", "version": 3, "endpoint": "http://x/v1"}
    assert still_serving({"deployed": False, "reason": "metric gate: acc=0.1 < 0.5"}, store) is None
    assert still_serving(cached, store) == "deployment 'chat' is gone now"
    store.save_deployment("chat", DeploymentSpec(model="m", version=4), "running")
    assert still_serving(cached, store) == "deployment 'chat' now serves version 4, not 3"
    store.save_deployment("chat", DeploymentSpec(model="m", version=3), "failed")
    assert still_serving(cached, store) == "deployment 'chat' is failed now"
