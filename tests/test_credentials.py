"""A database password stays out of what raypai ships and shows (issue #37 item 5): Ray runtime_env
variables of drivers and jobs, MLflow params and tags, printed URLs and state files. The password
reaches Ray workers as a 0600 pgpass file (PGPASSFILE), which libpq reads by itself.

The canary password below is searched for in everything that could leak it; the local PostgreSQL
uses trust auth, so it connects whatever the password, and libpq's own record of the password it
used (`conn.info.password`) shows it found the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from raypai.credentials import redact_params, redact_url, strip_password, worker_secret_env, write_private
from raypai.settings import Settings

CANARY = "canary-Pw-7f3a9"


def _pg(url: str, password: str = CANARY) -> str:
    """`url` (postgresql+psycopg://user@host:port/db) with a password added."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1) if "@" in rest else ("postgres", rest)
    return f"{scheme}://{user.split(':')[0]}:{password}@{host}"


def _settings(tmp_path, db_url: str) -> Settings:
    return Settings.load({"RAYPAI_HOME": str(tmp_path / "home"), "RAYPAI_DATABASE_URL": db_url})


@pytest.mark.parametrize(
    "text, shown",
    [
        ("postgresql+psycopg://app:s3cret@db:5432/raypai", "postgresql+psycopg://app:***@db:5432/raypai"),
        ("postgresql://app:p@ss:w0rd@db/raypai", "postgresql://app:***@db/raypai"),
        (
            "error: cannot reach postgresql://a:b@h/db (timeout)",
            "error: cannot reach postgresql://a:***@h/db (timeout)",
        ),
        ("http://mlflow:5000/api?token=abc&x=1", "http://mlflow:5000/api?token=***&x=1"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/test", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
        ("sqlite:////tmp/raypai.db", "sqlite:////tmp/raypai.db"),
        ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1"),
    ],
)
def test_redact_url_hides_every_password_and_nothing_else(text, shown):
    assert redact_url(text) == shown


def test_redact_params_hides_secret_names_and_url_passwords():
    params = {
        "db": f"postgresql://u:{CANARY}@h/d",
        "api_token": "tok-123",
        "config": {"aws_secret_access_key": "K", "lr": 0.1, "urls": [f"s3://k:{CANARY}@minio/b"]},
        "steps": 3,
        "password_hint": "",
    }
    shown = redact_params(params)
    assert CANARY not in json.dumps(shown) and "tok-123" not in json.dumps(shown)
    assert shown["api_token"] == "***" and shown["config"]["aws_secret_access_key"] == "***"
    assert shown["config"]["lr"] == 0.1 and shown["steps"] == 3 and shown["db"] == "postgresql://u:***@h/d"


def test_settings_env_for_workers_carries_no_password(tmp_path):
    url = f"postgresql+psycopg://app:{CANARY}@db.internal:5432/raypai"
    s = Settings.load(
        {"RAYPAI_HOME": str(tmp_path), "RAYPAI_DATABASE_URL": url, "MLFLOW_TRACKING_URI": url.replace("raypai", "mlf")}
    )
    env = s.to_env()
    assert CANARY not in json.dumps(env)
    assert env["RAYPAI_DATABASE_URL"] == "postgresql+psycopg://app@db.internal:5432/raypai" == strip_password(url)
    from raypai.runtime import worker_env

    wenv = worker_env(s)  # what ray.init's runtime_env gets
    assert CANARY not in json.dumps(wenv)
    pgpass = Path(wenv["PGPASSFILE"])
    assert stat.S_IMODE(pgpass.stat().st_mode) == 0o600 and stat.S_IMODE(pgpass.parent.stat().st_mode) == 0o700
    assert pgpass.read_text().splitlines() == [
        f"db.internal:5432:raypai:app:{CANARY}",
        f"db.internal:5432:mlf:app:{CANARY}",
    ]
    # no password anywhere: no file, no variable
    assert worker_secret_env(Settings.load({"RAYPAI_HOME": str(tmp_path / "plain")})) == {}


def test_a_submitted_jobs_runtime_env_carries_no_password(tmp_path):
    from raypai.tools.cluster import runtime_env

    wheel = tmp_path / "wheels" / "raypai-0-py3-none-any.whl"
    (wheel.parent / "site" / "raypai").mkdir(parents=True)
    (wheel.parent / "site" / "raypai" / "__init__.py").touch()  # as wheel_modules unpacks it
    s = _settings(tmp_path, f"postgresql+psycopg://app:{CANARY}@db.internal:5432/raypai")
    remote = runtime_env(wheel, env={}, settings=s)
    assert CANARY not in json.dumps(remote) and "PGPASSFILE" not in remote["env_vars"]  # the nodes hold it
    local = runtime_env(wheel, env={}, settings=s, same_machine=True)
    assert CANARY not in json.dumps(local) and Path(local["env_vars"]["PGPASSFILE"]).read_text().endswith(f"{CANARY}\n")


def test_libpq_finds_the_password_in_the_file_the_workers_get(pg_server_url, tmp_path):
    """What a worker does: Settings from the runtime_env variables, then connect. libpq takes the
    password from PGPASSFILE (a trust-auth server accepts any; conn.info.password says which it sent)."""
    import psycopg

    s = _settings(tmp_path, _pg(pg_server_url))
    env = {**s.to_env(), **worker_secret_env(s)}
    worker = Settings.load(env)
    assert CANARY not in worker.database_url
    plain = worker.database_url.replace("postgresql+psycopg://", "postgresql://")
    old = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = env["PGPASSFILE"]
    try:
        with psycopg.connect(plain, connect_timeout=10) as conn:
            assert conn.info.password == CANARY
    finally:
        os.environ.pop("PGPASSFILE") if old is None else os.environ.__setitem__("PGPASSFILE", old)


def test_mlflow_params_and_tags_never_hold_a_password(tmp_path):
    from raypai.tracking import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_root=tmp_path / "mlartifacts")
    run_id = tracker.start_run("secrets", "run")
    logger = tracker.logger(run_id)
    logger.log_params({"dsn": f"postgresql://u:{CANARY}@db/x", "db_password": CANARY, "n": 3})
    logger.set_tags({"source": f"https://user:{CANARY}@git.example/repo.git", "api_key": CANARY})
    run = tracker.get_run(run_id)
    assert CANARY not in json.dumps(run.data.params) + json.dumps(run.data.tags)
    assert run.data.params["n"] == "3" and run.data.params["dsn"] == "postgresql://u:***@db/x"


def test_private_files_are_0600_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        p = write_private(tmp_path / "d" / "state.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "{}"
    assert not list(p.parent.glob(".*tmp"))
