"""step runs: the cache key's components and the reason for a cache hit or miss

Revision ID: 0003_cache_components
Revises: 0002
Create Date: 2026-11-24 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_cache_components"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable: step runs recorded before this revision have no components (shown as such)
    with op.batch_alter_table("step_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cache_components", sa.JSON(none_as_null=True), nullable=True))
        batch_op.add_column(sa.Column("cache_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_runs", schema=None) as batch_op:
        batch_op.drop_column("cache_reason")
        batch_op.drop_column("cache_components")
