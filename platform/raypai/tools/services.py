"""Production-shaped services on this machine: an S3 server and an MLflow tracking server.

    raypai services up        # S3 (moto server) + MLflow (PostgreSQL backend, s3:// artifacts)
    eval "$(raypai services env)"
    raypai run pipelines/toy.py
    raypai services status ; raypai services down
    raypai services secrets --out infra/.env   # random passwords for infra/compose.yaml, in a 0600 file

The S3 server is `moto` in server mode (an S3 protocol server, in memory: data lasts until
`down`). MLflow runs as `mlflow server` with its backend store in a PostgreSQL database (created if
missing) and `--artifacts-destination s3://BUCKET/mlflow`: clients send artifacts to the server,
which writes them to S3 (proxied artifacts, https://mlflow.org/docs/latest/self-hosting/). The
raypai metadata database is created next to it. Logs, pid files and the state of the last `up` live
under `$RAYPAI_HOME/services/`; `state.json` and `env.sh` hold credentials, so they are written with
mode 0600, and URLs are printed through raypai.credentials.redact_url. The same layout runs in
containers with infra/compose.yaml, whose passwords `raypai services secrets` generates.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from raypai import exits
from raypai.credentials import pgpass_env, redact_url, strip_password, write_private
from raypai.errors import ConfigError, StoreError

__all__ = [
    "ServicesConfig",
    "ServiceState",
    "compose_secrets",
    "down",
    "services_app",
    "service_env",
    "status",
    "up",
    "with_free_ports",
    "write_compose_secrets",
]

_DB_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ServicesConfig:
    """Where and how the local services run. `validate()` lists every problem at once."""

    home: Path
    # An existing database on the PostgreSQL server, used to create the two below.
    postgres_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    mlflow_db: str = "raypai_mlflow"
    metadata_db: str = "raypai"
    host: str = "127.0.0.1"
    mlflow_port: int = 5000
    s3_port: int = 9000  # MinIO's default port, so infra/compose.yaml and this agree
    bucket: str = "raypai"
    access_key: str = "raypai"  # moto accepts any credentials; real S3 needs real ones
    secret_key: str = "raypai-secret"
    region: str = "us-east-1"

    @property
    def dir(self) -> Path:
        return self.home / "services"

    def validate(self) -> "ServicesConfig":
        problems = []
        if not self.postgres_url.startswith(("postgresql://", "postgresql+psycopg://", "postgresql+psycopg2://")):
            problems.append(
                f"postgres_url={self.postgres_url!r}: expected postgresql+psycopg://user@host:5432/postgres"
            )
        for field in ("mlflow_db", "metadata_db"):
            if not _DB_NAME.match(getattr(self, field)):
                problems.append(f"{field}={getattr(self, field)!r}: use lower-case letters, digits and '_'")
        if self.mlflow_db == self.metadata_db:
            problems.append(
                f"mlflow_db and metadata_db are both {self.mlflow_db!r}: MLflow and raypai each "
                "migrate their own schema, give them separate databases"
            )
        for field in ("mlflow_port", "s3_port"):
            if not 1 <= getattr(self, field) <= 65535:
                problems.append(f"{field}={getattr(self, field)}: must be a TCP port (1-65535)")
        if self.mlflow_port == self.s3_port:
            problems.append(f"mlflow_port and s3_port are both {self.s3_port}: pick two free ports")
        if not _BUCKET.match(self.bucket):
            problems.append(f"bucket={self.bucket!r}: S3 bucket names are 3-63 lower-case letters, digits, '.', '-'")
        if problems:
            raise ConfigError(problems, what="raypai services")
        return self

    def db_url(self, name: str) -> str:
        base, _, _ = self.postgres_url.rpartition("/")
        return f"{base}/{name}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"


@dataclass(frozen=True)
class ServiceState:
    name: str
    pid: int | None
    url: str
    log: str
    running: bool
    healthy: bool
    detail: str = ""


def _aws_env(cfg: ServicesConfig) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": cfg.access_key,
        "AWS_SECRET_ACCESS_KEY": cfg.secret_key,
        "AWS_REGION": cfg.region,
        "AWS_DEFAULT_REGION": cfg.region,
    }


def service_env(cfg: ServicesConfig) -> dict[str, str]:
    """The variables that point raypai (and any MLflow/S3 client) at these services."""
    return {
        "RAYPAI_DATABASE_URL": cfg.db_url(cfg.metadata_db),
        "MLFLOW_TRACKING_URI": cfg.mlflow_uri,
        "RAYPAI_ARTIFACT_URI": f"s3://{cfg.bucket}/artifacts",
        **_aws_env(cfg),
        # MLflow's S3 client reads its own variable (for clients that bypass the proxy).
        "MLFLOW_S3_ENDPOINT_URL": cfg.s3_endpoint,
    }


def _commands(cfg: ServicesConfig) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (argv, extra environment, health URL); the service's own URL is `_base(health)`."""
    py = sys.executable
    return {
        "s3": ([py, "-m", "moto.server", "-H", cfg.host, "-p", str(cfg.s3_port)], {}, f"{cfg.s3_endpoint}/moto-api/"),
        "mlflow": (
            [
                py,
                "-m",
                "mlflow",
                "server",
                "--host",
                cfg.host,
                "--port",
                str(cfg.mlflow_port),
                # one worker: these machines are small, and each worker is a full process
                "--workers",
                "1",
                "--backend-store-uri",
                # a command line is visible to every user: the password goes to libpq as PGPASSFILE
                strip_password(cfg.db_url(cfg.mlflow_db)),
                "--artifacts-destination",
                f"s3://{cfg.bucket}/mlflow",
            ],
            {
                **_aws_env(cfg),
                "MLFLOW_S3_ENDPOINT_URL": cfg.s3_endpoint,
                # MLflow 3's server-side job runner (GenAI evaluation jobs, 8 processes): not used here
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
            f"{cfg.mlflow_uri}/health",
        ),
    }


def _base(url: str) -> str:
    return "/".join(url.split("/")[:3])


def _pid(cfg: ServicesConfig, name: str) -> int | None:
    """The pid in NAME.pid if that process still runs the service we started (not a reused pid)."""
    import psutil

    path = cfg.dir / f"{name}.pid"
    if not path.exists():
        return None
    try:
        pid = int(path.read_text().strip())
        cmd = " ".join(psutil.Process(pid).cmdline())
    except (ValueError, psutil.Error):
        return None
    return pid if ("moto.server" if name == "s3" else "mlflow") in cmd else None


def _healthy(url: str) -> tuple[bool, str]:
    import httpx

    try:
        r = httpx.get(url, timeout=3.0)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return r.status_code == 200, f"HTTP {r.status_code}"


def _wait_healthy(name: str, url: str, pid: int, log: Path, timeout_s: float) -> None:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _healthy(url)[0]:
            return
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-2500:] if log.exists() else "(no log)"
    raise StoreError(
        f"the {name} service did not become healthy at {url} within {timeout_s:.0f}s; "
        f"its log {log} ends with:\n{tail}\nfix the cause (port in use? database down?) and run "
        "`raypai services up` again"
    )


def _ensure_databases(cfg: ServicesConfig) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    engine = create_engine(cfg.postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for name in (cfg.mlflow_db, cfg.metadata_db):  # names validated: safe to interpolate
                if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is None:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        raise StoreError(
            f"PostgreSQL at {redact_url(cfg.postgres_url)} is not reachable ({str(exc).splitlines()[0]}); start "
            "it, or pass --postgres-url postgresql+psycopg://USER@HOST:PORT/postgres"
        ) from exc
    finally:
        engine.dispose()


def _ensure_bucket(cfg: ServicesConfig) -> None:
    import pyarrow.fs as pafs

    s3 = pafs.S3FileSystem(
        access_key=cfg.access_key,
        secret_key=cfg.secret_key,
        region=cfg.region,
        endpoint_override=cfg.s3_endpoint,
        allow_bucket_creation=True,
    )
    if s3.get_file_info(cfg.bucket).type == pafs.FileType.NotFound:
        s3.create_dir(cfg.bucket)


def _start(cfg: ServicesConfig, name: str, timeout_s: float) -> int:
    argv, extra, health = _commands(cfg)[name]
    pid = _pid(cfg, name)
    if pid is not None:
        _wait_healthy(name, health, pid, cfg.dir / f"{name}.log", timeout_s)
        return pid
    if _healthy(health)[0]:
        raise StoreError(
            f"{_base(health)} already answers like a {name} server that raypai did not "
            f"start; stop it, or pick another port (--{'s3' if name == 's3' else 'mlflow'}-port)"
        )
    log = cfg.dir / f"{name}.log"
    env = {**os.environ, **extra, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONUNBUFFERED": "1"}
    if name == "mlflow":  # its backend URL on the command line has no password: libpq reads it here
        env.update(pgpass_env([cfg.db_url(cfg.mlflow_db)], cfg.dir / "pgpass"))
    with open(log, "ab") as out:
        # own session: `down` signals the whole group (mlflow server forks its workers)
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            cwd=cfg.dir,
        )
    (cfg.dir / f"{name}.pid").write_text(str(proc.pid))
    _wait_healthy(name, health, proc.pid, log, timeout_s)
    return proc.pid


def up(cfg: ServicesConfig, timeout_s: float = 120.0) -> dict[str, str]:
    """Start (or reuse) the S3 and MLflow servers; returns the environment that points at them."""
    cfg.validate()
    cfg.dir.mkdir(parents=True, exist_ok=True)
    _ensure_databases(cfg)
    _start(cfg, "s3", timeout_s)
    _ensure_bucket(cfg)
    _start(cfg, "mlflow", timeout_s)
    env = service_env(cfg)
    _write_state(cfg, env)
    return env


def _write_state(cfg: ServicesConfig, env: dict[str, str]) -> None:
    """state.json (the config of this `up`, read by status/down) and env.sh: both hold credentials
    (the S3 keys, a PostgreSQL password in postgres_url), so both are this user's only (0600)."""
    write_private(cfg.dir / "state.json", json.dumps({"config": {**asdict(cfg), "home": str(cfg.home)}}, indent=2))
    write_private(cfg.dir / "env.sh", "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))


# The variables infra/compose.yaml reads from infra/.env (`${VAR:?...}`), plus the same credentials
# under the names clients read (libpq's PGPASSWORD, AWS_*, MLflow's MLFLOW_TRACKING_*), so that
# `set -a; . infra/.env; set +a` sets up a shell on the same machine.
def compose_secrets() -> dict[str, str]:
    """Fresh random credentials for infra/compose.yaml (token_urlsafe: 32 bytes of entropy each)."""
    pg, s3_key, mlflow = (secrets.token_urlsafe(32) for _ in range(3))
    return {
        "POSTGRES_PASSWORD": pg,
        "MINIO_ROOT_USER": "raypai",
        "MINIO_ROOT_PASSWORD": s3_key,
        "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": mlflow,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_urlsafe(32),
        "PGPASSWORD": pg,
        "AWS_ACCESS_KEY_ID": "raypai",
        "AWS_SECRET_ACCESS_KEY": s3_key,
    }


def write_compose_secrets(path: str | Path, *, force: bool = False) -> dict[str, str]:
    """Write `compose_secrets()` to `path` (mode 0600); refuses to replace an existing file unless
    `force` (the PostgreSQL volume keeps the password it was created with)."""
    path = Path(path)
    if path.exists() and not force:
        raise ConfigError(
            [
                f"{path} exists: its passwords are the ones the services' volumes were created with; "
                "keep it, or pass --force to generate new ones (then recreate the volumes: "
                "`docker compose -f infra/compose.yaml down -v`)"
            ],
            what="raypai services secrets",
        )
    values = compose_secrets()
    header = "# infra/compose.yaml's credentials, made by `raypai services secrets` (mode 0600; never commit it)\n"
    write_private(path, header + "".join(f"{k}={v}\n" for k, v in values.items()))
    return values


def _stop_pid(pid: int, timeout_s: float) -> None:
    import psutil

    try:
        os.killpg(pid, signal.SIGTERM)  # the group we created with start_new_session
    except ProcessLookupError:
        return
    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.TimeoutExpired:
        os.killpg(pid, signal.SIGKILL)
    except psutil.NoSuchProcess:
        pass


def down(cfg: ServicesConfig, timeout_s: float = 20.0) -> list[str]:
    """Stop the services started by `up` (MLflow first); returns the names stopped."""
    stopped = []
    for name in ("mlflow", "s3"):
        pid = _pid(cfg, name)
        if pid is not None:
            _stop_pid(pid, timeout_s)
            stopped.append(name)
        (cfg.dir / f"{name}.pid").unlink(missing_ok=True)
    return stopped


def status(cfg: ServicesConfig) -> list[ServiceState]:
    out = []
    for name, (_argv, _env, health) in _commands(cfg).items():
        pid = _pid(cfg, name)
        ok, detail = _healthy(health) if pid is not None else (False, "not running")
        out.append(ServiceState(name, pid, _base(health), str(cfg.dir / f"{name}.log"), pid is not None, ok, detail))
    return out


def load_config(home: Path, **overrides) -> ServicesConfig:
    """The config of the last `up` under `home` (RAYPAI_HOME; so `status`/`down` find its ports),
    with overrides."""
    state = Path(home) / "services" / "state.json"
    saved = json.loads(state.read_text())["config"] if state.exists() else {}
    saved.pop("home", None)
    values = {**saved, **{k: v for k, v in overrides.items() if v is not None}}
    return ServicesConfig(home=Path(home), **values)


def with_free_ports(cfg: ServicesConfig, pinned: set[str] = frozenset()) -> ServicesConfig:
    """The config with each port that is taken, by something other than our own running service,
    replaced by a free one (the default when it is free); ports in `pinned` (given by the user)
    are kept, and `up` reports the conflict."""
    from dataclasses import replace

    from raypai.runtime import pick_port, port_is_free

    changes: dict[str, int] = {}
    for name, field in (("s3", "s3_port"), ("mlflow", "mlflow_port")):
        port = getattr(cfg, field)
        if field in pinned or _pid(cfg, name) is not None or port_is_free(port):
            continue
        changes[field] = pick_port(
            ServicesConfig.__dataclass_fields__[field].default, avoid={cfg.s3_port, cfg.mlflow_port, *changes.values()}
        )
    return replace(cfg, **changes) if changes else cfg


services_app = typer.Typer(
    help="Local S3 + MLflow (PostgreSQL backend) servers: up, status, env, down.", no_args_is_help=True
)


def _home() -> Path:
    """RAYPAI_HOME for the `raypai services` commands (entry points: settings are read here)."""
    from raypai.settings import Settings

    return Settings.load().home


@services_app.command("up")
def up_command(
    postgres_url: str = typer.Option(
        None, help="an existing database on the server [postgresql+psycopg://postgres@127.0.0.1:5432/postgres]"
    ),
    mlflow_port: int = typer.Option(None, help="MLflow server port [5000, or a free one when taken]"),
    s3_port: int = typer.Option(None, help="S3 server port [9000, or a free one when taken]"),
    bucket: str = typer.Option(None, help="S3 bucket for artifacts [raypai]"),
):
    """Start the S3 and MLflow servers (PostgreSQL backend) and print the variables to export."""
    cfg = load_config(_home(), postgres_url=postgres_url, mlflow_port=mlflow_port, s3_port=s3_port, bucket=bucket)
    cfg = with_free_ports(cfg, pinned={k for k, v in {"mlflow_port": mlflow_port, "s3_port": s3_port}.items() if v})
    env = up(cfg)
    typer.echo(
        f"S3 server {cfg.s3_endpoint} (bucket {cfg.bucket}); MLflow {cfg.mlflow_uri} "
        f"(backend {redact_url(cfg.db_url(cfg.mlflow_db))}); logs in {cfg.dir}",
        err=True,
    )
    typer.echo(
        f'# point raypai at them: eval "$(raypai services env)", or source {cfg.dir / "env.sh"} (mode 0600)', err=True
    )
    for k, v in env.items():
        typer.echo(f"export {k}={_shown(k, v)}")


def _shown(name: str, value: str) -> str:
    """A variable's value as `up` prints it: secrets as ***, URLs without their passwords."""
    from raypai.credentials import redact_params

    return shlex.quote(redact_params({name: value})[name])


@services_app.command("env")
def env_command():
    """Print the `export` lines for the running services, credentials included (for eval, not for logs):
    eval "$(raypai services env)"."""
    for k, v in service_env(load_config(_home())).items():
        typer.echo(f"export {k}={shlex.quote(v)}")


@services_app.command("secrets")
def secrets_command(
    out: Path = typer.Option(Path("infra/.env"), "--out", help="the env file infra/compose.yaml reads"),
    force: bool = typer.Option(False, "--force", help="replace an existing file (new passwords)"),
):
    """Generate random passwords for infra/compose.yaml into an env file of mode 0600."""
    values = write_compose_secrets(out, force=force)
    typer.echo(f"wrote {out} (mode 0600): {', '.join(values)}", err=True)
    typer.echo(f"next: docker compose -f infra/compose.yaml up -d; set -a; . {out}; set +a", err=True)


@services_app.command("status")
def status_command():
    """Health of each service; exit code 1 unless all are healthy."""
    states = status(load_config(_home()))
    for s in states:
        mark = "healthy" if s.healthy else ("running, unhealthy" if s.running else "stopped")
        typer.echo(f"{s.name:7s} {mark:18s} {s.url}  pid={s.pid or '-'}  ({s.detail})  log={s.log}")
    if not all(s.healthy for s in states):
        raise typer.Exit(exits.FAILED)


@services_app.command("down")
def down_command():
    """Stop the services started by `raypai services up` (S3 data is in memory and goes with it)."""
    stopped = down(load_config(_home()))
    typer.echo(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
