"""Dependencies: the database sessions and bearer-token auth."""

import secrets
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from server.config import Settings
from server.db import Database

bearer = HTTPBearer(auto_error=False)


# the dependencies that do no I/O are coroutines: FastAPI runs a plain function in its thread pool, a hop per call
async def get_db(request: Request) -> Database:
    return request.app.state.db


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def reading(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.reading() as session:
        yield session


def writing(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.writing() as session:
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
