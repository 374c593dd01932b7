"""deployments.row_version: the compare-and-swap counter of a deployment's desired state

Every write of a deployment (the control plane's update/rollback, the router's automatic canary
rollback) sets `row_version = row_version + 1 WHERE row_version = <the value it read>`; a writer that
read an older state changes no row and retries on the new one (raypai.serving.control), so a
rolled-back canary is never written back by an update that started before the rollback.

Revision ID: 0005_deployment_row_version
Revises: 0004_canary_checks
Create Date: 2026-11-29 03:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_deployment_row_version"
down_revision = "0004_canary_checks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("row_version", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("row_version")
