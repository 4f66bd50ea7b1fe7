"""The FastAPI application: routers under /v1, error mapping, and the embedded worker's lifecycle."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from server.api.deps import require_token
from server.api.routes import hosts, runs
from server.config import Settings
from server.db import Database
from server.runs import Conflict, NotFound


def create_app(db: Database, settings: Settings, on_startup=None, on_shutdown=None) -> FastAPI:  # noqa: ANN001
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_startup:
            on_startup()
        yield
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="longrun", version="1", lifespan=lifespan,
                  description="Run long GPU training jobs on remote machines and keep them under control.")
    app.state.db, app.state.settings = db, settings

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "status": exc.status}, status_code=409)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    for router in (hosts.router, runs.router):
        app.include_router(router, prefix="/v1", dependencies=[Depends(require_token)])
    return app
