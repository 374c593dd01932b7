"""op stats, deployments, api tokens

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 12:19:53.196699
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_table(
        "deployments",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "op_stats",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("step_run_id", sa.String(length=32), nullable=True),
        sa.Column("artifact_id", sa.String(length=32), nullable=True),
        sa.Column("op_index", sa.Integer(), nullable=False),
        sa.Column("op_name", sa.String(length=200), nullable=False),
        sa.Column("rows_in", sa.BigInteger(), nullable=False),
        sa.Column("rows_out", sa.BigInteger(), nullable=False),
        sa.Column("dropped", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("op_stats", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_op_stats_artifact_id"), ["artifact_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_op_stats_step_run_id"), ["step_run_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("op_stats", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_op_stats_step_run_id"))
        batch_op.drop_index(batch_op.f("ix_op_stats_artifact_id"))

    op.drop_table("op_stats")
    op.drop_table("deployments")
    op.drop_table("api_tokens")
