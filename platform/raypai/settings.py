"""Runtime settings: environment variables (RAYPAI_ prefix), optional raypai.toml, embedded defaults.

    RAYPAI_HOME=/data/raypai RAYPAI_DATABASE_URL=postgresql+psycopg://... raypai doctor

See docs/production.md: the same pipeline runs on a laptop (SQLite, local MLflow, local artifact folder)
and on a cluster (PostgreSQL, MLflow server, s3://) with no code change.

Read by hand rather than with pydantic-settings: the variables mix raypai's prefix with other
tools' names (MLFLOW_TRACKING_URI, RAY_ADDRESS), defaults derive from RAYPAI_HOME, the TOML file
holds a [raypai] table, and every problem must come back in one ConfigError naming the fix.
Entry points load Settings once (`Settings.load()`) and pass them down; raypai.runtime turns them
into a running Ray.

A `raypai.toml` in the current directory is read only with a notice on stderr naming it (a cloned
repository can ship one), and settings from it can never make raypai send RAYPAI_TOKEN to another
machine: `check_token_destination` refuses a non-loopback address that the user did not give
explicitly (RAYPAI_API_URL) or allow (RAYPAI_ALLOW_REMOTE_TOKEN=1 in the environment, or
allow_remote_token in a file named by RAYPAI_CONFIG).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import tomllib

from raypai.credentials import redact_url, strip_password
from raypai.errors import ConfigError

_DB_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg", "postgresql+psycopg2")
_TRACKING_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg", "http", "https", "file", "databricks")
_ARTIFACT_SCHEMES = ("", "file", "s3", "gs", "gcs", "hdfs", "abfs", "mock")


@dataclass(frozen=True)
class Settings:
    """Validated settings. Build with `Settings.load()`; every field is absolute/explicit after load."""

    home: Path
    database_url: str
    mlflow_tracking_uri: str
    artifact_uri: str
    ray_address: str | None = None
    # Logical CPUs given to a local Ray (on 2 cores, Train workers + controller must fit; docs/configuration.md).
    ray_num_cpus: int | None = None
    # Serve HTTP port pinned by the user; None: raypai.runtime picks one (8000 when free) and records it.
    serve_port: int | None = None
    # Address Serve's HTTP proxy binds: loopback by default; 0.0.0.0 where a load balancer or a
    # Kubernetes Service must reach it (infra/k8s sets it).
    serve_host: str = "127.0.0.1"
    dashboard: bool = True  # a local Ray started by raypai runs the Ray dashboard
    # RAYPAI_TOKEN may go to a non-loopback address that was not given explicitly (RAYPAI_ALLOW_REMOTE_TOKEN=1)
    allow_remote_token: bool = False
    extra: dict = field(default_factory=dict)
    # the TOML file read, and whether it was found in the current directory (not named by RAYPAI_CONFIG)
    config_file: Path | None = field(default=None, compare=False)
    config_from_cwd: bool = field(default=False, compare=False)

    @classmethod
    def load(cls, env: dict[str, str] | None = None, toml_path: str | Path | None = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        file_values: dict = {}
        toml_path = toml_path or env.get("RAYPAI_CONFIG")
        from_cwd = toml_path is None and Path("raypai.toml").is_file()
        if from_cwd:
            toml_path = Path("raypai.toml").absolute()
            _cwd_config_notice(str(toml_path))
        problems: list[str] = []
        if toml_path:
            try:
                file_values = tomllib.loads(Path(toml_path).read_text()).get("raypai", {})
            except (OSError, tomllib.TOMLDecodeError) as exc:
                problems.append(f"config file {toml_path}: cannot be read ({exc}); fix the TOML or unset RAYPAI_CONFIG")

        def pick(env_key: str, file_key: str, default):
            return env.get(env_key) or file_values.get(file_key) or default

        home = Path(pick("RAYPAI_HOME", "home", "./.raypai")).expanduser().absolute()
        database_url = pick("RAYPAI_DATABASE_URL", "database_url", f"sqlite:///{home}/raypai.db")
        tracking = pick("MLFLOW_TRACKING_URI", "mlflow_tracking_uri", f"sqlite:///{home}/mlflow.db")
        artifact_uri = pick("RAYPAI_ARTIFACT_URI", "artifact_uri", str(home / "artifacts"))
        ray_address = pick("RAY_ADDRESS", "ray_address", None)
        num_cpus_raw = pick("RAYPAI_RAY_NUM_CPUS", "ray_num_cpus", None)
        serve_port_raw = pick("RAYPAI_SERVE_PORT", "serve_port", None)
        serve_host = str(pick("RAYPAI_SERVE_HOST", "serve_host", "127.0.0.1")).strip()
        dashboard_raw = env.get("RAYPAI_DASHBOARD") or file_values.get("dashboard", "1")  # a toml `false` is falsy
        dashboard_raw = {True: "1", False: "0"}.get(dashboard_raw, str(dashboard_raw)).strip().lower()
        # never from a file found in the current directory: that file is what this setting guards against
        allow_raw = env.get("RAYPAI_ALLOW_REMOTE_TOKEN") or (
            "0" if from_cwd else file_values.get("allow_remote_token", "0")
        )
        allow_raw = {True: "1", False: "0"}.get(allow_raw, str(allow_raw)).strip().lower()

        scheme = database_url.split("://", 1)[0] if "://" in database_url else ""
        if scheme not in _DB_SCHEMES:
            problems.append(
                f"RAYPAI_DATABASE_URL={redact_url(database_url)!r}: unsupported scheme {scheme!r}; use "
                "sqlite:///path/raypai.db or postgresql+psycopg://user@host:5432/db"
            )
        tscheme = tracking.split("://", 1)[0] if "://" in tracking else ""
        if tscheme not in _TRACKING_SCHEMES:
            problems.append(
                f"MLFLOW_TRACKING_URI={redact_url(tracking)!r}: unsupported scheme {tscheme!r}; use "
                "sqlite:///path/mlflow.db (embedded) or http://host:5000 (MLflow server)"
            )
        ascheme = urlparse(artifact_uri).scheme if "://" in artifact_uri else ""
        if ascheme not in _ARTIFACT_SCHEMES:
            problems.append(
                f"RAYPAI_ARTIFACT_URI={artifact_uri!r}: unsupported scheme {ascheme!r}; use a local "
                "folder or s3://bucket/prefix"
            )
        if ascheme == "" and not Path(artifact_uri).is_absolute():
            artifact_uri = str(Path(artifact_uri).absolute())
        num_cpus = None
        if num_cpus_raw is not None:
            try:
                num_cpus = int(num_cpus_raw)
                if num_cpus < 1:
                    raise ValueError
            except ValueError:
                problems.append(f"RAYPAI_RAY_NUM_CPUS={num_cpus_raw!r}: must be a positive integer")
        serve_port = None
        if serve_port_raw is not None:
            try:
                serve_port = int(serve_port_raw)
                if not 1 <= serve_port <= 65535:
                    raise ValueError
            except ValueError:
                problems.append(
                    f"RAYPAI_SERVE_PORT={serve_port_raw!r}: must be a TCP port (1-65535); unset it "
                    "to let raypai pick a free one"
                )
        if not serve_host or any(c.isspace() or c in "/:" for c in serve_host.strip("[]")):
            problems.append(
                f"RAYPAI_SERVE_HOST={serve_host!r}: expected an address to bind, e.g. 127.0.0.1 "
                "(this machine only) or 0.0.0.0 (every interface)"
            )
        dashboard = dashboard_raw in ("1", "true", "yes", "on")
        if dashboard_raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            problems.append(f"RAYPAI_DASHBOARD={dashboard_raw!r}: use 1 (start the Ray dashboard) or 0 (skip it)")
        if allow_raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            problems.append(
                f"RAYPAI_ALLOW_REMOTE_TOKEN={allow_raw!r}: use 1 (RAYPAI_TOKEN may go to remote addresses "
                "read from the settings) or 0"
            )
        if ray_address is not None and not (ray_address == "auto" or "://" in ray_address or ":" in ray_address):
            problems.append(
                f"RAY_ADDRESS={ray_address!r}: expected 'auto', 'host:6379' or 'ray://host:10001'; unset it for a local Ray"
            )
        if problems:
            raise ConfigError(problems, what="raypai settings")
        return cls(
            home=home,
            database_url=database_url,
            mlflow_tracking_uri=tracking,
            artifact_uri=artifact_uri,
            ray_address=ray_address,
            ray_num_cpus=num_cpus,
            serve_port=serve_port,
            serve_host=serve_host,
            dashboard=dashboard,
            allow_remote_token=allow_raw in ("1", "true", "yes", "on"),
            config_file=Path(toml_path).absolute() if toml_path else None,
            config_from_cwd=from_cwd,
        )

    def replace(self, **changes) -> "Settings":
        return replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """Environment that reproduces these settings in another process (Ray workers, jobs), without
        passwords: Ray shows these variables in its dashboard and logs. The password of a PostgreSQL URL
        reaches the other process through libpq instead (raypai.credentials.worker_secret_env)."""
        env = {
            "RAYPAI_HOME": str(self.home),
            "RAYPAI_DATABASE_URL": strip_password(self.database_url),
            "MLFLOW_TRACKING_URI": strip_password(self.mlflow_tracking_uri),
            "RAYPAI_ARTIFACT_URI": self.artifact_uri,
        }
        if self.ray_num_cpus:
            env["RAYPAI_RAY_NUM_CPUS"] = str(self.ray_num_cpus)
        if self.serve_port:
            env["RAYPAI_SERVE_PORT"] = str(self.serve_port)
        if self.serve_host != "127.0.0.1":
            env["RAYPAI_SERVE_HOST"] = self.serve_host
        if not self.dashboard:
            env["RAYPAI_DASHBOARD"] = "0"
        return env


@functools.cache  # once per file and process: entry points may load settings more than once
def _cwd_config_notice(path: str) -> None:
    print(
        f"raypai: reading settings from {path} (a raypai.toml in the current directory); set "
        "RAYPAI_CONFIG=PATH to name the file explicitly, or run from another directory to ignore it",
        file=sys.stderr,
    )


def is_local_address(url: str) -> bool:
    """The URL's host is this machine: localhost, a loopback address, or 0.0.0.0/:: (a server bound
    to every interface, reached here through loopback)."""
    host = urlparse(url if "://" in url else f"http://{url}").hostname or ""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def check_token_destination(settings: Settings, url: str, *, explicit: bool) -> None:
    """ConfigError unless RAYPAI_TOKEN may be sent to `url`: a loopback address, an address the user
    gave explicitly (`explicit`: RAYPAI_API_URL), or any address with allow_remote_token. An address
    found through the settings (the endpoint recorded under RAYPAI_HOME, which a raypai.toml in the
    current directory can point anywhere) is never enough on its own."""
    if is_local_address(url) or explicit or settings.allow_remote_token:
        return
    origin = (
        f"RAYPAI_HOME {settings.home} set by {settings.config_file} in the current directory"
        if settings.config_from_cwd
        else f"RAYPAI_HOME {settings.home}"
    )
    raise ConfigError(
        [
            f"refusing to send RAYPAI_TOKEN to {redact_url(url)}: not this machine, and the address was read "
            f"from the settings ({origin}), not given by you. Set RAYPAI_API_URL={redact_url(url)} if you "
            "mean it, or RAYPAI_ALLOW_REMOTE_TOKEN=1 in the environment"
        ],
        what="deploy API address",
    )
