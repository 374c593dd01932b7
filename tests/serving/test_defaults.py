"""Every deploy default has one source, the deployment spec (raypai.deployment): the `raypai deploy
create` options, the deploy API's schema, `Controller.create` and the pipeline `deploy` step take
theirs from it, and the registry alias a deploy resolves by default is one constant. No Ray cluster
and no Serve: typer's parsed options, pydantic's fields and the functions' signatures."""

from __future__ import annotations

import dataclasses
import inspect

import pytest


def _spec_defaults() -> dict:
    """The spec's defaults, named as the deploy surfaces name them (batching's fields at top level)."""
    from raypai.deployment import Batching, DeploymentSpec

    out = {}
    for cls in (DeploymentSpec, Batching):
        out.update({f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING})
    return out


def _cli_options() -> list:
    """`raypai deploy create`'s options, as typer hands them to click (name, default, help)."""
    import typer

    from raypai.serving.cli import deploy_app

    return typer.main.get_command(deploy_app).commands["create"].params


def _signature_defaults(fn) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def _surfaces() -> dict:
    from raypai.serving.control import Controller
    from raypai.serving.schemas import DeploymentCreate
    from raypai.serving.steps import deploy

    return {
        "cli": {p.name: p.default for p in _cli_options()},
        "schema": {n: f.default for n, f in DeploymentCreate.model_fields.items()},
        "controller": _signature_defaults(Controller.create),
        "step": _signature_defaults(deploy.fn),
    }


# the resource and batching settings each surface takes (a surface that stops taking one fails here too)
TAKES = {
    "cli": ("replicas", "cpus", "gpus", "max_batch_size"),
    "schema": ("replicas", "cpus", "gpus", "max_batch_size", "batch_wait_timeout_s"),
    "controller": ("replicas", "cpus", "gpus", "max_batch_size", "batch_wait_timeout_s"),
    "step": ("replicas", "cpus"),
}


@pytest.mark.parametrize("surface", sorted(TAKES))
def test_each_deploy_surface_defaults_to_the_specs_values(surface):
    spec, defaults = _spec_defaults(), _surfaces()[surface]
    assert {"replicas": 1, "cpus": 1.0, "gpus": 0.0}.items() <= spec.items(), spec  # the spec's own values
    drift = {
        name: (defaults.get(name, "<missing>"), spec[name])
        for name in TAKES[surface]
        if defaults.get(name) != spec[name]
    }
    assert not drift, f"{surface}: (its default, the spec's) {drift}"


def test_the_default_alias_is_one_constant_that_register_and_deploy_both_use(raypai_home, tmp_path):
    """`register` moves DEFAULT_ALIAS, the CLI names it, and the controller resolves it when a deploy
    names neither a version nor an alias (a real MLflow registry: the alias, not the latest version)."""
    from raypai.deployment import DEFAULT_ALIAS
    from raypai.runner import tracker_for
    from raypai.serving.control import Controller
    from raypai.serving.schemas import DeploymentCreate
    from raypai.serving.steps import register
    from raypai.store import MetadataStore

    assert _signature_defaults(register.fn)["alias"] == DEFAULT_ALIAS
    alias_help = next(p.help for p in _cli_options() if p.name == "alias")
    assert f"default: {DEFAULT_ALIAS}" in alias_help, alias_help
    assert DEFAULT_ALIAS in DeploymentCreate.model_fields["alias"].description

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    tracker = tracker_for(raypai_home)
    assert tracker.register_model(tmp_path / "m", "chat", alias=DEFAULT_ALIAS) == 1
    assert tracker.register_model(tmp_path / "m", "chat") == 2  # newer, but not behind the alias
    ctl = Controller(raypai_home, store=MetadataStore(raypai_home.database_url), tracker=tracker)
    assert ctl._resolve("chat", None, None) == 1
    assert ctl._resolve("chat", 2, None) == 2
