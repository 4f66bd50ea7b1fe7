"""Dependencies: the database sessions and bearer-token auth, with failed authentications throttled per client
address (`AuthThrottle`).

A request holds a database connection only while a thread runs its route, never while it waits for one: a read
session is opened and closed on the event loop (it takes its connection at its first query, in the route's
thread, and closing it is no I/O to speak of), and a request that writes waits for its turn among the API's
writers on the event loop (`write_line`), holding neither a thread nor a connection. So 100 clients at once
cannot take every thread waiting for a connection or the write lock that a thread-less request holds.
"""

import asyncio
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
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
log = logging.getLogger("longrun.api")

# an address that fails to authenticate this many times within the window is answered 429 until the oldest of
# those failures is older than the window (fail2ban's maxretry and findtime; nginx's limit_req answers with 429)
AUTH_FAILURES, AUTH_WINDOW_SECONDS = 10, 60.0
# addresses remembered at once (the least recent forgotten first), and the least time between two log lines
AUTH_ADDRESSES, AUTH_LOG_EVERY_SECONDS = 10_000, 10.0


class AuthThrottle:
    """Failed authentications per client address: after `limit` of them within `window` seconds a request from
    that address with a missing or wrong token is refused (429, Retry-After) until the oldest of them has aged out;
    a refused request adds no failure, so a throttle lasts at most `window`. A right token is never refused: the
    address is the TCP peer (or what a named proxy says), which clients behind one proxy or on one machine share,
    and one of them guessing must not lock the others out; what keeps a guesser out is the token's length, the
    throttle what keeps its flood from filling the log. Failures are logged at most once every `log_every`
    seconds, a line counting the ones in between."""

    def __init__(self, limit: int = AUTH_FAILURES, window: float = AUTH_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic, max_addresses: int = AUTH_ADDRESSES,
                 log_every: float = AUTH_LOG_EVERY_SECONDS):
        self.limit, self.window, self.clock = limit, window, clock
        self.max_addresses, self.log_every = max_addresses, log_every
        self._lock = threading.Lock()
        # address -> the monotonic times of its last `limit` failures, least recently failing first
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._last_line = -math.inf
        self._unlogged = {"failed": 0, "throttled": 0}
        self._unlogged_from: set[str] = set()

    def retry_after(self, address: str) -> float | None:
        """Seconds until `address` may try again, or None when it is not throttled; counts a throttled request."""
        with self._lock:
            now, times = self.clock(), self._failures.get(address)
            if times is None or len(times) < self.limit or times[0] + self.window <= now:
                return None
            self._note(address, "throttled", now)
            return times[0] + self.window - now

    def failed(self, address: str) -> None:
        with self._lock:
            now = self.clock()
            times = self._failures.pop(address, None) or deque(maxlen=self.limit)
            times.append(now)
            self._failures[address] = times
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)
            self._note(address, "failed", now)

    def _note(self, address: str, what: str, now: float) -> None:
        self._unlogged[what] += 1
        if len(self._unlogged_from) < 100:
            self._unlogged_from.add(address)
        if now - self._last_line < self.log_every:
            return
        throttled = sum(1 for t in self._failures.values()
                        if len(t) >= self.limit and t[0] + self.window > now)
        addresses = sorted(self._unlogged_from)
        log.warning("%d failed authentication(s) and %d request(s) refused while throttled, from %s%s; "
                    "%d address(es) throttled (%d failures in %.0fs: 429 until they age out)",
                    self._unlogged["failed"], self._unlogged["throttled"], ", ".join(addresses[:5]),
                    f" and {len(addresses) - 5} more" if len(addresses) > 5 else "", throttled, self.limit,
                    self.window)
        self._last_line, self._unlogged, self._unlogged_from = now, {"failed": 0, "throttled": 0}, set()


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


async def require_token(request: Request, settings: Annotated[Settings, Depends(get_settings)],
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    if not settings.api_token:
        return
    if credentials is not None and secrets.compare_digest(credentials.credentials.encode(),
                                                          settings.api_token.encode()):
        return  # a right token is never throttled: another client's failures from its address cannot lock it out
    throttle: AuthThrottle = request.app.state.auth_throttle
    # the TCP peer, or what a proxy named in LONGRUN_FORWARDED_ALLOW_IPS said (longrun/processes.py): never a
    # client's own X-Forwarded-For
    address = request.client.host if request.client else "unknown"
    if (wait := throttle.retry_after(address)) is not None:
        seconds = max(1, math.ceil(wait))
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                            f"too many failed authentications from {address} ({throttle.limit} within "
                            f"{throttle.window:.0f}s): try again in {seconds}s", headers={"Retry-After": str(seconds)})
    throttle.failed(address)
    raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token (LONGRUN_API_TOKEN)",
                        headers={"WWW-Authenticate": "Bearer"})


ReadSession = Annotated[Session, Depends(reading)]
# "function" scope: the commit happens before the response goes out, so a client that has its 201 sees the write
WriteSession = Annotated[Session, Depends(writing, scope="function")]
DB = Annotated[Database, Depends(get_db)]
