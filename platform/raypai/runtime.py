"""Start or join Ray, on free ports, and remember where: the one place raypai calls `ray.init`.

    raypai ray start              # a persistent local Ray head for this RAYPAI_HOME (what `make demo` runs)
    raypai ray status
    raypai ray stop               # stops that head only, never another Ray on the machine

Which Ray an entry point gets (`ensure_ray`), first match wins:
  1. `RAY_ADDRESS` / `ray_address` in the settings: that cluster;
  2. the head recorded in `$RAYPAI_HOME/runtime.json` by `start_head`, while it still runs;
  3. a local Ray inside this process, gone when the process exits (`ensure_ray(settings, local=True)`
     goes straight here: the benchmarks' own Ray).

Every port raypai opens prefers its usual default (Ray GCS 6379, dashboard 8265, client 10001,
dashboard agent 52365, Serve 8000, deploy API 8080, MLflow UI 5000) and takes a free one when that
is in use (a Redis server on 6379 is common). What was chosen goes to `runtime.json`, so later
commands (`raypai run`, `deploy`, `server`, `ui`, a second `make demo`, `raypai ray stop`) find
the same Ray and the same endpoints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from raypai.errors import ConfigError, RaypaiError
from raypai.settings import Settings

__all__ = [
    "DEFAULT_PORTS",
    "Endpoint",
    "HeadState",
    "RayInfo",
    "RuntimeStartError",
    "RuntimeState",
    "check_port",
    "endpoint_url",
    "ensure_ray",
    "load_state",
    "pick_port",
    "port_is_free",
    "record_endpoint",
    "start_head",
    "state_path",
    "stop_head",
    "tracker",
    "worker_env",
]

DEFAULT_PORTS = {
    "gcs": 6379,
    "dashboard": 8265,
    "client": 10001,
    "dashboard_agent": 52365,
    "serve": 8000,
    "api": 8080,
    "mlflow_ui": 5000,
}
NAMESPACE = "raypai"
_SERVE_PORT_KEY = b"raypai/serve_port"  # Ray internal KV: the Serve port chosen for this cluster


class RuntimeStartError(RaypaiError):
    """A local Ray head could not be started or stopped."""


# ---- ports -----------------------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    """Nothing listens on `port` on any local address (IPv4 and IPv6): a server can bind it."""
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # as servers do: connections in TIME_WAIT after a server stopped do not hold the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    continue  # no IPv6 on this host
                return False
    return True


def pick_port(preferred: int | None = None, *, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """`preferred` when it is free, else a free port the kernel hands out (never one in `avoid`)."""
    if preferred and preferred not in avoid and port_is_free(preferred):
        return preferred
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in avoid and port_is_free(port):
            return port
    raise RuntimeStartError("no free TCP port found after 50 tries; close some servers and retry")


def _preferred_dashboard_port(dashboard: bool) -> int | None:
    """8265 for a dashboard, when free; without one, no preference (any free port, never 8265). Ray
    records a dashboard port as its API server address even with no dashboard, and its state API
    (which Ray Train's placement-group cleaner asks whether a run's controller lives) would otherwise
    reach another Ray's dashboard on 8265, hear "no such actor" and remove a running pretrain's workers."""
    return DEFAULT_PORTS["dashboard"] if dashboard else None


# ---- recorded state --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadState:
    """The persistent Ray head raypai started for one RAYPAI_HOME."""

    address: str  # GCS address drivers join, "ip:port"
    dashboard_url: str | None
    client_port: int  # Ray Client server (ray://host:port)
    serve_port: int  # Serve HTTP proxy of the OpenAI-compatible endpoint
    temp_dir: str
    session_dir: str
    pids: tuple[int, ...]  # head processes (GCS, raylet, dashboard, monitors) at start
    num_cpus: int
    auth_mode: str  # Ray's RAY_AUTH_MODE for this head ("token" or "disabled")
    started_at: float


@dataclass(frozen=True)
class Endpoint:
    """A server raypai started (deploy API, MLflow UI): where it listens and its process."""

    url: str
    pid: int


@dataclass(frozen=True)
class RuntimeState:
    """What `runtime.json` says is running now (dead entries dropped)."""

    head: HeadState | None = None
    endpoints: dict[str, Endpoint] = field(default_factory=dict)


def state_path(settings: Settings) -> Path:
    return settings.home / "runtime.json"


def load_state(settings: Settings) -> RuntimeState:
    """The recorded head and endpoints of this RAYPAI_HOME that are still running."""
    raw = _read(settings)
    head = _head_from(raw.get("head"))
    endpoints = {name: Endpoint(**e) for name, e in raw.get("endpoints", {}).items() if _pid_alive(e.get("pid"))}
    return RuntimeState(head if head is not None and _head_alive(head) else None, endpoints)


def record_endpoint(settings: Settings, name: str, url: str, pid: int | None = None) -> Endpoint:
    """Record a server raypai runs (`api`, `mlflow_ui`) so other commands find it."""
    ep = Endpoint(url, pid or os.getpid())
    with _locked(settings):
        raw = _read(settings)
        raw.setdefault("endpoints", {})[name] = asdict(ep)
        _write(settings, raw)
    return ep


def endpoint_url(settings: Settings, name: str, default_port: int | None = None) -> str | None:
    """The recorded, running endpoint `name`; else the default port on localhost (or None)."""
    ep = load_state(settings).endpoints.get(name)
    if ep is not None:
        return ep.url
    return f"http://127.0.0.1:{default_port}" if default_port else None


def _read(settings: Settings) -> dict:
    try:
        return json.loads(state_path(settings).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # a torn or hand-edited file: treat as nothing recorded (start_head rewrites it)


def _write(settings: Settings, raw: dict) -> None:
    path = state_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
    tmp.replace(path)  # readers see the old or the new file, never half of one


@contextlib.contextmanager
def _locked(settings: Settings):
    """One process at a time reads-modifies-writes runtime.json (or starts/stops the head)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    with open(settings.home / "runtime.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _head_from(raw: dict | None) -> HeadState | None:
    if not raw:
        return None
    try:
        return HeadState(**{**raw, "pids": tuple(raw["pids"])})
    except (TypeError, KeyError):
        return None


def _pid_alive(pid) -> bool:
    import psutil

    try:
        return isinstance(pid, int) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _head_alive(head: HeadState) -> bool:
    """Its GCS process still runs that session (a recycled pid runs something else)."""
    return any(head.session_dir in _cmdline(pid) and "gcs_server" in _cmdline(pid) for pid in head.pids)


def _cmdline(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


# ---- the persistent head ---------------------------------------------------------------------------


def _temp_dir(settings: Settings) -> Path:
    """Ray's temp dir for this home: its own (so `ray.init("auto")` elsewhere never finds this head),
    and short (Ray's unix sockets live under it; their paths are limited to 107 bytes)."""
    digest = hashlib.sha256(str(settings.home).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"raypai-{digest}"


def start_head(
    settings: Settings, *, num_cpus: int | None = None, dashboard: bool | None = None, timeout_s: float = 120.0
) -> HeadState:
    """Start a persistent local Ray head on free ports and record it; the running one if there is."""
    with _locked(settings):
        raw = _read(settings)
        head = _head_from(raw.get("head"))
        if head is not None and _head_alive(head):
            return head
        dashboard = settings.dashboard if dashboard is None else dashboard
        cpus = num_cpus or settings.ray_num_cpus or max(8, os.cpu_count() or 1)
        last_error = ""
        for _attempt in range(3):  # a port taken between choosing and binding: choose again
            ports: dict[str, int] = {}
            for name in ("gcs", "dashboard", "client", "dashboard_agent", "serve"):
                preferred = _preferred_dashboard_port(dashboard) if name == "dashboard" else DEFAULT_PORTS[name]
                ports[name] = pick_port(preferred, avoid=set(ports.values()))
            if settings.serve_port:
                ports["serve"] = settings.serve_port
            head, last_error = _launch(settings, ports, cpus, dashboard, timeout_s)
            if head is not None:
                raw["head"] = {**asdict(head), "pids": list(head.pids)}
                _write(settings, raw)
                return head
        raise RuntimeStartError(
            f"could not start a local Ray head (3 tries):\n{last_error}\n"
            f"see the Ray logs under {_temp_dir(settings)}/session_latest/logs"
        )


def _launch(
    settings: Settings, ports: dict[str, int], cpus: int, dashboard: bool, timeout_s: float
) -> tuple[HeadState | None, str]:
    temp_dir = _temp_dir(settings)
    temp_dir.mkdir(parents=True, exist_ok=True)
    (temp_dir / "ray_current_cluster").unlink(missing_ok=True)
    auth_mode = os.environ.get("RAY_AUTH_MODE", "token")  # Ray's own default for `ray start --head`
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        f"--port={ports['gcs']}",
        f"--include-dashboard={'true' if dashboard else 'false'}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={ports['dashboard']}",
        f"--ray-client-server-port={ports['client']}",
        f"--dashboard-agent-listen-port={ports['dashboard_agent']}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={cpus}",
        "--disable-usage-stats",
        # workers bind random ports instead of the 10002-19999 range other servers may hold
        "--min-worker-port=0",
        "--max-worker-port=0",
    ]
    env = {**os.environ, **worker_env(settings), "RAY_AUTH_MODE": auth_mode, "RAYPAI_SERVE_PORT": str(ports["serve"])}
    env.setdefault(*PROXY_CALLBACK)
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return None, f"`ray start` did not finish in {timeout_s:.0f}s: {exc}"
    address_file = temp_dir / "ray_current_cluster"
    if out.returncode != 0 or not address_file.exists():
        _kill_session(_latest_session(temp_dir), None)  # whatever half-started
        return None, (out.stdout + out.stderr)[-3000:]
    address = address_file.read_text().strip()
    session_dir = _latest_session(temp_dir)
    pids = tuple(sorted(p.pid for p in _session_roots(session_dir, address)))
    head = HeadState(
        address=address,
        dashboard_url=f"http://127.0.0.1:{ports['dashboard']}" if dashboard else None,
        client_port=ports["client"],
        serve_port=ports["serve"],
        temp_dir=str(temp_dir),
        session_dir=session_dir,
        pids=pids,
        num_cpus=cpus,
        auth_mode=auth_mode,
        started_at=time.time(),
    )
    return head, ""


def _latest_session(temp_dir: Path) -> str:
    link = temp_dir / "session_latest"
    return str(link.resolve()) if link.exists() else ""


def stop_head(settings: Settings, *, grace_s: float = 3.0) -> list[int]:
    """Stop the head `start_head` recorded for this home: its processes and their children, found
    by its session folder and GCS address, never by process name (`ray stop` stops every Ray)."""
    with _locked(settings):
        raw = _read(settings)
        head = _head_from(raw.get("head"))
        stopped = _kill_session(head.session_dir, head.address, grace_s) if head is not None else []
        raw.pop("head", None)
        _write(settings, raw)
    return stopped


def _session_roots(session_dir: str, address: str | None):
    """Head processes: those naming the session folder (GCS, raylet, dashboard, monitors) or the
    GCS address (the Ray Client server). Workers rename themselves (`ray::…`); they are found as
    children of the raylet."""
    import psutil

    if not session_dir:
        return []
    marks = [session_dir + "/", session_dir + " "] + ([f"={address} "] if address else [])
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or []) + " "  # the trailing space ends the last argument
        if proc.pid != os.getpid() and any(m in cmd for m in marks):
            roots.append(proc)
    return roots


def _kill_session(session_dir: str, address: str | None, grace_s: float = 3.0) -> list[int]:
    """The raylet (with its workers) first, then GCS and the daemons: signalled all at once, the
    raylet and GCS wait on each other for 10 s or more. SIGKILL whatever outlives `grace_s`."""
    import psutil

    roots = _session_roots(session_dir, address)
    raylets = [r for r in roots if _name(r) == "raylet"]
    stopped = []
    for group in (raylets, [r for r in roots if r not in raylets]):
        procs = {}
        for root in group:
            procs[root.pid] = root
            with contextlib.suppress(psutil.Error):
                procs.update({c.pid: c for c in root.children(recursive=True)})
        for p in procs.values():
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=grace_s)
        stopped += procs
    return sorted(stopped)


def _name(proc) -> str:
    import psutil

    try:
        return proc.name()
    except psutil.Error:
        return ""


# ---- joining ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayInfo:
    """The Ray this process is connected to, and the Serve port to use on it."""

    kind: str  # "head" (raypai's recorded head) | "cluster" (RAY_ADDRESS) | "local" (inside this process)
    address: str
    serve_port: int
    dashboard_url: str | None = None
    session_dir: str | None = None

    def describe(self) -> str:
        where = {"head": "raypai's Ray head", "cluster": "the Ray cluster", "local": "a local Ray (this process)"}
        dash = f", dashboard {self.dashboard_url}" if self.dashboard_url else ""
        return f"{where[self.kind]} at {self.address}{dash}; Serve port {self.serve_port}"


# Serve's HTTP proxy refuses an unauthenticated or oversized `/v1/` request from its headers, before
# the body is read (raypai.serving.limits.ProxyGuard); the proxy reads this from its node's environment,
# so it is set where raypai starts a node (a local Ray, `raypai ray start`) unless the user set their own
PROXY_CALLBACK = ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "raypai.serving.limits.proxy_middlewares")


def worker_env(settings: Settings) -> dict[str, str]:
    """Environment every Ray worker of raypai gets (settings + quiet, CPU-safe defaults). It holds no
    password (Ray shows runtime_env variables in its dashboard and logs): a PostgreSQL password reaches
    the workers, which share this machine, as PGPASSFILE, a 0600 file (raypai.credentials)."""
    from raypai.credentials import worker_secret_env

    return {
        **settings.to_env(),
        **worker_secret_env(settings),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }


def ensure_ray(
    settings: Settings,
    *,
    num_cpus: int | None = None,
    dashboard: bool | None = None,
    log_to_driver: bool = True,
    local: bool = False,
    object_store_memory: int | None = None,
) -> RayInfo:
    """Join the Ray this process should use (see the module docstring), or start a local one.
    Idempotent: when Ray is already initialised, describes it. `local=True` skips the cluster and
    the recorded head and always starts a Ray inside this process (benchmarks measure on a Ray of
    their own, with a known CPU count). `num_cpus`, `dashboard` and `object_store_memory` (bytes)
    only apply to a local Ray started here (default: settings, then Ray's own)."""
    import ray

    if ray.is_initialized():
        return _current(settings)
    joins_cluster = bool(settings.ray_address) and not local
    head = None if joins_cluster or local else load_state(settings).head
    env = worker_env(settings)
    kwargs = {"namespace": NAMESPACE, "log_to_driver": log_to_driver, "logging_level": logging.WARNING}
    if joins_cluster:
        kind, address, serve = "cluster", settings.ray_address, settings.serve_port or DEFAULT_PORTS["serve"]
    elif head is not None:
        kind, address, serve = "head", head.address, settings.serve_port or head.serve_port
        _set_auth_mode(head.auth_mode)
    else:
        kind, address, serve = "local", "local", settings.serve_port or pick_port(DEFAULT_PORTS["serve"])
        dash = settings.dashboard if dashboard is None else dashboard
        # Logical CPUs > cores: heavy steps start their own Ray workloads from inside their task
        # (Train workers + controller, role actors), which must schedule beside the step's task.
        kwargs.update(
            num_cpus=num_cpus or settings.ray_num_cpus or max(8, os.cpu_count() or 1),
            include_dashboard=dash,
            dashboard_port=pick_port(_preferred_dashboard_port(dash)),
        )
        if object_store_memory:
            kwargs["object_store_memory"] = object_store_memory
        _set_auth_mode(os.environ.get("RAY_AUTH_MODE", "token"))  # Ray's default, without its warning
        os.environ.setdefault(*PROXY_CALLBACK)  # the local node's processes inherit this process's environment
    env["RAYPAI_SERVE_PORT"] = str(serve)
    try:
        ctx = ray.init(address=address, runtime_env={"env_vars": env}, **kwargs)
    except ConnectionError as exc:
        fix = (
            "check RAY_ADDRESS, or unset it to use a local Ray"
            if kind == "cluster"
            else "run `raypai ray stop` and `raypai ray start` again"
        )
        raise RuntimeStartError(f"cannot join {kind} Ray at {address}: {exc}; {fix}") from None
    _kv_put_serve_port(serve)
    dash_url = head.dashboard_url if head is not None else _dashboard_url(ctx)
    return RayInfo(
        kind,
        _gcs_address() or address,
        _kv_serve_port() or serve,
        dash_url,
        head.session_dir if head is not None else _session_dir(),
    )


def _current(settings: Settings) -> RayInfo:
    head = load_state(settings).head
    address = _gcs_address() or "?"
    kind = "head" if head is not None and head.address == address else ("cluster" if settings.ray_address else "local")
    serve = _kv_serve_port() or settings.serve_port or int(os.environ.get("RAYPAI_SERVE_PORT", DEFAULT_PORTS["serve"]))
    return RayInfo(kind, address, serve, head.dashboard_url if kind == "head" else None, _session_dir())


def _set_auth_mode(mode: str) -> None:
    """Drivers must use the head's token mode (`ray start --head` turns it on when a token exists)."""
    if os.environ.get("RAY_AUTH_MODE") == mode:
        return
    os.environ["RAY_AUTH_MODE"] = mode  # read by Ray's C++ config, refreshed below (as Ray itself does)
    from ray._raylet import Config

    Config.initialize("")


def _kv_put_serve_port(port: int) -> None:
    from ray.experimental import internal_kv

    # first writer wins: every driver on this cluster then agrees on the port Serve listens on
    internal_kv._internal_kv_put(_SERVE_PORT_KEY, str(port).encode(), overwrite=False)


def _kv_serve_port() -> int | None:
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):
        value = internal_kv._internal_kv_get(_SERVE_PORT_KEY)
        return int(value) if value else None
    return None


def _gcs_address() -> str | None:
    import ray

    with contextlib.suppress(Exception):
        return ray.get_runtime_context().gcs_address
    return None


def _session_dir() -> str | None:
    import ray

    with contextlib.suppress(Exception):
        return ray._private.worker.global_worker.node.get_session_dir_path()
    return None


def _dashboard_url(ctx) -> str | None:
    url = getattr(ctx, "dashboard_url", None)
    return f"http://{url}" if url and not url.startswith("http") else (url or None)


# ---- set-up shared by the entry points -------------------------------------------------------------


def tracker(settings: Settings):
    """The MLflow tracker for these settings (artifacts of the embedded store under RAYPAI_HOME)."""
    from raypai.tracking import Tracker

    return Tracker(settings.mlflow_tracking_uri, artifact_root=settings.home / "mlartifacts")


def check_port(name: str, port: int) -> None:
    """A port the user pinned must be free: one clear error instead of a bind failure deep inside."""
    if not port_is_free(port):
        raise ConfigError(
            [f"{name} port {port} is in use: pick another (or leave it unset and raypai picks a free one)"],
            what="ports",
        )
