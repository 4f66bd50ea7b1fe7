"""The FastAPI application: routers under /v1, domain errors mapped to HTTP, and start/stop hooks."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DataError, OperationalError

from server.api.deps import AuthThrottle, require_token
from server.api.guards import BodyLimit, HostAllowList, NoNul, SameOriginWrites, SecurityHeaders
from server.api.routes import hosts, metrics, runs
from server.config import API_THREADS, Settings
from server.db import Database
from server.errors import Conflict, FieldError, NotFound, Unavailable
from server.web import WEB_DIR

log = logging.getLogger("longrun.api")


def _encodable(value: Any) -> Any:
    """`value` (JSON-ready) with every string UTF-8 can encode: a lone surrogate (JSON's "\\ud800") written as its
    escape, so that a field's path or message naming one still goes out."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    return value


def _echoable(value: Any) -> bool:
    """Whether `value` goes into an answer as it came: every string in it encodes as UTF-8."""
    return _encodable(value) == value


def validation_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """A 422's `detail`, FastAPI's shape (`type`, `loc`, `msg`, `input`, `ctx`), that always encodes: an input that
    does not (a lone surrogate) is left out rather than echoed, and a path or message naming one is escaped."""
    out = []
    for error in jsonable_encoder(list(errors)):
        if "input" in error and not _echoable(error["input"]):
            error = {k: v for k, v in error.items() if k != "input"}
        out.append(_encodable(error))
    return out


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
    app.state.auth_throttle = AuthThrottle()  # server/api/deps.py require_token
    app.add_middleware(NoNul)
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
        return JSONResponse({"detail": validation_errors(errors)}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes each input, and a lone surrogate in one failed to encode: a 500
        return JSONResponse({"detail": validation_errors(exc.errors())}, status_code=422)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(DataError)
    async def _value_refused(request: Request, exc: DataError) -> JSONResponse:
        # a value of the request the database cannot hold (an integer beyond its column, on PostgreSQL): the
        # caller's to change, never a bare 500; a route's own bounds name the field before it gets here
        why = str(exc.orig or exc).splitlines()[0][:200]
        log.warning("%s %s: the database refused a value of the request: %s", request.method, request.url.path, why)
        return JSONResponse({"detail": f"the database cannot hold a value of this request: {why}"}, status_code=422)

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
