"""`raypai server`, `raypai deploy …`, `raypai token …`.

    raypai token create ci --scope deploy --scope infer
    raypai server                  # port 8080, or a free one when 8080 is taken
    RAYPAI_TOKEN=… raypai deploy create tinychat --model tinychat --alias champion
    RAYPAI_TOKEN=… raypai deploy create big --model tinychat --max-ongoing-requests 32 --request-timeout-s 120
    RAYPAI_TOKEN=… raypai deploy update tinychat --canary-version 4 --canary-percent 20

`deploy` commands talk HTTP to the deploy API at $RAYPAI_API_URL (default: where `raypai server` runs)
with the bearer token in $RAYPAI_TOKEN; `token` commands write the metadata store directly.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from raypai import exits
from raypai.deployment import DEFAULT_ALIAS, DEFAULTS, ENGINES

deploy_app = typer.Typer(help="Deployments (talks to the deploy API over HTTP).", no_args_is_help=True)
token_app = typer.Typer(help="API tokens (stored hashed; shown once).", no_args_is_help=True)


def _settings():
    from raypai.settings import Settings

    return Settings.load()


def _api(method: str, path: str, body: dict | None = None):
    import httpx

    from raypai.runtime import DEFAULT_PORTS, endpoint_url
    from raypai.settings import check_token_destination

    settings, explicit = _settings(), os.environ.get("RAYPAI_API_URL")
    url = explicit or endpoint_url(settings, "api", DEFAULT_PORTS["api"])
    token = os.environ.get("RAYPAI_TOKEN", "")
    if token:  # a recorded address off this machine gets no token unless the user named or allowed it
        check_token_destination(settings, url, explicit=bool(explicit))
    try:
        r = httpx.request(method, f"{url}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=600)
    except httpx.ConnectError:
        typer.echo(f"deploy API not reachable at {url}: start it with `raypai server` or set RAYPAI_API_URL", err=True)
        raise typer.Exit(exits.FAILED) from None
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text or r.reason_phrase
        typer.echo(f"error {r.status_code}: {msg}", err=True)
        raise typer.Exit(exits.FAILED)
    if r.content:
        typer.echo(json.dumps(r.json(), indent=1, default=str))


@token_app.command("create")
def token_create(name: str, scope: List[str] = typer.Option(["infer"], help="deploy and/or infer")):
    from raypai.serving.auth import SCOPES
    from raypai.store import MetadataStore

    bad = [s for s in scope if s not in SCOPES]
    if bad:
        typer.echo(f"unknown scope(s) {bad}; use {SCOPES}", err=True)
        raise typer.Exit(exits.REFUSED)
    token = MetadataStore(_settings().database_url).create_token(name, scope)
    typer.echo(token)
    typer.echo(f"(token {name!r} with scopes {scope}: shown once, stored hashed)", err=True)


@token_app.command("list")
def token_list():
    from raypai.store import MetadataStore

    for t in MetadataStore(_settings().database_url).list_tokens():
        typer.echo(f"{t.name}\t{','.join(t.scopes)}\t{'revoked' if t.revoked else 'active'}")


@token_app.command("revoke")
def token_revoke(name: str):
    from raypai.store import MetadataStore

    MetadataStore(_settings().database_url).revoke_token(name)
    typer.echo(f"revoked {name}")


@deploy_app.command("create")
def create(
    name: str,
    model: str = typer.Option(..., help="registered model name (MLflow registry)"),
    version: Optional[int] = typer.Option(None, help="registry version (default: the alias)"),
    alias: Optional[str] = typer.Option(None, help=f"registry alias (default: {DEFAULT_ALIAS})"),
    replicas: int = DEFAULTS["replicas"],
    cpus: float = DEFAULTS["cpus"],
    gpus: float = DEFAULTS["gpus"],
    min_replicas: Optional[int] = typer.Option(None, help="autoscale from this many replicas…"),
    max_replicas: Optional[int] = typer.Option(None, help="…up to this many"),
    max_batch_size: int = DEFAULTS["max_batch_size"],
    batch_wait_timeout_s: float = typer.Option(
        DEFAULTS["batch_wait_timeout_s"], help="longest wait for a batch to fill (s)"
    ),
    max_kv_cells: int = typer.Option(
        DEFAULTS["max_kv_cells"], help="KV budget per replica: rows x (longest prompt + max_tokens)"
    ),
    max_ongoing_requests: int = typer.Option(
        DEFAULTS["max_ongoing_requests"], help="requests one replica holds at once"
    ),
    max_queued_requests: int = typer.Option(
        DEFAULTS["max_queued_requests"], help="requests waiting for a replica; past it 503 + Retry-After"
    ),
    request_timeout_s: float = typer.Option(
        DEFAULTS["request_timeout_s"], help="limit on one answer, a stream included; then 504 (s)"
    ),
    drain_timeout_s: float = typer.Option(
        DEFAULTS["drain_timeout_s"], help="a replica being removed finishes its requests for up to this long (s)"
    ),
    engine: str = typer.Option(
        DEFAULTS["engine"],
        help=f"{' | '.join(ENGINES)}; auto: vLLM when --gpus > 0 and vLLM is installed, else raypai's",
    ),
):
    body = {
        "name": name,
        "model": model,
        "version": version,
        "alias": alias,
        "replicas": replicas,
        "cpus": cpus,
        "gpus": gpus,
        "max_batch_size": max_batch_size,
        "batch_wait_timeout_s": batch_wait_timeout_s,
        "max_kv_cells": max_kv_cells,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "request_timeout_s": request_timeout_s,
        "drain_timeout_s": drain_timeout_s,
        "engine": engine,
    }
    if min_replicas is not None or max_replicas is not None:
        body["autoscaling"] = {
            k: v for k, v in {"min_replicas": min_replicas, "max_replicas": max_replicas}.items() if v is not None
        }
    _api("POST", "/api/v1/deployments", body)


@deploy_app.command("list")
def list_():
    _api("GET", "/api/v1/deployments")


@deploy_app.command("get")
def get(name: str):
    _api("GET", f"/api/v1/deployments/{name}")


@deploy_app.command("update")
def update(
    name: str,
    canary_version: Optional[int] = typer.Option(None, help="start a canary of this version"),
    canary_alias: Optional[str] = typer.Option(None, help="…or of the version behind this alias"),
    canary_percent: Optional[int] = typer.Option(None, help="share of traffic for the canary, 0-100"),
    promote: bool = typer.Option(
        False, help="make the canary the stable version (needs a healthy measured verdict on it, see `deploy get`)"
    ),
    force: bool = typer.Option(False, help="promote without a healthy measured verdict"),
    canary_policy: Optional[str] = typer.Option(None, help='JSON, e.g. {"min_requests": 50, "window_s": 600}'),
    replicas: Optional[int] = None,
):
    policy = None
    if canary_policy is not None:
        try:
            policy = json.loads(canary_policy)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--canary-policy {canary_policy!r} is not JSON ({exc})") from None
    body = {
        k: v
        for k, v in {
            "canary_version": canary_version,
            "canary_alias": canary_alias,
            "canary_percent": canary_percent,
            "promote": promote,
            "force": force,
            "canary_policy": policy,
            "replicas": replicas,
        }.items()
        if v not in (None, False)
    }
    _api("PATCH", f"/api/v1/deployments/{name}", body)


@deploy_app.command("rollback")
def rollback(name: str):
    _api("POST", f"/api/v1/deployments/{name}/rollback")


@deploy_app.command("delete")
def delete(name: str):
    _api("DELETE", f"/api/v1/deployments/{name}")


def server_command(
    port: Optional[int] = typer.Option(None, help="port of the deploy API [8080, or a free one]"),
    host: str = "127.0.0.1",
):
    """Run the deploy API (reconciles stored deployments with Ray Serve on start)."""
    import uvicorn

    from raypai.runtime import DEFAULT_PORTS, check_port, ensure_ray, pick_port, record_endpoint
    from raypai.serving.api import create_app

    s = _settings()
    if port is not None:
        check_port("deploy API", port)
    port = port or pick_port(DEFAULT_PORTS["api"])
    info = ensure_ray(s)  # raypai's recorded Ray head, RAY_ADDRESS, or a Ray inside this server
    s = s.replace(serve_port=info.serve_port)
    record_endpoint(s, "api", f"http://{host}:{port}")
    typer.echo(
        f"deploy API on http://{host}:{port} (docs /docs); OpenAI endpoint http://127.0.0.1:{info.serve_port}/v1 "
        f"on {info.describe()}"
    )
    uvicorn.run(create_app(s), host=host, port=port, log_level="info")
