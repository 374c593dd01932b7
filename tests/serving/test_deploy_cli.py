"""`raypai deploy create` carries every setting of the deployment spec to the stored spec: the CLI's
options, its JSON body over real HTTP, the deploy API's schema, `Controller.create` and the metadata
store. No Ray and no Serve: the controller's three Serve calls (start Serve, run a version, read its
status) are replaced, everything before and after them is the real code."""

from __future__ import annotations

import socket
import threading
import time

import pytest

# spec setting -> (CLI option, a value other than its default)
SETTINGS = {
    "replicas": ("--replicas", 3),
    "cpus": ("--cpus", 0.5),
    "gpus": ("--gpus", 0.25),
    "max_batch_size": ("--max-batch-size", 8),
    "batch_wait_timeout_s": ("--batch-wait-timeout-s", 0.05),
    "max_kv_cells": ("--max-kv-cells", 4096),
    "max_ongoing_requests": ("--max-ongoing-requests", 7),
    "max_queued_requests": ("--max-queued-requests", 9),
    "request_timeout_s": ("--request-timeout-s", 42.5),
    "drain_timeout_s": ("--drain-timeout-s", 12.0),
    "engine": ("--engine", "raypai"),  # (auto would pick vLLM for --gpus 0.25 where vLLM is installed)
}
BATCHING = ("max_batch_size", "batch_wait_timeout_s", "max_kv_cells")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def api(raypai_home, tmp_path):
    """The deploy API over HTTP on a free port, its controller real but for Serve; a registered model."""
    import uvicorn

    from raypai.runner import tracker_for
    from raypai.serving.api import create_app
    from raypai.serving.control import Controller
    from raypai.store import MetadataStore

    class NoServe(Controller):
        def start(self):
            pass

        def _run_version(self, name, spec, version):
            pass

        def _with_status(self, name, spec, state, history):
            return {"name": name, "state": state, "spec": spec.to_dict()}

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    tracker = tracker_for(raypai_home)
    tracker.register_model(tmp_path / "m", "chat", alias="champion")
    store = MetadataStore(raypai_home.database_url)
    ctl = NoServe(raypai_home, store=store, tracker=tracker)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(raypai_home, ctl, reconcile=False), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the deploy API did not start"
    yield {
        "url": f"http://127.0.0.1:{port}",
        "token": store.create_token("ci", ["deploy"]),
        "store": store,
        "home": raypai_home,
    }
    server.should_exit = True
    thread.join(timeout=10)


def _create(api, *args: str):
    from typer.testing import CliRunner

    from raypai.serving.cli import deploy_app

    env = {"RAYPAI_API_URL": api["url"], "RAYPAI_TOKEN": api["token"], "RAYPAI_HOME": str(api["home"].home)}
    return CliRunner().invoke(deploy_app, ["create", *args], env=env)


def _stored(spec) -> dict:
    d = spec.to_dict()
    return {k: (d["batching"][k] if k in BATCHING else d[k]) for k in SETTINGS}


def test_every_spec_setting_is_a_create_option():
    """A setting added to the spec (raypai.deployment.DEFAULTS) without a CLI option fails here."""
    import typer

    from raypai.deployment import DEFAULTS
    from raypai.serving.cli import deploy_app

    options = {p.name for p in typer.main.get_command(deploy_app).commands["create"].params}
    # not options of their own: the versions a canary/rollback sets, policies set by `deploy update`,
    # and autoscaling, which --min-replicas/--max-replicas build
    elsewhere = {"canary_version", "canary_percent", "previous_versions", "canary_policy", "autoscaling"}
    assert set(DEFAULTS) - elsewhere <= options, set(DEFAULTS) - elsewhere - options
    assert set(SETTINGS) == set(DEFAULTS) - elsewhere


def test_create_options_reach_the_stored_spec(api):
    args = [str(a) for opt, value in SETTINGS.values() for a in (opt, value)]
    made = _create(api, "tuned", "--model", "chat", *args)
    assert made.exit_code == 0, made.output
    spec = api["store"].get_deployment("tuned").spec
    assert _stored(spec) == {k: value for k, (_, value) in SETTINGS.items()}
    assert (spec.model, spec.version) == ("chat", 1)  # the version behind the default alias


def test_create_without_options_stores_the_spec_defaults(api):
    from raypai.deployment import DEFAULTS

    made = _create(api, "plain", "--model", "chat")
    assert made.exit_code == 0, made.output
    # the spec stores the engine `auto` resolved to: raypai's, without GPUs
    expected = {k: DEFAULTS[k] for k in SETTINGS} | {"engine": "raypai"}
    assert DEFAULTS["engine"] == "auto" and DEFAULTS["gpus"] == 0
    assert _stored(api["store"].get_deployment("plain").spec) == expected


def test_a_setting_out_of_range_is_refused_naming_it(api):
    made = _create(api, "bad", "--model", "chat", "--max-ongoing-requests", "0")
    assert made.exit_code == 1 and "error 400" in made.output and "max_ongoing_requests" in made.output, made.output
    assert api["store"].get_deployment("bad") is None
    made = _create(api, "bad", "--model", "chat", "--engine", "tgi")
    assert made.exit_code == 1 and "error 400" in made.output and "engine" in made.output, made.output
    assert api["store"].get_deployment("bad") is None
