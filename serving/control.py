"""The control plane: desired state in the metadata store, applied to Ray Serve.

Each (deployment, version) is its own Serve application `raypai-<name>-v<version>` (no HTTP route);
one router application owns `/` and reads the routing table from the store.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ray import serve

from raypai.config import parse_config
from raypai.deployment import DEFAULT_ALIAS, DEFAULTS, Batching, DeploymentSpec
from raypai.errors import ConfigError, DeployError, DeploymentConflict, NotFoundError
from raypai.serving.canary import CanaryPolicy
from raypai.serving.limits import Limits
from raypai.serving.model_server import ModelServer
from raypai.serving.router import Freshness, Router, app_name
from raypai.serving.vllm_server import VllmServer, resolve_engine
from raypai.settings import Settings
from raypai.store import MetadataStore
from raypai.tracking import ADAPTER_OF_TAG, Tracker

ROUTER_APP = "raypai-router"
__all__ = ["Controller", "DeploymentConflict", "ROUTER_APP", "serve_port"]


def serve_port(settings: Settings | None = None) -> int:
    """The Serve HTTP port: the settings' (raypai.runtime fills it in), else $RAYPAI_SERVE_PORT, else 8000."""
    if settings is not None and settings.serve_port:
        return settings.serve_port
    return int(os.environ.get("RAYPAI_SERVE_PORT", "8000"))


def _serve_running() -> bool:
    """Serve's controller is alive in this Ray (its name and namespace are Ray Serve's)."""
    import ray

    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


def _check_port_free(port: int) -> None:
    """Before Serve first starts: its proxy binds with SO_REUSEPORT, so on a port another server holds
    the same way (another Ray's Serve: a second checkout, a test process, `make demo`) both would listen
    and the kernel would split requests between the two endpoints. Checked where the proxy will run,
    the head node; a driver on another node cannot see that machine's ports."""
    import ray

    from raypai.runtime import port_is_free

    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)
    if head != ray.get_runtime_context().get_node_id() or port_is_free(port):
        return
    raise DeployError(
        f"Serve port {port} is already in use on this machine (another Ray's Serve, or another "
        "server; Serve would share it and split requests with it); set RAYPAI_SERVE_PORT (or "
        "serve_port in the raypai config) to a free port, or stop whatever listens on it"
    )


class Controller:
    def __init__(
        self,
        settings: Settings,
        store: MetadataStore | None = None,
        tracker: Tracker | None = None,
        limits: Limits | None = None,
        freshness: Freshness | None = None,
    ):
        self.settings = settings
        # the router's limits; RAYPAI_SERVE_MAX_BODY_BYTES etc. (raypai.serving.limits)
        self.limits = limits if limits is not None else Limits.from_env(os.environ)
        # how long the router trusts what it read; RAYPAI_SERVE_TOKEN_TTL_S etc. (raypai.serving.router)
        self.freshness = freshness if freshness is not None else Freshness.from_env(os.environ)
        self.store = store or MetadataStore(settings.database_url)
        self.tracker = tracker or Tracker(settings.mlflow_tracking_uri)

    # ---- Serve ---------------------------------------------------------------------------------

    def start(self) -> None:
        if not _serve_running():
            _check_port_free(serve_port(self.settings))
        # host: settings.serve_host (RAYPAI_SERVE_HOST); 0.0.0.0 in the cluster manifests
        serve.start(http_options={"host": self.settings.serve_host, "port": serve_port(self.settings)})
        apps = serve.status().applications
        if ROUTER_APP not in apps:
            serve.run(
                Router.bind(self.settings.database_url, self.limits, self.freshness),
                name=ROUTER_APP,
                route_prefix="/",
                blocking=False,
            )

    def _run_version(self, name: str, spec: DeploymentSpec, version: int) -> None:
        # the engine `create` resolved (a spec stored before engines existed reads "auto": resolved here)
        engine = resolve_engine(spec.engine, spec.gpus)
        server_cls = VllmServer if engine == "vllm" else ModelServer
        opts = {
            "name": server_cls.name,
            "ray_actor_options": {"num_cpus": spec.cpus, "num_gpus": spec.gpus},
            "max_ongoing_requests": spec.max_ongoing_requests,
            # waiting at the router (the caller) past this: BackPressureError, answered 503 + Retry-After
            "max_queued_requests": spec.max_queued_requests,
            # a replica being removed (rollback, promote, scale-down, delete) stops taking requests and
            # finishes those it has, for up to drain_timeout_s, before it is stopped
            "graceful_shutdown_wait_loop_s": 0.5,
            "graceful_shutdown_timeout_s": spec.drain_timeout_s,
        }
        if spec.autoscaling:
            opts["autoscaling_config"] = spec.autoscaling
        else:
            opts["num_replicas"] = spec.replicas
        server = server_cls.options(**opts).bind(
            spec.model,
            version,
            self.settings.mlflow_tracking_uri,
            max_batch_size=spec.batching.max_batch_size,
            batch_wait_timeout_s=spec.batching.batch_wait_timeout_s,
            max_kv_cells=spec.batching.max_kv_cells,
        )
        serve.run(server, name=app_name(name, version), route_prefix=None, blocking=False)
        _wait_running(app_name(name, version))

    def _resolve(self, model: str, version: int | None, alias: str | None) -> int:
        ref = version if version is not None else (alias or DEFAULT_ALIAS)
        try:
            v, tags = self.tracker.resolve_model(model, ref)
        except NotFoundError as exc:
            raise DeployError(
                f"refused: {exc}. Only models registered in the MLflow registry can be deployed"
            ) from None
        if tags.get(ADAPTER_OF_TAG):  # a PEFT folder, not a model: a replica would have no weights to load
            raise DeployError(
                f"refused: {model} version {v} is a LoRA adapter on {tags[ADAPTER_OF_TAG]}, not a model; register "
                f"the merged model and deploy that: `raypai model import ADAPTER_DIR --base {tags[ADAPTER_OF_TAG]} "
                f"--name {model}-merged --merge`"
            )
        return v

    # ---- desired state --------------------------------------------------------------------------

    def create(
        self,
        name: str,
        model: str,
        version: int | None = None,
        alias: str | None = None,
        *,
        replicas: int = DEFAULTS["replicas"],
        autoscaling: dict | None = DEFAULTS["autoscaling"],
        cpus: float = DEFAULTS["cpus"],
        gpus: float = DEFAULTS["gpus"],
        max_batch_size: int = DEFAULTS["max_batch_size"],
        batch_wait_timeout_s: float = DEFAULTS["batch_wait_timeout_s"],
        max_kv_cells: int = DEFAULTS["max_kv_cells"],
        max_ongoing_requests: int = DEFAULTS["max_ongoing_requests"],
        max_queued_requests: int = DEFAULTS["max_queued_requests"],
        request_timeout_s: float = DEFAULTS["request_timeout_s"],
        drain_timeout_s: float = DEFAULTS["drain_timeout_s"],
        engine: str = DEFAULTS["engine"],
    ) -> dict:
        """Deploy `model` at `version`, or at the version behind `alias` (neither: DEFAULT_ALIAS); the
        defaults are the deployment spec's (raypai.deployment.DEFAULTS). `engine` "auto" is resolved
        here (vLLM for a GPU deployment where vLLM imports, else raypai's) and the spec stores the result."""
        if self.store.get_deployment(name) is not None:
            raise DeploymentConflict(
                f"deployment {name!r} already exists; change its version or scale with "
                f"`raypai deploy update {name} ...` (PATCH /api/v1/deployments/{name}), "
                "or delete it first"
            )
        v = self._resolve(model, version, alias)
        spec = DeploymentSpec(
            model=model,
            version=v,
            replicas=replicas,
            autoscaling=autoscaling,
            cpus=cpus,
            gpus=gpus,
            batching=Batching(max_batch_size, batch_wait_timeout_s, max_kv_cells),
            max_ongoing_requests=max_ongoing_requests,
            max_queued_requests=max_queued_requests,
            request_timeout_s=request_timeout_s,
            drain_timeout_s=drain_timeout_s,
            engine=engine,  # validated by the spec (ConfigError naming the choices)
        )
        spec = replace(spec, engine=resolve_engine(spec.engine, spec.gpus))
        self.start()
        # insert-or-fail: of two concurrent creates of `name`, the second gets DeploymentConflict (409)
        rec = self.store.create_deployment(name, spec, "deploying")
        try:
            self._run_version(name, spec, v)
        except DeployError:
            self.store.save_deployment(name, spec, "failed")  # kept for inspection; DELETE removes it
            raise
        return self._record(name, spec, "running", expected_row_version=rec.row_version)

    def update(
        self,
        name: str,
        *,
        canary_version: int | None = None,
        canary_alias: str | None = None,
        canary_percent: int | None = None,
        promote: bool = False,
        force: bool = False,
        canary_policy: dict | None = None,
        replicas: int | None = None,
        autoscaling: dict | None = None,
    ) -> dict:
        """Start, resize, promote a canary; rescale. Promotion needs the router's latest verdict on the
        canary to be `healthy` (raypai.serving.canary) unless `force`; a refusal says why.

        Read, change, compare-and-swap: the desired state is written only if nobody (the router rolling
        a canary back, another update) wrote it since it was read; otherwise the change is decided
        again on the new state, so a canary rolled back meanwhile is never written back."""
        policy = _canary_policy(canary_policy) if canary_policy is not None else None
        for _attempt in range(_CAS_TRIES):
            rec = self._get(name)
            spec = rec.spec
            self._collect_orphans(name, spec)
            if policy is not None:
                spec = replace(spec, canary_policy=policy)
            if canary_version is not None or canary_alias is not None:
                v = self._resolve(spec.model, canary_version, canary_alias)
                if v == spec.version:
                    raise DeploymentConflict(f"version {v} is already the stable version of {name!r}")
                self._run_version(name, spec, v)
                spec = spec.with_canary(v, 10 if canary_percent is None else canary_percent)
                # a new canary starts unjudged (an earlier verdict on the same version number is not about it)
                self.store.record_canary_check(
                    name,
                    spec.version,
                    v,
                    "insufficient",
                    "canary started: no traffic measured yet",
                    {"policy": CanaryPolicy.from_spec(spec.canary_policy).to_dict()},
                )
            elif canary_percent is not None:
                if spec.canary_version is None:
                    raise DeployError(f"{name!r} has no canary; start one with canary_version")
                spec = replace(spec, canary_percent=canary_percent)
            if replicas is not None or autoscaling is not None:
                spec = replace(spec, replicas=replicas or spec.replicas, autoscaling=autoscaling)
                for v in spec.versions():
                    self._run_version(name, spec, v)
            old = None
            if promote:
                if spec.canary_version is None:
                    raise DeployError(f"{name!r} has no canary to promote")
                if not force:
                    check = self.store.latest_canary_check(name, spec.canary_version)
                    if check is None or check["decision"] != "healthy":
                        why = check["reason"] if check else "no canary traffic has been measured yet"
                        raise DeploymentConflict(
                            f"promotion of v{spec.canary_version} refused: {why}. Send it traffic "
                            "(canary_percent) until the verdict is healthy, or promote with force=true"
                        )
                old = spec.version
                spec = spec.promoted()
            try:
                # route to the new stable version before the old one goes
                out = self._record(name, spec, "running", expected_row_version=rec.row_version)
            except DeploymentConflict:
                _backoff(_attempt)  # changed since it was read (the router rolled the canary back?): decide again
                continue
            if old is not None:
                serve.delete(app_name(name, old))
            return out
        raise DeploymentConflict(
            f"deployment {name!r} kept changing while this update was applied ({_CAS_TRIES} tries); retry"
        )

    def rollback(self, name: str) -> dict:
        """Drop the canary if there is one; otherwise go back to the previous stable version."""
        for _attempt in range(_CAS_TRIES):
            rec = self._get(name)
            spec = rec.spec
            self._collect_orphans(name, spec)
            if spec.canary_version is not None:
                gone = spec.canary_version
                spec = spec.with_canary(None)
            elif spec.previous_versions:
                gone = spec.version
                spec = spec.rolled_back()
                self._run_version(name, spec, spec.version)
            else:
                raise DeployError(
                    f"{name!r} has neither a canary nor a previous version to roll back to; "
                    "deploy another version with a canary (`raypai deploy update NAME --canary-version N`)"
                )
            try:
                out = self._record(name, spec, "running", expected_row_version=rec.row_version)
            except DeploymentConflict:
                _backoff(_attempt)
                continue
            serve.delete(app_name(name, gone))
            return out
        raise DeploymentConflict(f"deployment {name!r} kept changing during the rollback ({_CAS_TRIES} tries); retry")

    def delete(self, name: str) -> None:
        spec = self._get(name).spec
        self.store.delete_deployment(name)
        for v in spec.versions():
            serve.delete(app_name(name, v))

    def reconcile(self) -> list[tuple[str, str]]:
        """Re-create applications that Serve lost (after a cluster or server restart); delete those
        the desired state no longer names (a canary the router rolled back by itself)."""
        self.start()
        live = serve.status().applications
        actions = []
        for d in self.store.list_deployments():
            actions += [(d.name, f"deleted orphaned {app}") for app in self._collect_orphans(d.name, d.spec, live)]
            for v in d.spec.versions():
                if app_name(d.name, v) not in live:
                    self._run_version(d.name, d.spec, v)
                    actions.append((d.name, f"re-created v{v}"))
        return actions

    def spec(self, name: str) -> DeploymentSpec | None:
        """The desired state of `name`, None when there is no such deployment."""
        rec = self.store.get_deployment(name)
        return rec.spec if rec is not None else None

    def describe(self, name: str) -> dict:
        rec = self._get(name)
        out = self._with_status(rec.name, rec.spec, rec.state, rec.history)
        canary = rec.spec.canary_version
        out["canary_check"] = self.store.latest_canary_check(name, canary) if canary is not None else None
        out["events"] = [h["event"] for h in rec.history if h.get("event")][-5:]
        return out

    def list(self) -> list[dict]:
        return [self._with_status(d.name, d.spec, d.state, d.history) for d in self.store.list_deployments()]

    # ---- helpers --------------------------------------------------------------------------------

    def _collect_orphans(self, name: str, spec: DeploymentSpec, live: dict | None = None) -> list[str]:
        """Delete Serve applications of `name` that its desired state no longer names (the router takes
        a failing canary out of the routing table by itself; its application goes here)."""
        live = serve.status().applications if live is None else live
        wanted = {app_name(name, v) for v in spec.versions()}
        prefix = f"raypai-{name}-v"
        gone = [a for a in live if a.startswith(prefix) and a[len(prefix) :].isdigit() and a not in wanted]
        for app in gone:
            serve.delete(app)
        return gone

    def _get(self, name: str):
        rec = self.store.get_deployment(name)
        if rec is None:
            known = ", ".join(d.name for d in self.store.list_deployments()) or "none yet"
            raise NotFoundError(
                f"deployment {name!r} not found (known deployments: {known}); list them with "
                "`raypai deploy list`, create one with `raypai deploy create`"
            )
        return rec

    def _record(self, name: str, spec: DeploymentSpec, state: str, *, expected_row_version: int | None = None) -> dict:
        rec = self.store.save_deployment(name, spec, state, expected_row_version=expected_row_version)
        return self._with_status(rec.name, rec.spec, rec.state, rec.history)

    def _with_status(self, name: str, spec: DeploymentSpec, state: str, history: list) -> dict:
        """The API's view of a deployment: its spec as JSON plus each version's Serve status."""
        try:
            apps = serve.status().applications
            live = {str(v): _status(apps.get(app_name(name, v))) for v in spec.versions()}
        except Exception as exc:  # noqa: BLE001 - Serve not reachable: report it, don't fail the read
            live = {"error": str(exc)}
        return {
            "name": name,
            "state": state,
            "spec": spec.to_dict(),
            "live": live,
            "history_length": len(history),
            "endpoint": f"http://127.0.0.1:{serve_port(self.settings)}/v1",
        }


# Compare-and-swap attempts of one update/rollback before answering 409. A try is lost only to a
# write that succeeded meanwhile, so this many writers at once can all get through.
_CAS_TRIES = 10


def _backoff(attempt: int) -> None:
    """Jittered pause after a lost compare-and-swap, so the writers that collided spread out."""
    import random
    import time

    time.sleep(random.uniform(0, min(0.2, 0.005 * 2**attempt)))


def _canary_policy(value) -> dict:
    """A `canary_policy` the caller sent, as the stored dict; DeployError (400) naming each bad field,
    its value and the type or range it needs (a string where a number goes was a 500 before)."""
    try:
        policy = parse_config(CanaryPolicy, value, what="canary_policy")  # types and unknown fields
        return CanaryPolicy.from_spec(policy.to_dict()).to_dict()  # ranges
    except ConfigError as exc:
        raise DeployError(str(exc)) from None


def _status(app) -> str:
    """RUNNING, DEPLOYING, DEPLOY_FAILED, UNHEALTHY… of a Serve application status, MISSING if absent."""
    if app is None:
        return "MISSING"
    return getattr(app.status, "value", str(app.status))


def _wait_running(app: str, timeout_s: float = 180.0) -> None:
    import time

    deadline = time.time() + timeout_s
    status, value = None, "MISSING"
    while time.time() < deadline:
        status = serve.status().applications.get(app)
        value = _status(status)
        if value == "RUNNING":
            return
        if value in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise DeployError(
                f"Serve application {app} failed: {getattr(status, 'message', '')[:500]}; "
                f"the replica's traceback is in the Ray dashboard (Serve tab) and in {_serve_logs()}"
            )
        time.sleep(0.5)
    message = getattr(status, "message", "") if status is not None else ""
    raise DeployError(
        f"Serve application {app} not running after {timeout_s:.0f}s (status {value}"
        + (f": {message[:300]}" if message else "")
        + "). A replica that waits for resources "
        "means the cluster lacks the CPUs/GPUs the deployment asks for (`ray status`; lower "
        f"cpus/gpus/replicas); a slow or failing model load shows in the replica logs under "
        f"{_serve_logs()} and the Ray dashboard's Serve tab"
    )


def _serve_logs() -> str:
    """The Serve log folder of the Ray session this process is connected to."""
    try:
        from ray._private import worker  # the session folder has no public accessor in Ray 2.x

        return f"{worker._global_node.get_logs_dir_path()}/serve/"
    except Exception:  # noqa: BLE001 - not connected (Ray client): name the usual place
        return "the Ray session's logs/serve/ folder (session_latest under Ray's temp dir)"
