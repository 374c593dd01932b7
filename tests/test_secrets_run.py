"""A real pipeline run against a PostgreSQL metadata database whose URL carries a canary password
(issue #37 item 5): the run works (the workers reach the database through the 0600 pgpass file), and
the password is in no Ray runtime_env, worker environment, MLflow param or tag, no log line of
the run or of the Ray session, and not in what `raypai show` prints. The local PostgreSQL uses trust auth, so any password connects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from raypai import Runner, StepContext, pipeline, step
from raypai.settings import Settings

CANARY = "canary-Pw-51d0e"


@step(cpus=0.25, cache=False)
def probe(ctx: StepContext, dsn: str, n: int) -> dict:
    """What a worker sees: its environment, its runtime_env, and whether it reaches the database."""
    import ray

    from raypai.store import MetadataStore

    worker = Settings.load()
    MetadataStore(worker.database_url, migrate_schema=False).list_deployments()  # libpq: PGPASSFILE
    print(f"probe step connected to {worker.database_url}")  # a log line that would show a password
    return {
        "environ": dict(os.environ),
        "runtime_env": ray.get_runtime_context().runtime_env,
        "database_url": worker.database_url,
    }


@pipeline
def secrets_probe(dsn: str = "", n: int = 1):
    return probe(dsn=dsn, n=n)


def _files_with(root: Path, needle: str) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        try:
            if p.is_file() and needle.encode() in p.read_bytes():
                hits.append(str(p))
        except OSError:
            pass
    return hits


def test_a_pipeline_run_leaves_the_password_nowhere(pg_url, tmp_path, monkeypatch):
    import ray

    scheme, rest = pg_url.split("://", 1)
    user, host = rest.split("@", 1)
    secret_url = f"{scheme}://{user.split(':')[0]}:{CANARY}@{host}"
    home = tmp_path / "home"
    monkeypatch.setenv("RAYPAI_HOME", str(home))
    monkeypatch.setenv("RAYPAI_DATABASE_URL", secret_url)
    monkeypatch.setenv("RAYPAI_DASHBOARD", "0")
    settings = Settings.load()
    if ray.is_initialized():
        ray.shutdown()  # this run's own local Ray, started with these settings
    try:
        # the password also arrives as a pipeline parameter: MLflow params get it redacted
        res = Runner(settings).run(secrets_probe.build(dsn=secret_url, n=2))
        assert res.ok, res
        seen = res["probe"].value
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    finally:
        ray.shutdown()
    assert CANARY not in json.dumps(seen["runtime_env"]), "password in the worker's runtime_env"
    assert CANARY not in json.dumps(seen["environ"]), "password in the worker's environment"
    assert seen["database_url"].endswith(host) and CANARY not in seen["database_url"]
    assert "PGPASSFILE" in seen["runtime_env"]["env_vars"]

    from raypai.runtime import tracker

    t = tracker(settings)
    runs = [t.get_run(res.mlflow_run_id)] + list(t.child_runs(res.mlflow_run_id))
    shown = json.dumps([{**r.data.params, **r.data.tags} for r in runs])
    assert CANARY not in shown and "dsn" in shown, shown  # logged, with the password replaced

    assert _files_with(session / "logs", CANARY) == []  # Ray's logs (runtime_env agent, workers, raylet)
    assert _files_with(home / "logs", CANARY) == []  # the run's own log
    assert any("probe step connected to" in p.read_text(errors="replace") for p in (session / "logs").rglob("*.out"))
    assert _files_with(home, CANARY) == [str(home / "secrets" / "pgpass")]  # the one 0600 file that holds it

    # `raypai show RUN` prints the run's parameters (the store keeps them as given, for resume)
    show = subprocess.run(
        [sys.executable, "-m", "raypai.cli", "show", res.run_id],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "1000"},
    )
    assert show.returncode == 0, show.stdout + show.stderr
    assert "dsn" in show.stdout and CANARY not in show.stdout + show.stderr
