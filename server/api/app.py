"""The FastAPI application: routers under /v1, domain errors mapped to HTTP, and start/stop hooks."""

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import OperationalError

from server.api.deps import require_token
from server.api.guards import BodyLimit, HostAllowList, SameOriginWrites, SecurityHeaders
from server.api.routes import hosts, metrics, runs
from server.config import API_THREADS, Settings
from server.db import Database
from server.errors import Conflict, FieldError, NotFound, Unavailable
from server.web import WEB_DIR


def create_app(db: Database, settings: Settings, on_startup: Callable[[], None] | None = None,
               on_shutdown: Callable[[], None] | None = None, bind_host: str | None = None) -> FastAPI:
    """The API over `db`; the hooks run when it starts and stops serving (`longrun serve` embeds the worker so).

    It answers only to the Host names of settings.host_allow_list(bind_host), refuses bodies above
    settings.max_body_bytes and state-changing requests from pages of other origins, sends the security headers
    with every answer, and with a token set guards /docs and /openapi.json like every route but /healthz."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # the database pool holds a connection for each of these threads (server/db.py POOL_SIZE)
        anyio.to_thread.current_default_thread_limiter().total_tokens = API_THREADS
        if on_startup:
            on_startup()
        yield
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="longrun", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  description="Run long GPU training jobs on remote machines and keep them under control.")
    app.state.db, app.state.settings = db, settings
    app.state.write_line = asyncio.Lock()  # server/api/deps.py write_line
    app.add_middleware(SameOriginWrites)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(HostAllowList, allowed=settings.host_allow_list(bind_host))
    app.add_middleware(SecurityHeaders)  # outermost: on the guards' refusals too

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "status": exc.status}, status_code=409)

    @app.exception_handler(FieldError)
    async def _field_error(_: Request, exc: FieldError) -> JSONResponse:
        # the same body as FastAPI's own validation errors: each field's path starts at the request body, or at
        # the query string for a query parameter's
        errors = [{**e, "loc": e["loc"] if e["loc"][:1] == ("query",) else ("body", *e["loc"])} for e in exc.errors]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(OperationalError)
    async def _store_failed(_: Request, exc: OperationalError) -> JSONResponse:
        # the database refused (a full disk, an I/O error): the server's trouble, said as such, never a bare 500
        failure = db.write_failure if db is not None else None
        detail = failure.error if failure else str(exc.orig or exc).splitlines()[0][:500]
        return JSONResponse({"detail": f"the server's database failed: {detail}; try again once it has room"},
                            status_code=503)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """`ok`, or `degraded` with the last write the database refused (until a write goes through again)."""
        failure = db.write_failure if db is not None else None
        if failure is None:
            return {"status": "ok"}
        return {"status": "degraded", "last_write_error": failure.error, "failing_since": failure.since.isoformat()}

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_token)])
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(require_token)])
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="longrun API")

    for router in (hosts.router, runs.router):
        app.include_router(router, prefix="/v1", dependencies=[Depends(require_token)])
    app.include_router(metrics.router, dependencies=[Depends(require_token)])

    # the page and its files hold no data, so they need no token; every call they make does
    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
    return app
