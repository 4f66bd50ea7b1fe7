"""One feed per followed run: what the event streams of its followers (`GET /v1/runs/{id}/events`) read from.

A feed reads the run's new events from the database once per poll interval, however many follow it, and hands
them to every follower that has caught up; a follower behind what the feed holds (a new stream replaying the run
from its start, a Last-Event-ID from long ago) reads from the database itself until it has caught up. Before, each
stream polled the database on the thread pool every 0.5 s: 500 streams on one run took the pool from every other
request (GET run p50 2.2 s). Events commit in id order on both stores (server/db.py), so reading on after the
newest id seen misses none. A feed lives on the event loop of the API, for as long as somebody follows its run.
"""

import asyncio
import json
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from server.db import Database
from server.errors import NotFound
from server.lifecycle import TERMINAL
from server.models import Event, Run
from server.schemas import without_env_values

log = logging.getLogger("longrun.api")

POLL_SECONDS = 0.5
# the newest events a feed holds for followers that are a little behind
KEPT = 1000
# how many events one read takes
READ = 500
GONE = "gone"  # the run was deleted while followed: its streams end


@dataclass(frozen=True)
class FeedEvent:
    """An event as a stream sends it, its payload serialised once for every follower."""

    id: int
    kind: str
    data: str


def feed_event(e: Event) -> FeedEvent:
    payload: dict[str, Any] = {"time": e.time.isoformat(), **e.data}
    if isinstance(payload.get("overrides"), dict):
        # events stored before env values were redacted at the source
        payload["overrides"] = without_env_values(payload["overrides"])
    return FeedEvent(e.id, e.kind, json.dumps(payload))


def read_events(db: Database, run_id: str, after: int) -> tuple[list[FeedEvent], str]:
    """The run's events after `after` (at most READ), oldest first, and its status in the same snapshot."""
    with db.reading() as s:
        status = s.scalar(select(Run.status).where(Run.id == run_id))
        if status is None:
            return [], GONE
        events = s.scalars(select(Event).where(Event.run_id == run_id, Event.id > after).order_by(Event.id)
                           .limit(READ))
        return [feed_event(e) for e in events], status


def newest_event(db: Database, run_id: str) -> tuple[int, str]:
    """The id of the run's newest event (0: none) and its status: where a new feed starts, reading no event."""
    with db.reading() as s:
        status = s.scalar(select(Run.status).where(Run.id == run_id))
        if status is None:
            raise NotFound(f"no run with id {run_id!r}")
        return s.scalar(select(func.max(Event.id)).where(Event.run_id == run_id)) or 0, status


async def _tick() -> None:
    await asyncio.sleep(POLL_SECONDS)


class RunFeed:
    def __init__(self, db: Database, run_id: str, on_idle: Callable[["RunFeed"], None]):
        self.db, self.run_id, self._on_idle = db, run_id, on_idle
        self.followers = 0
        self.polls = 0  # database reads of the feed's own (tests count them)
        # `kept` holds every event with an id in (base, head]
        self.base = self.head = 0
        self.status = ""
        self.kept: deque[FeedEvent] = deque()
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.tick: Callable[[], Awaitable[None]] = _tick

    async def follow(self, after: int) -> AsyncIterator[FeedEvent]:
        """The run's events after `after`, as they are stored, until the run has ended and every one is sent."""
        self.followers += 1
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name=f"feed {self.run_id}")
        try:
            await self._ready.wait()
            while True:
                if after >= self.base:
                    new = [e for e in self.kept if e.id > after]
                    if not new:
                        if self.status in TERMINAL or self.status == GONE:
                            return
                        await self._changed.wait()
                        continue
                else:  # behind what the feed holds: catch up from the database
                    new, _ = await run_in_threadpool(read_events, self.db, self.run_id, after)
                    if not new:  # those between were dropped meanwhile (a run keeps its newest metrics events)
                        after = self.base
                        continue
                for e in new:
                    yield e
                after = new[-1].id
        finally:
            self.followers -= 1
            if not self.followers:
                if self._task is not None:
                    self._task.cancel()
                self._on_idle(self)

    async def _poll(self) -> None:
        while True:
            try:
                self.head, self.status = await run_in_threadpool(newest_event, self.db, self.run_id)
                break
            except NotFound:
                self.status = GONE
                break
            except Exception:  # the database away for a moment: the followers wait for the next interval's try
                log.warning("the event feed of run %s could not read the database", self.run_id, exc_info=True)
                await self.tick()
        self.base = self.head
        self._ready.set()
        while True:
            await self.tick()
            while True:
                try:
                    events, status = await run_in_threadpool(read_events, self.db, self.run_id, self.head)
                except Exception:  # the database away for a moment: the next interval tries again
                    log.warning("the event feed of run %s could not read the database", self.run_id, exc_info=True)
                    break
                finally:
                    self.polls += 1
                changed = bool(events) or status != self.status
                self.status = status
                if events:
                    self.kept.extend(events)
                    self.head = events[-1].id
                    while len(self.kept) > KEPT:
                        self.base = self.kept.popleft().id
                if changed:
                    self._changed.set()
                    self._changed = asyncio.Event()
                if len(events) < READ:
                    break


# the API's event loop -> (database, run id) -> its feed
_feeds: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[int, str], RunFeed]]" = (
    weakref.WeakKeyDictionary())


def run_feed(db: Database, run_id: str) -> RunFeed:
    """The feed of `run_id` on this event loop, made at its first follower, dropped after its last."""
    feeds = _feeds.setdefault(asyncio.get_running_loop(), {})
    key = (id(db), run_id)
    feed = feeds.get(key)
    if feed is None:
        feed = feeds[key] = RunFeed(db, run_id, lambda done: feeds.pop(key, None) if feeds.get(key) is done else None)
    return feed
