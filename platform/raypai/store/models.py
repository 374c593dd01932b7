"""SQLAlchemy 2 schema of the metadata store, modelled on OpenLineage/Marquez:
pipeline = job, pipeline run / step run = run, artifact = dataset version, input/output edges."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict: JSON, list: JSON}


class Pipeline(Base):
    __tablename__ = "pipelines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    source_file: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class PipelineRun(Base):
    __tablename__ = "pipeline_runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    params: Mapped[dict] = mapped_column(JSON, default=dict)
    origin_run_id: Mapped[str | None] = mapped_column(String(32))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    ray_job_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StepRun(Base):
    __tablename__ = "step_runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("pipeline_runs.id"), index=True)
    node: Mapped[str] = mapped_column(String(200))  # the call's name in the DAG, e.g. "clean" or "clean_2"
    step_name: Mapped[str] = mapped_column(String(200))  # module:function identity
    state: Mapped[str] = mapped_column(String(16), default="pending")
    params: Mapped[dict] = mapped_column(JSON, default=dict)
    cache_key: Mapped[str | None] = mapped_column(String(64), index=True)
    cache_hit: Mapped[bool] = mapped_column(Boolean, default=False)
    cached_from: Mapped[str | None] = mapped_column(String(32))
    # what the cache key was made of (raypai.cachekey) and why the step was or was not a hit
    cache_components: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))
    cache_reason: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    ray_task_id: Mapped[str | None] = mapped_column(String(64))
    ray_node_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict | None] = mapped_column(JSON)  # JSON-able return value / output names
    metrics: Mapped[dict] = mapped_column(JSON, default=dict)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (UniqueConstraint("run_id", "node", name="uq_step_runs_run_node"),)


class StepRunEvent(Base):
    """Every state transition of a step run, in order (OpenLineage START/COMPLETE/FAIL events)."""

    __tablename__ = "step_run_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    step_run_id: Mapped[str] = mapped_column(ForeignKey("step_runs.id"), index=True)
    state: Mapped[str] = mapped_column(String(16))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    detail: Mapped[str | None] = mapped_column(Text)


class ArtifactRow(Base):
    __tablename__ = "artifacts"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    name: Mapped[str] = mapped_column(String(200))
    uri: Mapped[str] = mapped_column(Text)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    producer_step_run_id: Mapped[str | None] = mapped_column(ForeignKey("step_runs.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StepInput(Base):
    __tablename__ = "step_inputs"
    step_run_id: Mapped[str] = mapped_column(ForeignKey("step_runs.id"), primary_key=True)
    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id"), primary_key=True, index=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)


class StepOutput(Base):
    __tablename__ = "step_outputs"
    step_run_id: Mapped[str] = mapped_column(ForeignKey("step_runs.id"), primary_key=True)
    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id"), primary_key=True, index=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)


# ---- revision 0002: data-cleaning op stats, deployments, API tokens -------------------------------


class OpStat(Base):
    __tablename__ = "op_stats"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    step_run_id: Mapped[str | None] = mapped_column(String(32), index=True)
    artifact_id: Mapped[str | None] = mapped_column(String(32), index=True)
    op_index: Mapped[int] = mapped_column(Integer)
    op_name: Mapped[str] = mapped_column(String(200))
    rows_in: Mapped[int] = mapped_column(BigInteger)
    rows_out: Mapped[int] = mapped_column(BigInteger)
    dropped: Mapped[int] = mapped_column(BigInteger)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    extra: Mapped[dict] = mapped_column(JSON, default=dict)


class Deployment(Base):
    __tablename__ = "deployments"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    spec: Mapped[dict] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(32), default="pending")
    history: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # compare-and-swap counter: every write sets it to +1 where it still holds the value read
    # (migration 0005; MetadataStore.save_deployment(expected_row_version=...))
    row_version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class CanaryCheck(Base):
    """One verdict of the router on a canary (raypai.serving.canary): the measured traffic of both
    versions, the decision, and what was done about it."""

    __tablename__ = "canary_checks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(String(200), index=True)
    stable_version: Mapped[int] = mapped_column(Integer)
    canary_version: Mapped[int] = mapped_column(Integer)
    decision: Mapped[str] = mapped_column(String(32))  # healthy | worse | insufficient
    reason: Mapped[str] = mapped_column(Text)
    stats: Mapped[dict] = mapped_column(JSON, default=dict)  # {"stable": {...}, "canary": {...}, "policy": {...}}
    action: Mapped[str] = mapped_column(String(32), default="none")  # none | rolled_back
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


Index("ix_step_runs_cache_state", StepRun.cache_key, StepRun.state)
