"""The `raypai` command line.

raypai run pipelines/toy.py --param n=20
raypai runs ; raypai show RUN_ID ; raypai resume RUN_ID
raypai lineage ARTIFACT_ID [--down] [--json]
raypai verify ARTIFACT_ID_OR_URI        # every file hashed again against the recorded digest
raypai doctor ; raypai ui
raypai ray start ; raypai ray status ; raypai ray stop     # raypai's own local Ray head, on free ports
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Optional

import typer

from raypai import exits
from raypai.cli.render import Progress, console, lineage_tree, runs_table, steps_table, summary_table
from raypai.config import parse_assignments
from raypai.errors import NotFoundError, PipelineError, RaypaiError

app = typer.Typer(
    help="raypai: raw text → trained, aligned, deployed language model, with lineage.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="Metadata database schema (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")
ray_app = typer.Typer(help="raypai's local Ray head (free ports, recorded under RAYPAI_HOME).", no_args_is_help=True)
app.add_typer(ray_app, name="ray")


_VERBOSE = (
    "also print every worker log line (Ray Data, Ray Train, alignment) instead of one progress line per "
    "running step; they always go to the run's log file [RAYPAI_VERBOSE=1]"
)


def _settings():
    from raypai.settings import Settings

    return Settings.load()


def _store():
    from raypai.store import MetadataStore

    return MetadataStore(_settings().database_url)


def parse_params(params: list[str]) -> dict:
    """`--param KEY=VALUE` strings as a dict (values as written; the pipeline's typed parameters
    convert them). Public for pipeline files with a `main()` of their own."""
    return parse_assignments(params, flag="--param")


def finish_run(result) -> None:
    """Print a run's summary table and any failure; exit 1 (with the resume command) if it failed."""
    console.print(summary_table(result))
    if result.mlflow_run_id:
        console.print(
            f"MLflow parent run: [bold]{result.mlflow_run_id}[/]  ·  details: raypai show {result.run_id[:12]}"
        )
    for node, r in result.steps.items():
        if r.state == "failed":
            console.print(f"[red]step {node} failed:[/] {r.error}")
            if r.traceback:
                console.print(f"[dim]{r.traceback.strip()[-3000:]}[/]")
    if result.state == "failed":
        console.print(f"fix the cause, then: [bold]raypai resume {result.run_id[:12]}[/]")
        raise typer.Exit(exits.FAILED)


@app.command()
def run(
    target: str = typer.Argument(..., help="FILE.py[:PIPELINE] or package.module[:PIPELINE]"),
    param: list[str] = typer.Option([], "--param", "-p", help="pipeline parameter KEY=VALUE (repeatable)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=_VERBOSE),
):
    """Run a pipeline; unchanged steps are cache hits."""
    from raypai.loader import load_pipeline
    from raypai.runner import Runner

    pipe = load_pipeline(target)
    dag = pipe.build(**parse_params(param))
    result = Runner(_settings(), progress=Progress(verbose=verbose or None)).run(dag, source_file=_target_file(target))
    finish_run(result)


def _target_file(target: str) -> str:
    """What `resume` loads again: the file's absolute path, or the module name."""
    path = target.partition(":")[0]
    return os.path.abspath(path) if path.endswith(".py") else path


@app.command()
def resume(
    run_id: str = typer.Argument(..., help="id (or prefix) of a failed or interrupted run"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=_VERBOSE),
):
    """Re-run a run: finished steps are reused, failed/unfinished ones run again."""
    from raypai.loader import load_pipeline
    from raypai.runner import Runner

    store = _store()
    origin = store.get_run(run_id)
    source = store.pipeline_source(origin["pipeline"])
    if not source:
        raise NotFoundError(f"run {run_id} has no recorded pipeline source; run it again with `raypai run`")
    pipe = load_pipeline(f"{source}:{origin['pipeline']}")
    dag = pipe.build(**origin["params"])
    console.print(f"resuming run {origin['id'][:12]} ({origin['state']}) of {origin['pipeline']}")
    result = Runner(_settings(), progress=Progress(verbose=verbose or None)).run(
        dag, origin_run_id=origin["id"], source_file=source
    )
    finish_run(result)


@app.command()
def runs(limit: int = 20, pipeline: Optional[str] = None):
    """List recent pipeline runs."""
    console.print(runs_table(_store().list_runs(limit=limit, pipeline=pipeline)))


@app.command()
def show(
    run_id: str,
    openlineage: bool = typer.Option(False, help="print the run as OpenLineage events (JSON)"),
    key: bool = typer.Option(False, "--key", help="also print what each step's cache key is made of"),
):
    """Show one run: its steps, states, why each was or was not a cache hit, errors, outputs."""
    from rich.markup import escape

    from raypai.lineage import openlineage_events

    store = _store()
    r = store.get_run(run_id)
    if openlineage:
        print(json.dumps(openlineage_events(store, r["id"]), indent=1))
        return
    from raypai.credentials import redact_params

    shown = escape(json.dumps(redact_params(r["params"])))  # a password given as a parameter stays unprinted
    console.print(f"[bold]run {r['id']}[/] of {r['pipeline']}: {r['state']}  params={shown}")
    if r["origin_run_id"]:
        console.print(f"resumed from {r['origin_run_id']}")
    steps = store.step_runs(r["id"])
    console.print(steps_table(steps))
    for s in steps:
        if s["cache_reason"]:
            console.print(
                f"  {s['node']}: {escape(s['cache_reason'])}", soft_wrap=True
            )  # one line per step, never wrapped
    for s in steps:
        if key and s["cache_components"]:
            console.print(
                f"[bold]{s['node']}[/] cache key {s['cache_key']}:\n"
                f"[dim]{escape(json.dumps(s['cache_components'], indent=1))}[/]"
            )
        for name, a in store.outputs_of(s["id"]).items():
            console.print(f"  {s['node']} → {name}: {a.kind} {a.name} [dim]{a.id}[/]")
        if s["traceback"]:
            console.print(f"[red]{s['node']} traceback:[/]\n[dim]{escape(s['traceback'].strip()[-3000:])}[/]")


@app.command()
def artifacts(kind: Optional[str] = None, limit: int = 30):
    """List artifacts, newest first."""
    from rich.table import Table

    t = Table(title="artifacts")
    for col in ("id", "kind", "name", "digest", "size", "uri"):
        t.add_column(col)
    for a in _store().list_artifacts(kind=kind, limit=limit):
        t.add_row(a.id[:12], a.kind, a.name, a.digest[:12], str(a.size_bytes), a.uri)
    console.print(t)


@app.command()
def verify(ref: str = typer.Argument(..., help="artifact id, id or digest prefix, or its uri")):
    """Read every file of an artifact again and check it against the digest recorded when it was saved:
    exit 0 when it matches, 1 naming each file that differs (2: no such artifact)."""
    from raypai.artifacts import ArtifactStore

    settings = _settings()
    art = _store().get_artifact(ref)
    problems = ArtifactStore(settings.artifact_uri, cache_dir=settings.home / "cache").verify(art)
    what = f"{art.kind} {art.name} ({art.id[:12]}) at {art.uri}"
    if problems:
        console.print(f"[red]{what} differs from what was recorded (sha256 {art.digest}):[/]")
        for p in problems:
            console.print(f"  {p}")
        console.print(
            f"delete {art.uri} and re-run the step that made it: the run saves the content anew "
            "(a file whose size differs is caught, and replaced, without deleting)"
        )
        raise typer.Exit(exits.FAILED)
    console.print(f"[green]ok[/] {what}: {art.size_bytes} bytes, sha256 {art.digest}")


@app.command()
def lineage(
    ref: Optional[str] = typer.Argument(None, help="artifact id/prefix, or a run id (its outputs)"),
    down: bool = typer.Option(False, "--down", help="show what was built from it instead"),
    as_json: bool = typer.Option(False, "--json", help="print the graph as JSON"),
    deployment: Optional[str] = typer.Option(None, "--deployment", help="start from a deployment's model"),
):
    """The chain from an artifact back to the raw sources (or forward with --down)."""
    from raypai import lineage as lin

    store = _store()
    if deployment:
        from raypai.lineage.deploy import deployment_lineage

        graph = deployment_lineage(store, _settings(), deployment)
        if as_json:
            print(json.dumps(graph, indent=1, default=str))
        else:
            from raypai.cli.render import deployment_view

            deployment_view(graph)
        return
    if not ref:
        raise PipelineError("give an artifact id (see `raypai artifacts`), a run id, or --deployment NAME")
    ids = []
    try:
        ids = [store.get_artifact(ref).id]
    except NotFoundError:
        r = store.get_run(ref)
        ids = [
            a.id
            for s in store.step_runs(r["id"])
            for a in store.outputs_of(s["id"]).values()
            if not store.consumers_of(a.id) or down
        ]
    graphs = [(lin.downstream if down else lin.upstream)(store, i) for i in ids]
    if as_json:
        print(json.dumps(graphs[0] if len(graphs) == 1 else graphs, indent=1, default=str))
        return
    for g in graphs:
        console.print(lineage_tree(g, down=down))


@app.command()
def ui(port: Optional[int] = typer.Option(None, help="MLflow UI port [5000, or a free one]"), host: str = "127.0.0.1"):
    """Start the MLflow UI on the configured tracking store and print where to look."""
    from raypai.runtime import DEFAULT_PORTS, check_port, load_state, pick_port, record_endpoint

    s = _settings()
    if port is not None:
        check_port("MLflow UI", port)
    port = port or pick_port(DEFAULT_PORTS["mlflow_ui"])
    head = load_state(s).head
    from raypai.credentials import redact_url, strip_password, worker_secret_env

    console.print(f"MLflow UI:      http://{host}:{port}   (tracking store {redact_url(s.mlflow_tracking_uri)})")
    if head is not None and head.dashboard_url:
        console.print(f"Ray dashboard:  {head.dashboard_url}  (raypai's Ray head)")
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--backend-store-uri",
        strip_password(s.mlflow_tracking_uri),  # a command line is visible to every user: libpq reads PGPASSFILE
        "--default-artifact-root",
        str(s.home / "mlartifacts"),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **worker_secret_env(s), "MLFLOW_DISABLE_TELEMETRY": "true"})
    record_endpoint(s, "mlflow_ui", f"http://{host}:{port}", proc.pid)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        code = proc.wait()
    raise typer.Exit(code)


@ray_app.command("start")
def ray_start(
    num_cpus: Optional[int] = typer.Option(None, help="logical CPUs [RAYPAI_RAY_NUM_CPUS or max(8, cores)]"),
    dashboard: Optional[bool] = typer.Option(None, "--dashboard/--no-dashboard", help="[RAYPAI_DASHBOARD]"),
):
    """Start raypai's persistent local Ray head on free ports (or reuse the one running)."""
    from raypai.cli.render import head_lines
    from raypai.runtime import load_state, start_head

    s = _settings()
    if s.ray_address:
        console.print(f"RAY_ADDRESS={s.ray_address} is set: raypai uses that cluster, no local head started")
        return
    running = load_state(s).head
    head = start_head(s, num_cpus=num_cpus, dashboard=dashboard)
    console.print(("reusing" if running is not None else "started") + " raypai's Ray head")
    for line in head_lines(head):
        console.print(line, soft_wrap=True)


@ray_app.command("status")
def ray_status():
    """Where raypai's Ray head and servers run (exit code 1 when no head runs)."""
    from raypai.cli.render import head_lines
    from raypai.runtime import load_state, state_path

    s = _settings()
    state = load_state(s)
    if state.head is None:
        console.print(f"no raypai Ray head runs for RAYPAI_HOME={s.home}; start one with `raypai ray start`")
    else:
        for line in head_lines(state.head):
            console.print(line, soft_wrap=True)
    for name, ep in state.endpoints.items():
        console.print(f"{name:10s} {ep.url}  pid {ep.pid}")
    console.print(f"[dim]recorded in {state_path(s)}[/]")
    raise typer.Exit(exits.OK if state.head is not None else exits.FAILED)


@ray_app.command("stop")
def ray_stop():
    """Stop raypai's Ray head for this RAYPAI_HOME (never another Ray on the machine)."""
    from raypai.runtime import load_state, stop_head

    s = _settings()
    head = load_state(s).head
    stopped = stop_head(s)
    if head is None:
        console.print("no raypai Ray head was running for this RAYPAI_HOME")
    else:
        console.print(f"stopped raypai's Ray head at {head.address} ({len(stopped)} processes)")


@app.command()
def doctor():
    """Check the install: stdlib platform not shadowed, database, MLflow, Ray, torch, DeepSpeed."""
    from raypai.tools.doctor import run_checks

    ok = True
    for name, passed, detail in run_checks(_settings()):
        ok &= passed
        console.print(f"{'[green]✓' if passed else '[red]✗'} {name}[/]  {detail}")
    raise typer.Exit(exits.OK if ok else exits.FAILED)


@db_app.command("upgrade")
def db_upgrade(revision: str = "head"):
    """Upgrade the metadata schema (Alembic) to REVISION."""
    from raypai.store import MetadataStore, current_revision, migrate

    store = MetadataStore(_settings().database_url, migrate_schema=False)
    before = current_revision(store.engine)
    migrate(store.engine, revision)
    console.print(f"metadata schema: {before or '(empty)'} → {current_revision(store.engine)}")


@db_app.command("current")
def db_current():
    """Print the metadata schema revision."""
    from raypai.store import MetadataStore, current_revision

    console.print(current_revision(MetadataStore(_settings().database_url, migrate_schema=False).engine) or "(empty)")


# Commands contributed by the packages (each owns its module; mounted here). A module that fails to
# import stops the CLI with its name and the cause: a command never vanishes silently.
_MOUNTS = [
    ("raypai.data.cli", "app", "data", "typer"),
    ("raypai.train.cli", "train_command", "train", "command"),
    ("raypai.alignment.cli", "align_command", "align", "command"),
    ("raypai.alignment.cli", "model_app", "model", "typer"),
    ("raypai.serving.cli", "deploy_app", "deploy", "typer"),
    ("raypai.serving.cli", "token_app", "token", "typer"),
    ("raypai.serving.cli", "server_command", "server", "command"),
    ("raypai.tools.services", "services_app", "services", "typer"),
    ("raypai.tools.cluster", "submit_command", "submit", "command"),
]


class CommandImportError(RaypaiError, ImportError):
    """A sub-command's module is broken (raised while the CLI starts, with the original as cause)."""


def _mount() -> None:
    for module, attr, name, kind in _MOUNTS:
        try:
            obj = getattr(importlib.import_module(module), attr)
        except Exception as exc:
            raise CommandImportError(
                f"`raypai {name}` cannot be loaded: importing {module} failed ({type(exc).__name__}: {exc}). "
                f"Fix {module} (traceback above) or reinstall raypai (`make install`)"
            ) from exc
        if kind == "typer":
            app.add_typer(obj, name=name)
        else:
            app.command(name)(obj)


_mount()


def main() -> None:
    # MLflow's INFO lines (creating a tracking database) would interleave with the run display
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        app()
    except RaypaiError as exc:  # raypai refused: one message naming the fix, no traceback (raypai.cli.exits)
        console.print(f"[red]error:[/] {exc}")
        sys.exit(exits.REFUSED)
