"""The API's writes beside the worker's ingest on SQLite, where one transaction writes at a time: every API write
queued while an ingest transaction holds the file goes in the next turn, ahead of ingest transactions queued before
it (before: each API write took a turn of its own at the back of the line, behind every ingest transaction queued
before it, one write at a time; 23 of 147 writes failed after the 60 s wait at 100 clients beside two jobs)."""

import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import text

from server.db import Database

pytestmark = pytest.mark.sqlite_only


def wait_until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_api_writes_queued_behind_an_ingest_go_together_before_the_ingests_queued_before_and_after_them(
        db: Database) -> None:
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def ingest(name: str, hold: bool = False) -> None:
        with db.writing() as s:
            order.append(f"{name} begins")
            if hold:
                holding.set()
                release.wait(60)
            s.execute(text("SELECT 1"))
            order.append(f"{name} ends")

    def in_line() -> int:
        return db._turns.waiting()

    first = threading.Thread(target=ingest, args=("ingest 1", True))
    first.start()
    assert holding.wait(60)
    second = threading.Thread(target=ingest, args=("ingest 2",))
    second.start()
    wait_until("the second ingest in line", lambda: in_line() == 1)
    writes = [db.write_soon(lambda s, i=i: order.append(f"write {i}")) for i in range(10)]
    wait_until("the API's writer in line", lambda: in_line() == 2)
    third = threading.Thread(target=ingest, args=("ingest 3",))
    third.start()
    wait_until("the third ingest in line", lambda: in_line() == 3)
    release.set()
    for t in (first, second, third):
        t.join(60)
    assert [w.result(60) for w in writes] == [None] * 10
    assert order == ["ingest 1 begins", "ingest 1 ends", *[f"write {i}" for i in range(10)],
                     "ingest 2 begins", "ingest 2 ends", "ingest 3 begins", "ingest 3 ends"]


def test_a_failed_api_write_fails_alone_and_the_next_in_the_same_turn_commits(db: Database) -> None:
    def refused(s) -> None:  # noqa: ANN001
        s.execute(text("CREATE TABLE kept (n INTEGER)"))
        raise ValueError("refused")

    failed = db.write_soon(refused)
    made = db.write_soon(lambda s: s.execute(text("CREATE TABLE made (n INTEGER)")))
    with pytest.raises(ValueError, match="refused"):
        failed.result(60)
    made.result(60)
    with db.reading() as s:
        tables = set(s.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'")).scalars())
    assert "made" in tables and "kept" not in tables, "each write its own transaction"
