"""Dependencies: the database sessions and bearer-token auth.

A request holds a database connection only while a thread runs its route, never while it waits for one: a read
session is opened and closed on the event loop (it takes its connection at its first query, in the route's
thread, and closing it is no I/O to speak of), and a request that writes waits for its turn among the API's
writers on the event loop (`write_line`), holding neither a thread nor a connection. So 100 clients at once
cannot take every thread waiting for a connection or the write lock that a thread-less request holds.
"""

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.concurrency import contextmanager_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from server.config import Settings
from server.db import WRITE_WAIT_SECONDS, Database
from server.errors import Unavailable

bearer = HTTPBearer(auto_error=False)


# the dependencies that do no I/O are coroutines: FastAPI runs a plain function in its thread pool, a hop per call
async def get_db(request: Request) -> Database:
    return request.app.state.db


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def reading(db: Annotated[Database, Depends(get_db)]) -> AsyncIterator[Session]:
    with db.reading() as session:
        yield session


@asynccontextmanager
async def write_line(app: FastAPI) -> AsyncIterator[None]:
    """The API's writers one at a time, waiting on the event loop (503 past WRITE_WAIT_SECONDS)."""
    line: asyncio.Lock = app.state.write_line
    try:
        await asyncio.wait_for(line.acquire(), WRITE_WAIT_SECONDS)
    except TimeoutError:
        raise Unavailable(f"the database is busy: no turn to write within {WRITE_WAIT_SECONDS:.0f}s; "
                          "try again") from None
    try:
        yield
    finally:
        line.release()


async def writing(request: Request, db: Annotated[Database, Depends(get_db)]) -> AsyncIterator[Session]:
    async with write_line(request.app), contextmanager_in_threadpool(db.writing()) as session:
        yield session


async def require_token(settings: Annotated[Settings, Depends(get_settings)],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    if not settings.api_token:
        return
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), settings.api_token.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token (LONGRUN_API_TOKEN)",
                            headers={"WWW-Authenticate": "Bearer"})


ReadSession = Annotated[Session, Depends(reading)]
# "function" scope: the commit happens before the response goes out, so a client that has its 201 sees the write
WriteSession = Annotated[Session, Depends(writing, scope="function")]
DB = Annotated[Database, Depends(get_db)]
