"""500 event streams on one run read the database as one does (docs/reliability.md, "500 streams on one run"):
the run's feed reads its new events once an interval and hands them to every follower. Counted, not timed: the
feed's interval is a gate the test opens, and every statement that reads the events table is counted (before:
each stream read the database every 0.5 s on the thread pool, 1,000 reads a second for 500 streams; GET run p50
2.2 s)."""

import asyncio
import re
import threading
import time
from collections.abc import Callable

import anyio.to_thread
import httpx
import pytest
from sqlalchemy import event

from server import feeds
from server.lifecycle import RunStatus
from tests.inprocess import App

pytestmark = pytest.mark.sqlite_only

FOLLOWERS = 500


def _until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_five_hundred_streams_on_one_run_cost_one_database_read_an_interval(api: App,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Semaphore(0)

    async def interval() -> None:  # the feed's wait between reads: the test opens it, one read at a time
        await anyio.to_thread.run_sync(gate.acquire, abandon_on_cancel=True)

    monkeypatch.setattr(feeds, "_tick", interval)
    reads: list[str] = []
    event.listen(api.db.engine, "before_cursor_execute",
                 lambda _c, _cur, sql, *_: reads.append(sql) if re.search(r"\bFROM events\b", sql) else None)
    run = api.submit()
    api.move(run["id"], RunStatus.LAUNCHING, RunStatus.RUNNING)
    received: list[list[str]] = [[] for _ in range(FOLLOWERS)]
    ended = threading.Event()

    def feed() -> feeds.RunFeed | None:
        return next((f for loop in list(feeds._feeds.values()) for (db, rid), f in list(loop.items())
                     if db == id(api.db) and rid == run["id"]), None)

    async def follow(url: str, i: int, client: httpx.AsyncClient) -> None:
        async with client.stream("GET", f"{url}/v1/runs/{run['id']}/events") as r:
            async for line in r.aiter_lines():
                if line.startswith("id:"):
                    received[i].append(line[3:].strip())

    async def followers(url: str) -> None:
        limits = httpx.Limits(max_connections=FOLLOWERS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            await asyncio.gather(*(follow(url, i, client) for i in range(FOLLOWERS)))
        ended.set()

    with api.serving() as url:
        streams = threading.Thread(target=asyncio.run, args=(followers(url),), daemon=True)
        streams.start()
        _until(lambda: all(len(r) == 3 for r in received), "every stream to replay the run's 3 events")
        _until(lambda: feed() is not None and feed().followers == FOLLOWERS, "500 followers of one feed")
        run_feed = feed()

        def one_interval() -> None:
            polls = run_feed.polls
            gate.release()
            _until(lambda: run_feed.polls == polls + 1, "the feed's read")

        reads.clear()
        for _ in range(5):
            one_interval()
        assert len(reads) == 5, f"{len(reads)} reads of the events table in 5 intervals with {FOLLOWERS} streams"

        reads.clear()
        api.move(run["id"], RunStatus.CANCELLING)
        one_interval()
        _until(lambda: all(len(r) == 4 for r in received), "every stream to get the new event")
        assert len(reads) == 1, "the new event read once for all its followers"
        assert len({tuple(r) for r in received}) == 1

        api.move(run["id"], RunStatus.CANCELLED)
        one_interval()
        assert ended.wait(120), "the streams end once the run has"
        assert all(len(r) == 5 for r in received)
        _until(lambda: feed() is None, "the feed dropped after its last follower")
