"""Shared test set-up: quiet, CPU-only services; a fresh RAYPAI_HOME per test; PostgreSQL databases.

Markers are applied here, from what a test needs, so none can be forgotten:
  postgres     - the test uses the PostgreSQL server (fixture pg_server_url / pg_url, or db_url's
                 "postgresql" case); skipped, and said so loudly at the end, without RAYPAI_TEST_DATABASE_URL
  slow         - the end-to-end runs under tests/e2e/ (`pytest -m "not slow"` leaves them out)
  integration  - starts Ray, Serve or a process of its own: a fixture it uses (directly or through
                 another) is one of _INTEGRATION_FIXTURES, or it is under tests/e2e/
  gpu          - needs CUDA (set on the test itself, with a skipif naming the reason)

`pytest --fast` (`make test-fast`) runs every test that needs no Ray, Serve or process: the
`integration` ones are deselected, and one that starts Ray or a process all the same is skipped at
that moment (the guards below), so a new test is classified by what it does, with no list to keep.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

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
# Ray Train starts a preemption watcher actor per run (≈ 2.6 CPU-s: a Python worker importing Ray
# Train) that polls for nodes being drained, which a test's one-machine Ray never does.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

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
# with several test processes none is left running a long file alone at the end (_order). `make test`
# hands out whole files in this order (`--dist loadfile --no-loadscope-reorder`: xdist's own order is
# by number of tests).
_LONGEST_FIRST = (
    "alignment/test_families.py",
    "train/test_pretrain.py",
    "alignment/test_ranks.py",
    "alignment/test_algorithms.py",
    "serving/test_serving.py",
    "e2e/test_tinychat.py",
    "cli/test_cli.py",
    "alignment/test_roles.py",
    "data/test_dedup_dist.py",
    "alignment/test_decode.py",
    "e2e/test_finetune.py",
    "infra/test_production_run.py",
    "store/test_metadata.py",
    "alignment/test_cli.py",
    "test_runtime.py",
    "train/test_steps.py",
    "infra/test_local_cluster.py",
    "train/test_cli_train.py",
)
_TESTS = Path(__file__).resolve().parent

# Scale drills: several processes of one job (DeepSpeed ranks, Ray Train worker groups, a 2-node
# cluster, the run on the production services) and the four-family matrix (every algorithm and a
# deployment per family), each file many minutes long, and single drills marked `@pytest.mark.scale`
# where they are (a 2-rank run, a kill-and-resume, the demo on taken ports, the second end-to-end run).
# `make test` leaves them to `make test-scale`, which CI runs too (.ci/run).
_SCALE_FILES = frozenset(
    {
        "alignment/test_ranks.py",
        "alignment/test_families.py",
        "train/test_pretrain.py",
        "infra/test_local_cluster.py",
        "infra/test_production_run.py",
    }
)


def _file_rank(item) -> int:
    name = item.path.relative_to(_TESTS).as_posix()
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


# ---- integration tests and `--fast` ----------------------------------------------------------------

# The fixtures that start Ray (and Serve on it) or another process. A test using one of them, directly
# or through another fixture, is `integration`.
_INTEGRATION_FIXTURES = frozenset(
    {
        "shared_ray",  # below: ray_plain, ray_align and the other fixtures built on it
        "ray_train",  # tests/train/conftest.py
        "ray_local",  # tests/data/*: Ray of their own CPU count
        "ray_two_cpus",
        "stack",  # tests/serving/test_serving.py: Ray, Serve and the deploy API
        "running_services",  # tests/infra/conftest.py: `raypai services up`
        "two_nodes",  # tests/alignment/test_multinode.py: a 2-node ray.cluster_utils.Cluster
    }
)
_REPO = str(Path(__file__).resolve().parents[1])
_STDLIB = sysconfig.get_paths()["stdlib"]
_FAST_SKIP = "{what}: an integration test (`make test` runs it; `make test-fast` does not)"


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the tests that need no Ray, Serve or process of their own (make test-fast)",
    )


def _is_integration(item) -> bool:
    return "e2e" in item.path.parts or bool(_INTEGRATION_FIXTURES & set(item.fixturenames))


def _started_here() -> bool:
    """Whether the process being started was asked for by this repository's code (a test, raypai),
    rather than by a library doing its own work (torch's compiler runs g++, Ray starts its daemons)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):
        frame = frame.f_back  # subprocess.run, shutil, ...: look at who called them
    name = frame.f_code.co_filename if frame is not None else ""
    return name.startswith(_REPO) and "site-packages" not in name


def _refuse(what: str):
    """Under --fast: stop the running test as skipped; a report of a test that failed after this
    (the refusal hit a thread of it) is turned into the same skip by pytest_runtest_makereport."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    _FAST_REFUSED.setdefault(test, what)
    pytest.skip(_FAST_SKIP.format(what=what), allow_module_level=True)  # also when a module starts one on import


_FAST_REFUSED: dict[str, str] = {}  # nodeid -> what it started, under --fast


def _install_fast_guards() -> None:
    import ray

    @functools.wraps(ray.init)
    def init(*args, **kwargs):
        _refuse("starts Ray")

    ray.init = init  # Serve, Ray Data and Ray's auto-init all come through ray.init

    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def guarded_popen_init(self, args, *rest, **kwargs):
        if _started_here():
            self._child_created = False  # what Popen.__del__ reads of a Popen that never started
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            _refuse(f"starts a process ({Path(str(argv[0])).name})")
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_popen_init


def pytest_configure(config):
    # registered here rather than in pyproject.toml's list, next to the rule that applies the others
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped with the reason where there is none")
    config.addinivalue_line(
        "markers", "integration: starts Ray, Serve or a process of its own (applied by tests/conftest.py)"
    )
    if config.getoption("fast"):
        _install_fast_guards()


def _ray_kind(path: Path, items) -> int:
    """The shared Ray a file asks for, in the order they are handed out: the dashboard first (ray_align),
    which the plain ones (ray_plain) reuse, then those of another CPU count."""
    names = set().union(*(item.fixturenames for item in items if item.path == path))
    return 0 if "ray_align" in names else 1 if "ray_plain" in names else 2


def _order(items) -> list:
    """Files longest first (_LONGEST_FIRST), except that the files on the shared Ray follow the longest
    one as a block: while one test process runs the longest file, the other takes the block's files
    one after the other, on one Ray. Tests keep their order within a file."""
    items = sorted(items, key=_file_rank)  # stable
    first = [item for item in items if item.path == items[0].path] if items else []
    shared = {item.path for item in items if "shared_ray" in item.fixturenames} - {items[0].path if items else None}
    kind = {path: _ray_kind(path, items) for path in shared}
    block = sorted((item for item in items if item.path in shared), key=lambda item: kind[item.path])
    rest = [item for item in items if item.path not in shared and item not in first]
    return first + block + rest


def pytest_collection_modifyitems(config, items):
    items[:] = _order(items)
    _SHARED_RAY_FILES.update(item.path for item in items if "shared_ray" in item.fixturenames)
    fast, deselected = config.getoption("fast"), []
    for item in items:
        if _needs_postgres(item):
            item.add_marker(pytest.mark.postgres)
            if not os.environ.get(_PG_VAR):
                item.add_marker(pytest.mark.skip(reason=_PG_SKIP))
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if item.path.relative_to(_TESTS).as_posix() in _SCALE_FILES:
            item.add_marker(pytest.mark.scale)
        if _is_integration(item):
            item.add_marker(pytest.mark.integration)
            if fast:
                deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        out = set(deselected)
        items[:] = [item for item in items if item not in out]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    what = _FAST_REFUSED.get(item.nodeid)
    if what and report.failed:  # the refusal was raised in a thread of the test and it failed for that
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] + 1, "Skipped: " + _FAST_SKIP.format(what=what))
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: printed after the short test summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A loud line when PostgreSQL tests were skipped: a green run then did not test the production layer."""
    result = yield
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if _PG_VAR in str(r.longrepr)]
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


# ---- one local Ray per test process, kept from one module for the next that can use it -------------

# A local Ray's start and stop cost ≈ 6 CPU-seconds (11 with the dashboard) besides the test's own
# work. Module fixtures built on `shared_ray` (ray_plain, ray_align, ...) take the test process's
# shared one, started with the options asked when it lacks them (the dashboard, another CPU count).
# At a module's end it is kept when the next module (the next test's file) uses `shared_ray` and
# nothing of this module is left on it; else it is shut down, and so is any other Ray (a module's
# own, the runner's), as every Ray was before.
_NEXT_ITEM: list = [None]  # the test that runs after the current one (None: the last)
_SHARED_RAY_FILES: set = set()  # the test files of which a test uses `shared_ray`


class _SharedRay:
    def __init__(self):
        self.gcs: str | None = None
        self.num_cpus = 0
        self.num_gpus = 0
        self.dashboard = False

    def running(self) -> bool:
        import ray

        return self.gcs is not None and ray.is_initialized() and ray.get_runtime_context().gcs_address == self.gcs

    def get(self, *, num_cpus: int, dashboard: bool, num_gpus: int = 0) -> str:
        """The GCS address of a local Ray with these options (the dashboard: at least). `num_gpus`:
        logical GPUs (Ray places and numbers them; nothing computes on them here)."""
        import ray

        same = self.num_cpus == num_cpus and self.num_gpus == num_gpus
        if self.running() and same and (self.dashboard or not dashboard):
            return self.gcs
        if ray.is_initialized():
            ray.shutdown()
        ctx = ray.init(
            address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=dashboard, log_to_driver=False
        )
        self.gcs, self.num_cpus, self.num_gpus, self.dashboard = (
            ctx.address_info["gcs_address"],
            num_cpus,
            num_gpus,
            dashboard,
        )
        return self.gcs

    def left_clean(self, wait_s: float = 10.0) -> bool:
        """Nothing of the module that ends is left: no actor that is not dead, no placement group,
        every resource free (no task running). An actor's exit takes a moment to be recorded."""
        import ray
        from ray._private.state import actors

        total = {k: v for k, v in ray.cluster_resources().items() if k not in ("memory", "object_store_memory")}
        deadline = time.monotonic() + wait_s
        while True:
            free = ray.available_resources()
            if (
                all(free.get(k, 0) >= v - 1e-6 for k, v in total.items())
                and all(a["State"] == "DEAD" for a in actors().values())
                and all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
            ):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


_SHARED_RAY = _SharedRay()


@pytest.fixture(scope="session")
def shared_ray():
    """`shared_ray(num_cpus=8, dashboard=False)` -> the GCS address of this test process's shared
    local Ray (for module-scoped fixtures: it may be stopped at a module's end)."""

    def get(*, num_cpus: int = 8, dashboard: bool = False, num_gpus: int = 0) -> str:
        return _SHARED_RAY.get(num_cpus=num_cpus, dashboard=dashboard, num_gpus=num_gpus)

    return get


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _NEXT_ITEM[0] = nextitem
    return (yield)


@pytest.fixture(autouse=True, scope="module")
def _ray_shutdown_after_module():
    """A module that started Ray (directly or through the runner) leaves none behind, but the shared
    one, which it leaves clean for the next module when that one uses it."""
    yield
    if "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized():
        return
    nxt = _NEXT_ITEM[0]
    if _SHARED_RAY.running() and nxt is not None and nxt.path in _SHARED_RAY_FILES and _SHARED_RAY.left_clean():
        return
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
