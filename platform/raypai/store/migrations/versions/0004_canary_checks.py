"""canary checks: the router's measured verdicts on canary versions

Revision ID: 0004_canary_checks
Revises: 0003_cache_components
Create Date: 2026-11-24 19:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_canary_checks"
down_revision = "0003_cache_components"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "canary_checks",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", sa.String(length=200), nullable=False),
        sa.Column("stable_version", sa.Integer(), nullable=False),
        sa.Column("canary_version", sa.Integer(), nullable=False),
        sa.Column("decision", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("canary_checks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_canary_checks_deployment"), ["deployment"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("canary_checks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_canary_checks_deployment"))
    op.drop_table("canary_checks")
