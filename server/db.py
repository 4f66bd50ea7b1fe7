"""Engine, sessions and migrations.

On SQLite every connection runs in WAL mode with a busy timeout, and sessions opened with
`Database.writing()` start with BEGIN IMMEDIATE, so a read-then-write transition takes the
write lock before it reads and two concurrent transitions serialise instead of deadlocking.

On PostgreSQL writers run concurrently: read-then-write paths lock the rows they read (FOR UPDATE). Event ids
come from a sequence, and two transactions could commit them out of order; a reader that resumes after the last
id it saw (the SSE stream's Last-Event-ID, the webhook notifier's cursor over every run) would then skip the one
that committed late. So a transaction that adds events takes one lock, held until it commits, before its first
event gets its id: events commit in id order, as they do on SQLite, where writers take turns.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from server.models import Event

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# the PostgreSQL advisory lock that puts event-writing transactions in line (any constant no other program uses)
EVENTS_LOCK_KEY = 0x6C6F6E6576656E74


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        # the worker's thread pool (16) and the API's threads each hold a connection at once
        return create_engine(url, pool_pre_ping=True, pool_size=20)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=20)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_conn, _record) -> None:  # noqa: ANN001
        # let SQLAlchemy's begin event decide how transactions start
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class Database:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.is_sqlite = url.startswith("sqlite")
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(
            self.engine.execution_options(sqlite_immediate=True), expire_on_commit=False
        )
        if not self.is_sqlite:
            event.listen(self._writer, "before_flush", _events_in_commit_order)

    @contextmanager
    def reading(self) -> Iterator[Session]:
        with self._reader() as session, session.begin():
            yield session

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A transaction that holds the write lock from its first statement (BEGIN IMMEDIATE)."""
        with self._writer() as session, session.begin():
            # read-then-write paths lock the rows they read where the database needs it (not SQLite)
            session.info["lock_rows"] = not self.is_sqlite
            yield session

    def migrate(self) -> None:
        upgrade(self.url)

    def dispose(self) -> None:
        self.engine.dispose()


def _events_in_commit_order(session: Session, _context: Any, _instances: Any) -> None:
    """Before the transaction's first event gets its id, wait for the turn of events (held until commit)."""
    if not session.info.get("events_in_line") and any(isinstance(o, Event) for o in session.new):
        session.connection().execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": EVENTS_LOCK_KEY})
        session.info["events_in_line"] = True


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)
