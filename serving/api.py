"""The deploy API (control plane): `raypai server` on port 8080. OpenAPI docs at /docs.

    curl -H "Authorization: Bearer $TOKEN" -X POST localhost:8080/api/v1/deployments \
         -d '{"name": "tinychat", "model": "tinychat", "alias": "champion"}'
"""

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from raypai.errors import DeployError, DeploymentConflict, NotFoundError, StoreError
from raypai.serving import auth
from raypai.serving.control import Controller
from raypai.serving.errors import APIError, install
from raypai.serving.schemas import DeploymentCreate, DeploymentPatch
from raypai.settings import Settings


def _dump(model) -> dict | None:
    return None if model is None else model.model_dump()


def create_app(settings: Settings, controller: Controller | None = None, reconcile: bool = True) -> FastAPI:
    ctl = controller or Controller(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Desired state lives in the store; Serve may have lost applications (cluster restart).
        app.state.reconciled = await run_in_threadpool(ctl.reconcile) if reconcile else []
        yield

    app = FastAPI(
        title="raypai deploy API",
        version="1",
        lifespan=lifespan,
        description="Deploy registered models on Ray Serve; canary, promote, rollback.",
    )
    install(app)

    check = auth.TokenCheck(ctl.store, ttl_s=0.0)  # control plane: a revoked token stops at once

    def require_deploy(request: Request) -> str:
        return check(request, "deploy")

    async def call(fn, *args, **kwargs):
        try:
            return await run_in_threadpool(fn, *args, **kwargs)
        except NotFoundError as exc:
            raise APIError(404, str(exc), code="not_found") from None
        except DeploymentConflict as exc:
            raise APIError(409, str(exc), code="conflict") from None
        except DeployError as exc:
            raise APIError(400, str(exc), code="deploy_error") from None
        except StoreError:  # (a DBAPIError is answered the same way by raypai.serving.errors)
            raise APIError(
                503, "the metadata database is unavailable; retry shortly", code="database_unavailable"
            ) from None

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post("/api/v1/deployments", status_code=201, dependencies=[Depends(require_deploy)])
    async def create(body: DeploymentCreate):
        return await call(
            ctl.create,
            body.name,
            body.model,
            body.version,
            body.alias,
            replicas=body.replicas,
            autoscaling=_dump(body.autoscaling),
            cpus=body.cpus,
            gpus=body.gpus,
            max_batch_size=body.max_batch_size,
            batch_wait_timeout_s=body.batch_wait_timeout_s,
            max_kv_cells=body.max_kv_cells,
            max_ongoing_requests=body.max_ongoing_requests,
            max_queued_requests=body.max_queued_requests,
            request_timeout_s=body.request_timeout_s,
            drain_timeout_s=body.drain_timeout_s,
            engine=body.engine,
        )

    @app.get("/api/v1/deployments", dependencies=[Depends(require_deploy)])
    async def list_deployments():
        return {"data": await call(ctl.list)}

    @app.get("/api/v1/deployments/{name}", dependencies=[Depends(require_deploy)])
    async def get(name: str):
        return await call(ctl.describe, name)

    @app.patch("/api/v1/deployments/{name}", dependencies=[Depends(require_deploy)])
    async def patch(name: str, body: DeploymentPatch):
        return await call(ctl.update, name, **{**body.model_dump(), "autoscaling": _dump(body.autoscaling)})

    @app.post("/api/v1/deployments/{name}/rollback", dependencies=[Depends(require_deploy)])
    async def rollback(name: str):
        return await call(ctl.rollback, name)

    @app.delete("/api/v1/deployments/{name}", status_code=204, dependencies=[Depends(require_deploy)])
    async def delete(name: str):
        await call(ctl.delete, name)

    from raypai.lineage.api import lineage_router

    app.include_router(lineage_router(settings, ctl.store, dependencies=[Depends(require_deploy)]))
    return app
