"""Metadata store (SQLAlchemy 2 + Alembic) and lineage queries."""

from raypai.store.metadata import DeploymentRecord, MetadataStore, TokenRecord, current_revision, migrate

__all__ = ["MetadataStore", "DeploymentRecord", "TokenRecord", "migrate", "current_revision"]
