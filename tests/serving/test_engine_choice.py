"""The deployment's engine (issue #38 item 6): the spec's `engine` field, its validation, and how `auto`
resolves (vLLM for a GPU deployment where vLLM imports, else raypai's engine). No Ray, no vLLM: the
vLLM-backed deployment itself is tests/serving/test_vllm_deploy.py (`make test-vllm`)."""

from __future__ import annotations

import pytest

from raypai.deployment import DEFAULTS, ENGINES, DeploymentSpec
from raypai.errors import ConfigError
from raypai.serving import vllm_server
from raypai.serving.vllm_server import resolve_engine


def test_the_spec_defaults_to_auto_and_keeps_its_engine_through_json():
    assert DEFAULTS["engine"] == "auto" and ENGINES == ("raypai", "vllm", "auto")
    spec = DeploymentSpec(model="m", version=1, engine="vllm")
    assert DeploymentSpec.from_dict(spec.to_dict()).engine == "vllm"
    # a spec stored before engines existed reads as auto (resolved when its replicas are started)
    assert DeploymentSpec.from_dict({"model": "m", "version": 1}).engine == "auto"


@pytest.mark.parametrize(
    "build",
    [
        lambda: DeploymentSpec(model="m", version=1, engine="tgi"),
        lambda: DeploymentSpec.from_dict({"model": "m", "version": 1, "engine": "tgi"}),
    ],
)
def test_an_unknown_engine_is_a_config_error_naming_the_choices(build):
    with pytest.raises(ConfigError) as err:
        build()
    assert "engine must be one of raypai, vllm, auto (got 'tgi')" in str(err.value)


def test_the_deploy_api_body_takes_the_engine_and_names_the_choices():
    from pydantic import ValidationError

    from raypai.serving.schemas import DeploymentCreate

    assert DeploymentCreate(name="a", model="m").engine == "auto"
    assert DeploymentCreate(name="a", model="m", engine="vllm").engine == "vllm"
    with pytest.raises(ValidationError) as err:
        DeploymentCreate(name="a", model="m", engine="tgi")
    assert "'raypai', 'vllm' or 'auto'" in str(err.value)


def test_auto_is_raypai_on_cpus_and_where_vllm_does_not_import(monkeypatch):
    assert resolve_engine("raypai", 1.0) == "raypai" and resolve_engine("vllm", 0.0) == "vllm"  # as asked
    monkeypatch.setattr(vllm_server, "vllm_available", lambda: True)
    assert resolve_engine("auto", 0.0) == "raypai"  # no GPUs asked: raypai's engine even with vLLM
    assert resolve_engine("auto", 0.5) == "vllm"
    monkeypatch.setattr(vllm_server, "vllm_available", lambda: False)
    assert resolve_engine("auto", 1.0) == "raypai"


def test_the_real_import_check_decides_auto_on_a_gpu_deployment():
    """The main venv has no vLLM (auto: raypai); `make test-vllm`'s venv has it (auto: vllm)."""
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        present = True
    except Exception:  # noqa: BLE001 - absent or broken: either way not importable
        present = False
    vllm_server.vllm_available.cache_clear()
    assert vllm_server.vllm_available() is present
    assert resolve_engine("auto", 1.0) == ("vllm" if present else "raypai")
