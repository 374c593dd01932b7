"""Deployment writes are compare-and-swap on `row_version` (SQLite and PostgreSQL): an update that read
the desired state before the router rolled a canary back never writes that canary back, two creates
of one name cannot both succeed, and a malformed `canary_policy` is a 400 (DeployError) naming the field.

These tests are about the desired state in the metadata store, so Serve is replaced by an empty one
(`_NoServe`): the control plane's Serve calls (status, delete) find no applications.
"""

from __future__ import annotations

import threading
import types
import uuid

import pytest

from raypai.deployment import DeploymentSpec
from raypai.errors import DeployError, DeploymentConflict
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tracking import Tracker


class _NoServe:
    """Ray Serve with no applications; `on_status` runs inside the first `status()` call, which
    `Controller.update` makes between reading the deployment and writing it back."""

    def __init__(self, on_status=None):
        self.on_status = on_status

    def status(self):
        hook, self.on_status = self.on_status, None
        if hook is not None:
            hook()
        return types.SimpleNamespace(applications={})

    def delete(self, app):
        pass


def _controller(db_url, tmp_path, monkeypatch, serve):
    from raypai.serving import control

    monkeypatch.setattr(control, "serve", serve)
    settings = Settings.load({"RAYPAI_HOME": str(tmp_path), "RAYPAI_DATABASE_URL": db_url})
    store = MetadataStore(db_url)
    return control.Controller(settings, store=store, tracker=Tracker(settings.mlflow_tracking_uri)), store


def _with_canary(store, name):
    store.save_deployment(name, DeploymentSpec(model="m", version=1).with_canary(2, 20), "running")


def test_an_update_that_read_before_the_routers_rollback_does_not_resurrect_the_canary(db_url, tmp_path, monkeypatch):
    """The interleaving that brought canaries back: update reads (canary v2), the router rolls v2 back,
    update writes. The write must fail its compare-and-swap and be decided again on the new state."""
    name = f"chat-{uuid.uuid4().hex[:6]}"
    serve = _NoServe()
    ctl, store = _controller(db_url, tmp_path, monkeypatch, serve)
    _with_canary(store, name)
    serve.on_status = lambda: store.rollback_canary(name, 2, "worse: error rate +30%")
    out = ctl.update(name, canary_policy={"window_s": 60, "min_requests": 5})
    spec = store.get_deployment(name).spec
    assert spec.canary_version is None, "the rolled-back canary was written back"
    assert spec.canary_policy["window_s"] == 60.0  # the update itself still applied, to the new state
    assert out["spec"]["canary_version"] is None
    events = [h.get("event", "") for h in store.get_deployment(name).history]
    assert any("rolled back automatically" in e for e in events)

    # a change that needs the canary is refused once the canary is gone, instead of writing it back
    _with_canary(store, name)
    serve.on_status = lambda: store.rollback_canary(name, 2, "worse")
    with pytest.raises(DeployError, match="has no canary"):
        ctl.update(name, canary_percent=50)
    assert store.get_deployment(name).spec.canary_version is None


def test_concurrent_updates_and_router_rollbacks_never_resurrect_a_canary(db_url, tmp_path, monkeypatch):
    """Threads updating the policy while another rolls the canary back, many rounds: after each round
    the canary stays rolled back, and every update landed (none was lost to a concurrent write)."""
    ctl, store = _controller(db_url, tmp_path, monkeypatch, _NoServe())
    name = f"race-{uuid.uuid4().hex[:6]}"
    for round_ in range(6):
        _with_canary(store, name)
        before = store.get_deployment(name).row_version
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def updater(i, round_=round_, start=start, errors=errors):
            start.wait()
            try:
                for j in range(3):
                    ctl.update(name, canary_policy={"window_s": 10 + round_ * 100 + i * 10 + j})
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def router(start=start):
            start.wait()
            assert store.rollback_canary(name, 2, "worse")

        threads = [threading.Thread(target=updater, args=(i,)) for i in range(3)] + [threading.Thread(target=router)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        rec = store.get_deployment(name)
        assert rec.spec.canary_version is None, f"round {round_}: canary v2 came back"
        assert rec.row_version == before + 3 * 3 + 1  # 9 updates and the rollback: each one write


def test_an_update_on_a_stale_read_is_a_conflict_at_the_store(db_url):
    store = MetadataStore(db_url)
    name = f"cas-{uuid.uuid4().hex[:6]}"
    spec = DeploymentSpec(model="m", version=1)
    first = store.create_deployment(name, spec, "running")
    second = store.save_deployment(name, spec.with_canary(2, 10), "running", expected_row_version=first.row_version)
    assert second.row_version == first.row_version + 1
    with pytest.raises(DeploymentConflict, match="changed while this change was being made"):
        store.save_deployment(name, spec, "running", expected_row_version=first.row_version)
    assert store.get_deployment(name).spec.canary_version == 2
    assert store.rollback_canary(name, 2, "worse")
    assert store.get_deployment(name).row_version == second.row_version + 1


def test_concurrent_creates_of_one_name_exactly_one_wins(db_url):
    store = MetadataStore(db_url)
    name = f"new-{uuid.uuid4().hex[:6]}"
    start = threading.Barrier(6)
    won, refused = [], []

    def create(i):
        start.wait()
        try:
            won.append(store.create_deployment(name, DeploymentSpec(model="m", version=i + 1), "deploying"))
        except DeploymentConflict as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(refused) == 5, (won, refused)
    assert "already exists" in refused[0]
    assert store.get_deployment(name).spec == won[0].spec


@pytest.mark.parametrize(
    "policy, field",
    [
        ({"window_s": "soon"}, "window_s"),
        ({"min_requests": [1]}, "min_requests"),
        ({"auto_rollback": "perhaps"}, "auto_rollback"),
        ({"windw_s": 5}, "windw_s"),
        ({"max_latency_ratio": 0.5}, "max_latency_ratio"),
        ("fast", "mapping"),
    ],
)
def test_a_bad_canary_policy_is_a_deploy_error_naming_the_field(tmp_path, monkeypatch, policy, field):
    ctl, store = _controller(f"sqlite:///{tmp_path}/raypai.db", tmp_path, monkeypatch, _NoServe())
    _with_canary(store, "chat")
    with pytest.raises(DeployError) as err:  # the deploy API answers a DeployError with 400
        ctl.update("chat", canary_policy=policy)
    assert field in str(err.value) and "canary_policy" in str(err.value)
    assert store.get_deployment("chat").row_version == 1  # nothing written
