"""Reading a run's rows for a worker step, and re-reading it under the write lock to apply what it learned."""

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.db import Database
from server.lifecycle import load_run
from server.models import Attempt, Host, Run


@contextmanager
def fresh_run(db: Database, run_id: str) -> Iterator[tuple[Session, Run]]:
    """A write transaction holding the run as it is now, locked: the one place a step re-reads its run before
    applying what it learned (with server.lifecycle.is_unchanged where an API change must win)."""
    with db.writing() as session:
        run = load_run(session, run_id)
        if run is None:
            raise LookupError(f"run {run_id} is gone")
        yield session, run


def read_run(db: Database, run_id: str) -> tuple[Run | None, dict[str, Host]]:
    """The run with its attempts and its hosts by name, read without a lock."""
    with db.reading() as session:
        run = load_run(session, run_id)
        if run is None:
            return None, {}
        return run, {h.name: h for h in session.scalars(select(Host).where(Host.name.in_(run.hosts)))}


def attempt_numbered(run: Run, number: int) -> Attempt:
    return next(a for a in run.attempts if a.number == number)
