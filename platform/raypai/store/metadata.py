"""MetadataStore: runs, step runs, artifacts and their edges in SQLite or PostgreSQL.

store = MetadataStore("sqlite:///.raypai/raypai.db")     # migrates to the latest schema
store = MetadataStore("postgresql+psycopg://postgres@127.0.0.1:5432/test")
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import and_, case, create_engine, event, func, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from raypai.artifacts import Artifact
from raypai.deployment import DeploymentSpec
from raypai.errors import DeploymentConflict, NotFoundError, StoreError
from raypai.store import models as m

STATES = ("pending", "running", "succeeded", "failed", "cached", "skipped")
_MIGRATIONS = Path(__file__).parent / "migrations"


@dataclass(frozen=True)
class TokenRecord:
    name: str
    scopes: list[str]
    revoked: bool
    created_at: object


@dataclass(frozen=True)
class DeploymentRecord:
    name: str
    spec: DeploymentSpec
    state: str
    history: list
    created_at: object
    updated_at: object
    row_version: int = 0  # compare-and-swap counter: pass it back as save_deployment(expected_row_version=...)


def _redact(url: str) -> str:
    from raypai.credentials import redact_url  # the one redaction function for printed URLs

    return redact_url(url)


def migrate(engine, revision: str = "head") -> None:
    """Alembic upgrade to `revision`, serialised across processes (advisory lock on PostgreSQL)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(727274)"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


class MetadataStore:
    """All metadata reads and writes go through this object (no sessions leak out)."""

    def __init__(self, url: str, *, migrate_schema: bool = True):
        self.url = url
        kwargs: dict = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            path = url.split("///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"timeout": 60, "check_same_thread": False}
        else:
            kwargs["connect_args"] = {"connect_timeout": 10}
        self.engine = create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            if migrate_schema and current_revision(self.engine) != _head():
                migrate(self.engine)
        except OperationalError as exc:
            raise StoreError(
                f"cannot reach the metadata database {_redact(url)}: {str(exc.orig).strip().splitlines()[0]}. "
                "Start the database server or set RAYPAI_DATABASE_URL to a reachable one "
                "(embedded default: sqlite:///$RAYPAI_HOME/raypai.db)"
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def __getstate__(self):  # picklable for Ray: reconnect on the other side
        return {"url": self.url}

    def __setstate__(self, state):
        self.__init__(state["url"], migrate_schema=False)

    @contextmanager
    def session(self):
        with self._sessions() as s, s.begin():
            yield s

    # ---- pipelines and runs ------------------------------------------------------------------

    def create_run(
        self, pipeline: str, params: dict, *, source_file: str | None = None, origin_run_id: str | None = None
    ) -> str:
        run_id = uuid.uuid4().hex
        for _ in range(5):  # two drivers may create the same pipeline row at once
            try:
                with self.session() as s:
                    p = s.scalar(select(m.Pipeline).where(m.Pipeline.name == pipeline))
                    if p is None:
                        p = m.Pipeline(name=pipeline, source_file=source_file)
                        s.add(p)
                        s.flush()
                    elif source_file:
                        p.source_file = source_file
                    s.add(
                        m.PipelineRun(
                            id=run_id, pipeline_id=p.id, state="running", params=params, origin_run_id=origin_run_id
                        )
                    )
                return run_id
            except IntegrityError:
                continue
        raise StoreError(f"could not create a run of pipeline {pipeline!r}: concurrent writers kept conflicting")

    def update_run(self, run_id: str, **fields) -> None:
        with self.session() as s:
            run = s.get(m.PipelineRun, run_id)
            if run is None:
                raise NotFoundError(f"run {run_id} not found ({_recent_runs(s)}); list runs with `raypai runs`")
            for k, v in fields.items():
                setattr(run, k, v)
            if fields.get("state") in ("succeeded", "failed"):
                run.finished_at = m.utcnow()

    def get_run(self, run_id: str) -> dict:
        with self.session() as s:
            q = select(m.PipelineRun, m.Pipeline.name).join(m.Pipeline)
            row = s.execute(q.where(m.PipelineRun.id == run_id)).first()
            if row is None:
                row = s.execute(q.where(m.PipelineRun.id.like(f"{run_id}%"))).first()
            if row is None:
                raise NotFoundError(f"run {run_id!r} not found ({_recent_runs(s)}); list runs with `raypai runs`")
            return _run_dict(*row)

    def pipeline_source(self, pipeline: str) -> str | None:
        with self.session() as s:
            return s.scalar(select(m.Pipeline.source_file).where(m.Pipeline.name == pipeline))

    def list_runs(self, limit: int = 20, pipeline: str | None = None) -> list[dict]:
        with self.session() as s:
            q = select(m.PipelineRun, m.Pipeline.name).join(m.Pipeline)
            if pipeline:
                q = q.where(m.Pipeline.name == pipeline)
            q = q.order_by(m.PipelineRun.started_at.desc()).limit(limit)
            return [_run_dict(*r) for r in s.execute(q).all()]

    # ---- step runs -----------------------------------------------------------------------------

    def create_step_run(
        self,
        run_id: str,
        node: str,
        step_name: str,
        params: dict,
        cache_key: str | None,
        *,
        cache_components: dict | None = None,
        cache_reason: str | None = None,
    ) -> str:
        sid = uuid.uuid4().hex
        with self.session() as s:
            s.add(
                m.StepRun(
                    id=sid,
                    run_id=run_id,
                    node=node,
                    step_name=step_name,
                    params=params,
                    cache_key=cache_key,
                    cache_components=cache_components,
                    cache_reason=cache_reason,
                    state="pending",
                )
            )
            s.flush()
            s.add(m.StepRunEvent(step_run_id=sid, state="pending"))
        return sid

    def transition(self, step_run_id: str, state: str, *, detail: str | None = None, **fields) -> None:
        """Move a step run to `state`, recording the event and any fields (error, traceback, ...)."""
        if state not in STATES:
            raise StoreError(f"unknown step state {state!r}; one of {STATES}")
        with self.session() as s:
            sr = s.get(m.StepRun, step_run_id)
            if sr is None:
                raise NotFoundError(f"step run {step_run_id} not found; `raypai show RUN_ID` lists a run's step runs")
            sr.state = state
            now = m.utcnow()
            if state == "running":
                sr.started_at = now
            if state in ("succeeded", "failed", "cached", "skipped"):
                sr.finished_at = now
                sr.started_at = sr.started_at or now
            for k, v in fields.items():
                setattr(sr, k, v)
            s.add(m.StepRunEvent(step_run_id=step_run_id, state=state, at=now, detail=detail))

    def step_runs(self, run_id: str) -> list[dict]:
        with self.session() as s:
            rows = s.scalars(select(m.StepRun).where(m.StepRun.run_id == run_id).order_by(m.StepRun.started_at))
            return [_step_dict(r) for r in rows]

    def get_step_run(self, step_run_id: str) -> dict:
        with self.session() as s:
            r = s.get(m.StepRun, step_run_id)
            if r is None:
                raise NotFoundError(f"step run {step_run_id} not found; `raypai show RUN_ID` lists a run's step runs")
            return _step_dict(r)

    def step_events(self, step_run_id: str) -> list[tuple[str, object]]:
        with self.session() as s:
            q = select(m.StepRunEvent).where(m.StepRunEvent.step_run_id == step_run_id).order_by(m.StepRunEvent.id)
            return [(e.state, e.at) for e in s.scalars(q)]

    def find_cached(self, cache_key: str) -> dict | None:
        """Latest succeeded step run with this key: {'step_run': ..., 'outputs': {name: Artifact}}."""
        with self.session() as s:
            q = (
                select(m.StepRun)
                .where(m.StepRun.cache_key == cache_key, m.StepRun.state == "succeeded")
                .order_by(m.StepRun.finished_at.desc())
                .limit(1)
            )
            sr = s.scalar(q)
            if sr is None:
                return None
            return {"step_run": _step_dict(sr), "outputs": self._edges(s, m.StepOutput, sr.id)}

    def last_keyed_step_run(self, step_name: str, *, pipeline: str, node: str) -> dict | None:
        """The latest finished (succeeded or cached) run of step `step_name` that recorded its cache
        key's components, preferring the same node of the same pipeline: what a cache miss is
        explained against."""
        same = case((and_(m.Pipeline.name == pipeline, m.StepRun.node == node), 1), else_=0)
        with self.session() as s:
            q = (
                select(m.StepRun, m.Pipeline.name)
                .join(m.PipelineRun, m.PipelineRun.id == m.StepRun.run_id)
                .join(m.Pipeline)
                .where(
                    m.StepRun.step_name == step_name,
                    m.StepRun.state.in_(("succeeded", "cached")),
                    m.StepRun.cache_components.is_not(None),
                )
                .order_by(same.desc(), m.StepRun.finished_at.desc())
                .limit(1)
            )
            row = s.execute(q).first()
            return {**_step_dict(row[0]), "pipeline": row[1]} if row else None

    # ---- artifacts and edges -------------------------------------------------------------------

    def record_artifact(self, art: Artifact, producer_step_run_id: str | None = None) -> Artifact:
        with self.session() as s:
            s.add(
                m.ArtifactRow(
                    id=art.id,
                    kind=art.kind,
                    name=art.name,
                    uri=art.uri,
                    digest=art.digest,
                    size_bytes=art.size_bytes,
                    meta=art.metadata,
                    producer_step_run_id=producer_step_run_id or art.producer_step_run_id,
                )
            )
        return Artifact(**{**art.to_dict(), "producer_step_run_id": producer_step_run_id or art.producer_step_run_id})

    def add_edge(self, step_run_id: str, artifact_id: str, name: str, *, direction: str) -> None:
        table = {"input": m.StepInput, "output": m.StepOutput}[direction]
        with self.session() as s:
            if s.get(table, (step_run_id, artifact_id, name)) is None:
                s.add(table(step_run_id=step_run_id, artifact_id=artifact_id, name=name))

    def get_artifact(self, ref: str) -> Artifact:
        """By id, id prefix, digest prefix, or uri (newest first)."""
        with self.session() as s:
            row = s.get(m.ArtifactRow, ref)
            if row is None and "/" in ref:
                q = select(m.ArtifactRow).where(m.ArtifactRow.uri == ref.rstrip("/"))
                row = s.scalar(q.order_by(m.ArtifactRow.created_at.desc()).limit(1))
            if row is None and len(ref) >= 6:
                q = select(m.ArtifactRow).where(
                    (m.ArtifactRow.id.like(f"{ref}%")) | (m.ArtifactRow.digest.like(f"{ref}%"))
                )
                row = s.scalar(q.order_by(m.ArtifactRow.created_at.desc()).limit(1))
            if row is None:
                newest = s.scalars(select(m.ArtifactRow).order_by(m.ArtifactRow.created_at.desc()).limit(5)).all()
                known = ", ".join(f"{a.id[:12]} ({a.kind} {a.name})" for a in newest) or "the store holds none yet"
                raise NotFoundError(
                    f"artifact {ref!r} not found by id, id prefix, digest prefix or uri (newest: {known}); "
                    "list them with `raypai artifacts`"
                )
            return _artifact(row)

    def list_artifacts(self, kind: str | None = None, limit: int = 50) -> list[Artifact]:
        with self.session() as s:
            q = select(m.ArtifactRow)
            if kind:
                q = q.where(m.ArtifactRow.kind == kind)
            return [_artifact(r) for r in s.scalars(q.order_by(m.ArtifactRow.created_at.desc()).limit(limit))]

    def count_artifacts(self) -> int:
        with self.session() as s:
            return s.scalar(select(func.count()).select_from(m.ArtifactRow))

    def inputs_of(self, step_run_id: str) -> dict[str, Artifact]:
        with self.session() as s:
            return self._edges(s, m.StepInput, step_run_id)

    def outputs_of(self, step_run_id: str) -> dict[str, Artifact]:
        with self.session() as s:
            return self._edges(s, m.StepOutput, step_run_id)

    def consumers_of(self, artifact_id: str) -> list[str]:
        with self.session() as s:
            return list(s.scalars(select(m.StepInput.step_run_id).where(m.StepInput.artifact_id == artifact_id)))

    @staticmethod
    def _edges(s: Session, table, step_run_id: str) -> dict[str, Artifact]:
        q = select(table.name, m.ArtifactRow).join(m.ArtifactRow, m.ArtifactRow.id == table.artifact_id)
        return {name: _artifact(row) for name, row in s.execute(q.where(table.step_run_id == step_run_id)).all()}

    # ---- data-cleaning op stats ----------------------------------------------------------------

    def record_op_stats(self, step_run_id: str | None, artifact_id: str | None, rows: list[dict]) -> None:
        with self.session() as s:
            for i, r in enumerate(rows):
                known = {"op_name", "op_index", "rows_in", "rows_out", "dropped", "seconds"}
                s.add(
                    m.OpStat(
                        step_run_id=step_run_id,
                        artifact_id=artifact_id,
                        op_index=r.get("op_index", i),
                        op_name=r["op_name"],
                        rows_in=r["rows_in"],
                        rows_out=r["rows_out"],
                        dropped=r.get("dropped", r["rows_in"] - r["rows_out"]),
                        seconds=float(r.get("seconds", 0.0)),
                        extra={k: v for k, v in r.items() if k not in known},
                    )
                )

    def op_stats(self, *, step_run_id: str | None = None, artifact_id: str | None = None) -> list[dict]:
        with self.session() as s:
            q = select(m.OpStat)
            if step_run_id:
                q = q.where(m.OpStat.step_run_id == step_run_id)
            if artifact_id:
                q = q.where(m.OpStat.artifact_id == artifact_id)
            return [
                {
                    "op_index": r.op_index,
                    "op_name": r.op_name,
                    "rows_in": r.rows_in,
                    "rows_out": r.rows_out,
                    "dropped": r.dropped,
                    "seconds": r.seconds,
                    **r.extra,
                }
                for r in s.scalars(q.order_by(m.OpStat.op_index))
            ]

    # ---- API tokens (stored as sha256; the plaintext is shown once) ------------------------------

    def create_token(self, name: str, scopes: list[str]) -> str:
        token = "rp_" + secrets.token_urlsafe(32)
        try:
            with self.session() as s:
                s.add(m.ApiToken(name=name, token_hash=_sha(token), scopes=sorted(set(scopes))))
        except IntegrityError:
            raise StoreError(f"a token named {name!r} already exists; pick another name or revoke it first") from None
        return token

    def lookup_token(self, token: str) -> TokenRecord | None:
        with self.session() as s:
            row = s.scalar(select(m.ApiToken).where(m.ApiToken.token_hash == _sha(token)))
            if row is None:
                return None
            row.last_used_at = m.utcnow()
            return TokenRecord(row.name, list(row.scopes), row.revoked_at is not None, row.created_at)

    def list_tokens(self) -> list[TokenRecord]:
        with self.session() as s:
            return [
                TokenRecord(r.name, list(r.scopes), r.revoked_at is not None, r.created_at)
                for r in s.scalars(select(m.ApiToken).order_by(m.ApiToken.id))
            ]

    def revoke_token(self, name: str) -> None:
        with self.session() as s:
            row = s.scalar(select(m.ApiToken).where(m.ApiToken.name == name))
            if row is None:
                names = s.scalars(select(m.ApiToken.name).order_by(m.ApiToken.id)).all()
                raise NotFoundError(
                    f"no token named {name!r} (tokens: {', '.join(names) or 'none yet'}); see `raypai token list`"
                )
            row.revoked_at = m.utcnow()

    # ---- deployments (desired state: raypai.deployment.DeploymentSpec, stored as its JSON) ---------

    def create_deployment(self, name: str, spec: DeploymentSpec, state: str) -> DeploymentRecord:
        """Insert deployment `name`, or DeploymentConflict when it exists: the primary key decides, so
        of two concurrent creates exactly one succeeds."""
        data = _spec_data(name, spec)
        now = m.utcnow()
        try:
            with self.session() as s:
                row = m.Deployment(
                    name=name,
                    spec=data,
                    state=state,
                    history=[{"at": now.isoformat(), "state": state, "spec": data}],
                    created_at=now,
                    updated_at=now,
                    row_version=1,
                )
                s.add(row)
                s.flush()
                return _deployment(row)
        except IntegrityError:
            raise DeploymentConflict(
                f"deployment {name!r} already exists; change it with `raypai deploy update {name} ...` "
                "or delete it first"
            ) from None

    def save_deployment(
        self,
        name: str,
        spec: DeploymentSpec,
        state: str,
        *,
        expected_row_version: int | None = None,
        event: str | None = None,
    ) -> DeploymentRecord:
        """Write the desired state of `name` (created when missing and no version is expected).

        With `expected_row_version` (the `row_version` of the record the caller read) the write is a
        compare-and-swap: when another writer changed the deployment since, nothing is written and
        DeploymentConflict is raised, so the caller re-reads and decides again."""
        data = _spec_data(name, spec)
        for _ in range(20):  # an unconditional save retries the swap it lost; a conditional one raises
            with self.session() as s:
                row = s.get(m.Deployment, name)
                now = m.utcnow()
                entry = {"at": now.isoformat(), "state": state, "spec": data, **({"event": event} if event else {})}
                if row is None:
                    if expected_row_version is not None:
                        raise DeploymentConflict(f"deployment {name!r} was deleted while it was being changed")
                    row = m.Deployment(
                        name=name,
                        spec=data,
                        state=state,
                        history=[entry],
                        created_at=now,
                        updated_at=now,
                        row_version=1,
                    )
                    s.add(row)
                    s.flush()
                    return _deployment(row)
                if expected_row_version is not None and row.row_version != expected_row_version:
                    raise _changed(name, expected_row_version, row.row_version)
                done = self._swap(s, row, spec=data, state=state, history=[*row.history, entry][-50:], now=now)
                if done is not None:
                    return done
                if expected_row_version is not None:
                    raise _changed(name, expected_row_version, None)
        raise DeploymentConflict(f"deployment {name!r} keeps changing under this write; retry")

    @staticmethod
    def _swap(s: Session, row: m.Deployment, *, spec: dict, state: str, history: list, now) -> DeploymentRecord | None:
        """UPDATE ... WHERE row_version = <the value read>: None when another writer got there first
        (SQLite and PostgreSQL both evaluate the condition on the latest committed row)."""
        read = row.row_version
        n = s.execute(
            update(m.Deployment)
            .where(m.Deployment.name == row.name, m.Deployment.row_version == read)
            .values(spec=spec, state=state, history=history, updated_at=now, row_version=read + 1)
            .execution_options(synchronize_session=False)
        ).rowcount
        if n != 1:
            return None
        return DeploymentRecord(
            row.name, DeploymentSpec.from_dict(spec), state, list(history), row.created_at, now, read + 1
        )

    def record_canary_check(
        self,
        name: str,
        stable_version: int,
        canary_version: int,
        decision: str,
        reason: str,
        stats: dict,
        action: str = "none",
    ) -> dict:
        with self.session() as s:
            row = m.CanaryCheck(
                deployment=name,
                stable_version=stable_version,
                canary_version=canary_version,
                decision=decision,
                reason=reason,
                stats=stats,
                action=action,
            )
            s.add(row)
            s.flush()
            return _canary_check(row)

    def latest_canary_check(self, name: str, canary_version: int) -> dict | None:
        with self.session() as s:
            row = s.scalars(
                select(m.CanaryCheck)
                .where(m.CanaryCheck.deployment == name, m.CanaryCheck.canary_version == canary_version)
                .order_by(m.CanaryCheck.id.desc())
                .limit(1)
            ).first()
            return _canary_check(row) if row else None

    def rollback_canary(self, name: str, canary_version: int, reason: str) -> bool:
        """Take canary `canary_version` of `name` out of the desired state, if it is still the canary
        (a concurrent promote or rollback wins); True when this call did it. A compare-and-swap on
        `row_version`, like every deployment write: an update that read the state before this
        rollback cannot write the canary back."""
        for _ in range(20):
            with self.session() as s:
                q = select(m.Deployment).where(m.Deployment.name == name)
                if s.bind.dialect.name == "postgresql":
                    q = q.with_for_update()
                row = s.scalars(q).first()
                if row is None or DeploymentSpec.from_dict(row.spec).canary_version != canary_version:
                    return False
                spec = DeploymentSpec.from_dict(row.spec).with_canary(None).to_dict()
                now = m.utcnow()
                event = f"canary v{canary_version} rolled back automatically: {reason}"
                history = [*row.history, {"at": now.isoformat(), "state": row.state, "spec": spec, "event": event}]
                if self._swap(s, row, spec=spec, state=row.state, history=history[-50:], now=now) is not None:
                    return True
        return False

    def get_deployment(self, name: str) -> DeploymentRecord | None:
        with self.session() as s:
            row = s.get(m.Deployment, name)
            return _deployment(row) if row else None

    def list_deployments(self) -> list[DeploymentRecord]:
        with self.session() as s:
            return [_deployment(r) for r in s.scalars(select(m.Deployment).order_by(m.Deployment.name))]

    def delete_deployment(self, name: str) -> bool:
        with self.session() as s:
            row = s.get(m.Deployment, name)
            if row is None:
                return False
            s.delete(row)
            return True


def _head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers don't block the writer
    cur.execute("PRAGMA busy_timeout=60000")  # concurrent Ray tasks wait instead of failing
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _artifact(r: m.ArtifactRow) -> Artifact:
    return Artifact(r.id, r.kind, r.name, r.uri, r.digest, r.size_bytes, dict(r.meta or {}), r.producer_step_run_id)


def _canary_check(r: m.CanaryCheck) -> dict:
    return {
        c: getattr(r, c)
        for c in ("id", "deployment", "stable_version", "canary_version", "decision", "reason", "stats", "action", "at")
    }


def _recent_runs(s: Session, n: int = 5) -> str:
    """The newest runs, for a not-found message: "newest runs: 1a2b3c4d (toy, failed), …"."""
    rows = s.execute(
        select(m.PipelineRun.id, m.Pipeline.name, m.PipelineRun.state)
        .join(m.Pipeline)
        .order_by(m.PipelineRun.started_at.desc())
        .limit(n)
    ).all()
    if not rows:
        return "no runs are recorded yet"
    return "newest runs: " + ", ".join(f"{rid[:12]} ({name}, {state})" for rid, name, state in rows)


def _deployment(r: m.Deployment) -> DeploymentRecord:
    return DeploymentRecord(
        r.name, DeploymentSpec.from_dict(r.spec), r.state, list(r.history), r.created_at, r.updated_at, r.row_version
    )


def _spec_data(name: str, spec: DeploymentSpec) -> dict:
    if not isinstance(spec, DeploymentSpec):
        raise TypeError(
            f"save_deployment({name!r}) takes a raypai.deployment.DeploymentSpec, "
            f"got {type(spec).__name__}; build one with DeploymentSpec(model=..., version=...)"
        )
    return spec.to_dict()


def _changed(name: str, expected: int, found: int | None) -> DeploymentConflict:
    now = f" (now {found})" if found is not None else ""
    return DeploymentConflict(
        f"deployment {name!r} changed while this change was being made (version {expected} was read{now}); "
        "read it again (`raypai deploy get`) and retry"
    )


def _run_dict(r: m.PipelineRun, pipeline: str) -> dict:
    return {
        "id": r.id,
        "pipeline": pipeline,
        "state": r.state,
        "params": r.params,
        "origin_run_id": r.origin_run_id,
        "mlflow_run_id": r.mlflow_run_id,
        "ray_job_id": r.ray_job_id,
        "error": r.error,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
    }


def _step_dict(r: m.StepRun) -> dict:
    return {
        c: getattr(r, c)
        for c in (
            "id",
            "run_id",
            "node",
            "step_name",
            "state",
            "params",
            "cache_key",
            "cache_hit",
            "cached_from",
            "cache_components",
            "cache_reason",
            "attempt",
            "mlflow_run_id",
            "ray_task_id",
            "ray_node_id",
            "error",
            "traceback",
            "result",
            "metrics",
            "started_at",
            "finished_at",
        )
    }
