"""Shared test set-up: quiet, CPU-only services; a fresh RAYPAI_HOME per test; PostgreSQL databases.

Markers are applied here, from what a test needs, so none can be forgotten:
  postgres  - the test uses the PostgreSQL server (fixture pg_server_url / pg_url, or db_url's
              "postgresql" case); skipped, and said so loudly at the end, without RAYPAI_TEST_DATABASE_URL
  slow      - the end-to-end runs under tests/e2e/ (`pytest -m "not slow"` for a quick pass)
  gpu       - needs CUDA (set on the test itself, with a skipif naming the reason)
"""

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
# A local Ray prestarts one idle Python worker per logical CPU for its first driver (8 here, on 2
# cores); most tests use a few, so the rest only cost CPU at every one of the suite's Ray starts.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

_RAYPAI_VARS = (
    "RAYPAI_HOME",
    "RAYPAI_DATABASE_URL",
    "MLFLOW_TRACKING_URI",
    "RAYPAI_ARTIFACT_URI",
    "RAY_ADDRESS",
    "RAYPAI_CONFIG",
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Serve's proxy binds its port with SO_REUSEPORT: two test processes (pytest-xdist workers, a
# colleague's run, `make demo`) on the default 8000 would silently share each other's traffic.
# Each test process gets a port of its own, unless the caller pinned one. pytest-xdist's workers
# inherit the environment of the process that started them, which loaded this file first: a port
# this file chose there (marked with that process's id) is chosen again in each worker.
if (
    os.environ.get("_RAYPAI_TEST_SERVE_PORT_OF", str(os.getpid())) != str(os.getpid())
    or "RAYPAI_SERVE_PORT" not in os.environ
):
    os.environ["RAYPAI_SERVE_PORT"] = str(_free_port())
    os.environ["_RAYPAI_TEST_SERVE_PORT_OF"] = str(os.getpid())

_PG_VAR = "RAYPAI_TEST_DATABASE_URL"
_PG_SKIP = (
    f"{_PG_VAR} is not set: the production layer (PostgreSQL) is not tested; `make test` sets it "
    "when a local PostgreSQL server answers"
)


def _needs_postgres(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return bool({"pg_server_url", "pg_url"} & set(item.fixturenames)) or params.get("db_url") == "postgresql"


# The files that take longest (minutes each, measured in `make test`'s durations) start first, so that
# with several test processes (`--dist loadfile` hands out whole files in this order) none is left
# running a long file alone at the end. Order inside a file is kept.
_LONGEST_FIRST = (
    "alignment/test_families.py",
    "train/test_pretrain.py",
    "e2e/test_tinychat.py",
    "serving/test_serving.py",
    "alignment/test_algorithms.py",
    "test_runtime.py",
    "e2e/test_finetune.py",
    "cli/test_cli.py",
    "train/test_cli_train.py",
    "alignment/test_cli.py",
    "train/test_steps.py",
)


def _file_rank(item) -> int:
    path = item.path.as_posix()
    return next((i for i, name in enumerate(_LONGEST_FIRST) if path.endswith("tests/" + name)), len(_LONGEST_FIRST))


def pytest_configure(config):
    # registered here rather than in pyproject.toml's list, next to the rule that applies the others
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped with the reason where there is none")


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: files keep their order among equals, tests theirs within a file
    for item in items:
        if _needs_postgres(item):
            item.add_marker(pytest.mark.postgres)
            if not os.environ.get(_PG_VAR):
                item.add_marker(pytest.mark.skip(reason=_PG_SKIP))
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: printed after the short test summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A loud line when PostgreSQL tests were skipped: a green run then did not test the production layer."""
    result = yield
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "postgres" in getattr(r, "keywords", ())]
    if not skipped:
        return result
    tr = terminalreporter
    tr.write_sep("!", f"{len(skipped)} PostgreSQL test(s) SKIPPED: {_PG_VAR} is not set", red=True, bold=True)
    tr.write_line(
        "The metadata store on PostgreSQL, `raypai services` and the production runs were NOT tested.",
        red=True,
        bold=True,
    )
    tr.write_line(
        f"Run `make test` (it sets {_PG_VAR} when a local server answers on 127.0.0.1:5432), or "
        f"export {_PG_VAR}=postgresql+psycopg://postgres@127.0.0.1:5432/test",
        red=True,
    )
    return result


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
        pytest.skip(_PG_SKIP)
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
