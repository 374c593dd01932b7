"""Shared test set-up: quiet, CPU-only services; a fresh RAYPAI_HOME per test; PostgreSQL databases."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYPAI_DASHBOARD", "0")

_RAYPAI_VARS = ("RAYPAI_HOME", "RAYPAI_DATABASE_URL", "MLFLOW_TRACKING_URI", "RAYPAI_ARTIFACT_URI", "RAY_ADDRESS",
                "RAYPAI_CONFIG")


@pytest.fixture
def raypai_home(tmp_path, monkeypatch):
    """Embedded defaults rooted in a temporary folder; returns the loaded Settings."""
    from raypai.settings import Settings

    for var in _RAYPAI_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAYPAI_HOME", str(tmp_path / "home"))
    return Settings.load()


@pytest.fixture(autouse=True, scope="module")
def _ray_shutdown_after_module():
    """A module that started Ray (directly or through the runner) leaves none behind."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def pg_server_url():
    url = os.environ.get("RAYPAI_TEST_DATABASE_URL")
    if not url:
        pytest.skip("RAYPAI_TEST_DATABASE_URL is not set (CI sets it to the local PostgreSQL server)")
    return url


@pytest.fixture(scope="session")
def pg_url(pg_server_url):
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    from sqlalchemy import create_engine, text

    name = f"raypai_t_{uuid.uuid4().hex[:10]}"
    admin = create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    base, _, _db = pg_server_url.rpartition("/")
    yield f"{base}/{name}"
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The metadata suite runs on both backends."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/meta.db"
    return request.getfixturevalue("pg_url")
