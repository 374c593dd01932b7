"""core tables: pipelines, runs, step runs, artifacts, edges

Revision ID: 0001
Revises:
Create Date: 2026-11-22 12:19:53.151848
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "pipelines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source_file", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "pipeline_runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("pipeline_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("origin_run_id", sa.String(length=32), nullable=True),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("ray_job_id", sa.String(length=64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["pipeline_id"],
            ["pipelines.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("pipeline_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_pipeline_runs_pipeline_id"), ["pipeline_id"], unique=False)

    op.create_table(
        "step_runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=False),
        sa.Column("step_name", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("cache_key", sa.String(length=64), nullable=True),
        sa.Column("cache_hit", sa.Boolean(), nullable=False),
        sa.Column("cached_from", sa.String(length=32), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("ray_task_id", sa.String(length=64), nullable=True),
        sa.Column("ray_node_id", sa.String(length=64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["pipeline_runs.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "node", name="uq_step_runs_run_node"),
    )
    with op.batch_alter_table("step_runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_step_runs_cache_key"), ["cache_key"], unique=False)
        batch_op.create_index("ix_step_runs_cache_state", ["cache_key", "state"], unique=False)
        batch_op.create_index(batch_op.f("ix_step_runs_run_id"), ["run_id"], unique=False)

    op.create_table(
        "artifacts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("producer_step_run_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["producer_step_run_id"],
            ["step_runs.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_artifacts_digest"), ["digest"], unique=False)
        batch_op.create_index(batch_op.f("ix_artifacts_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_artifacts_producer_step_run_id"), ["producer_step_run_id"], unique=False)

    op.create_table(
        "step_run_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("step_run_id", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["step_run_id"],
            ["step_runs.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("step_run_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_step_run_events_step_run_id"), ["step_run_id"], unique=False)

    op.create_table(
        "step_inputs",
        sa.Column("step_run_id", sa.String(length=32), nullable=False),
        sa.Column("artifact_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"],
            ["artifacts.id"],
        ),
        sa.ForeignKeyConstraint(
            ["step_run_id"],
            ["step_runs.id"],
        ),
        sa.PrimaryKeyConstraint("step_run_id", "artifact_id", "name"),
    )
    with op.batch_alter_table("step_inputs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_step_inputs_artifact_id"), ["artifact_id"], unique=False)

    op.create_table(
        "step_outputs",
        sa.Column("step_run_id", sa.String(length=32), nullable=False),
        sa.Column("artifact_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(
            ["artifact_id"],
            ["artifacts.id"],
        ),
        sa.ForeignKeyConstraint(
            ["step_run_id"],
            ["step_runs.id"],
        ),
        sa.PrimaryKeyConstraint("step_run_id", "artifact_id", "name"),
    )
    with op.batch_alter_table("step_outputs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_step_outputs_artifact_id"), ["artifact_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("step_outputs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_step_outputs_artifact_id"))

    op.drop_table("step_outputs")
    with op.batch_alter_table("step_inputs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_step_inputs_artifact_id"))

    op.drop_table("step_inputs")
    with op.batch_alter_table("step_run_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_step_run_events_step_run_id"))

    op.drop_table("step_run_events")
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_artifacts_producer_step_run_id"))
        batch_op.drop_index(batch_op.f("ix_artifacts_kind"))
        batch_op.drop_index(batch_op.f("ix_artifacts_digest"))

    op.drop_table("artifacts")
    with op.batch_alter_table("step_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_step_runs_run_id"))
        batch_op.drop_index("ix_step_runs_cache_state")
        batch_op.drop_index(batch_op.f("ix_step_runs_cache_key"))

    op.drop_table("step_runs")
    with op.batch_alter_table("pipeline_runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pipeline_runs_pipeline_id"))

    op.drop_table("pipeline_runs")
    op.drop_table("pipelines")
