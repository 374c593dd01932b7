"""Lineage over HTTP, mounted by the deploy API server.

GET /api/v1/lineage/artifacts/{artifact_id}?down=false
GET /api/v1/lineage/deployments/{name}
GET /api/v1/runs/{run_id}/openlineage
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from raypai.errors import NotFoundError
from raypai.lineage import downstream, openlineage_events, upstream
from raypai.lineage.deploy import deployment_lineage
from raypai.settings import Settings
from raypai.store import MetadataStore


def lineage_router(settings: Settings, store: MetadataStore, dependencies: list | None = None) -> APIRouter:
    router = APIRouter(prefix="/api/v1", tags=["lineage"], dependencies=dependencies or [])

    @router.get("/lineage/artifacts/{artifact_id}")
    def artifact_lineage(artifact_id: str, down: bool = False) -> dict:
        try:
            return (downstream if down else upstream)(store, artifact_id)
        except NotFoundError as exc:
            raise HTTPException(404, str(exc)) from None

    @router.get("/lineage/deployments/{name}")
    def deployment(name: str) -> dict:
        try:
            return deployment_lineage(store, settings, name)
        except NotFoundError as exc:
            raise HTTPException(404, str(exc)) from None

    @router.get("/runs/{run_id}/openlineage")
    def run_events(run_id: str) -> list[dict]:
        try:
            return openlineage_events(store, run_id)
        except NotFoundError as exc:
            raise HTTPException(404, str(exc)) from None

    return router
