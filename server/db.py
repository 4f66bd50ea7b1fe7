"""Engine, sessions and migrations.

On SQLite every connection runs in WAL mode with a busy timeout, and sessions opened with
`Database.writing()` start with BEGIN IMMEDIATE, so a read-then-write transition takes the
write lock before it reads and two concurrent transitions serialise instead of deadlocking.

On PostgreSQL writers run concurrently: read-then-write paths lock the rows they read (FOR UPDATE). Every path
that adds events to a run holds that run's row lock from before the events get their ids until it commits, so a
run's events commit in id order and a reader that resumes after the last id it saw (the SSE stream,
Last-Event-ID) never skips one that committed late.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


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


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)
