"""Engine, sessions and migrations.

On SQLite every connection runs in WAL mode with a busy timeout, and sessions opened with
`Database.writing()` start with BEGIN IMMEDIATE, so a read-then-write transition takes the
write lock before it reads and two concurrent transitions serialise instead of deadlocking. Writers of one
process take turns in line (a FIFO `WriteTurns`) before they take a connection: SQLite's own busy handler polls
with growing sleeps and lets the unlucky wait out its timeout under load ("database is locked" at 100 clients);
its busy timeout now only covers other processes on the same file. Reads never take the write lock.

The pool holds a connection for every thread that may use one at once (POOL_SIZE): the API's thread pool
(server/config.py API_THREADS) and its writers, the worker's (WORKER_THREADS) and the few threads of its own.

On PostgreSQL writers run concurrently: read-then-write paths lock the rows they read (FOR UPDATE). Event ids
come from a sequence, and two transactions could commit them out of order; a reader that resumes after the last
id it saw (the SSE stream's Last-Event-ID, the webhook notifier's cursor over every run) would then skip the one
that committed late. So a transaction that adds events takes one lock, held until it commits, before its first
event gets its id: events commit in id order, as they do on SQLite, where writers take turns.
"""

import contextlib
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from server.config import API_THREADS, WORKER_THREADS
from server.errors import Unavailable
from server.models import Event, utcnow

log = logging.getLogger("longrun.db")
T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
# the PostgreSQL advisory lock that puts event-writing transactions in line (any constant no other program uses)
EVENTS_LOCK_KEY = 0x6C6F6E6576656E74
# the API's writer threads on PostgreSQL, where writers run at once (one on SQLite, where they take turns)
API_WRITERS = 4
# a connection for each thread that may hold one at once: the API's, its writers, the worker's, and its loop,
# notifier, wake-up listener and lease claimer
POOL_SIZE = API_THREADS + API_WRITERS + WORKER_THREADS + 8
# how long a writer waits for its turn (in line in this process, then SQLite's busy timeout for other processes)
# before the request answers 503
WRITE_WAIT_SECONDS = 60.0
# what of its write-ahead log a SQLite file keeps once checkpointed
WAL_KEPT_BYTES = 1 << 20
# how long the checkpoint that hands a full disk's log space back may wait for readers
RELEASE_WAIT_SECONDS = 2.0


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=10)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": WRITE_WAIT_SECONDS, "check_same_thread": False},
                           pool_size=POOL_SIZE, max_overflow=10)

    @event.listens_for(engine, "connect")
    def _configure(dbapi_conn, _record) -> None:  # noqa: ANN001
        # let SQLAlchemy's begin event decide how transactions start
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        _write_ahead_log(cur)
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={int(WRITE_WAIT_SECONDS * 1000)}")
        # a write-ahead log that grew (a large transaction, one that failed for want of room) shrinks back to this
        # once checkpointed, rather than keeping the disk space it took for ever
        cur.execute(f"PRAGMA journal_size_limit={WAL_KEPT_BYTES}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _write_ahead_log(cur: sqlite3.Cursor) -> None:
    """Put the file in WAL mode (kept in the file: later connections find it so). The switch needs the file to
    itself, and SQLite answers "database is locked" at once, without its busy handler, while another process holds
    it (a server migrating the fresh file this one also starts on): tried again until WRITE_WAIT_SECONDS."""
    deadline = time.monotonic() + WRITE_WAIT_SECONDS
    while True:
        try:
            if cur.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                return
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class WriteTurns:
    """The writers of this process, one at a time, first come, first served; but a writer that asks `first` (the
    API's, which runs every API write queued at its turn) goes ahead of those in line, once: while others wait, its
    turns and theirs alternate, so that neither waits behind more than one of the other's. Not re-entrant: a write
    transaction never opens another."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._line: deque[threading.Event] = deque()
        self._first: deque[threading.Event] = deque()
        self._held = False

    def waiting(self) -> int:
        """How many writers wait for their turn."""
        with self._mutex:
            return len(self._line) + len(self._first)

    @contextmanager
    def turn(self, timeout: float, first: bool = False) -> Iterator[None]:
        with self._mutex:
            mine = None
            if self._held:
                mine = threading.Event()
                (self._first if first else self._line).append(mine)
            else:
                self._held = True
        if mine is not None and not mine.wait(timeout):
            with self._mutex:
                for line in (self._first, self._line):
                    if mine in line:  # not handed the turn meanwhile
                        line.remove(mine)
                        raise Unavailable(f"the database is busy: no turn to write within {timeout:.0f}s; try again")
        try:
            yield
        finally:
            with self._mutex:
                # handed over: held all along, so nobody barges in
                ahead, behind = (self._line, self._first) if first else (self._first, self._line)
                if ahead or behind:
                    (ahead or behind).popleft().set()
                else:
                    self._held = False


@dataclass(frozen=True)
class WriteFailure:
    """The last write the database refused (a full disk, an I/O error), until a write goes through again."""

    since: datetime
    error: str


def is_store_failure(exc: BaseException) -> bool:
    """Whether `exc` is the database failing (full, unreachable, busy), not the caller's mistake."""
    return isinstance(exc, OperationalError | Unavailable)


def _first_line(exc: OperationalError) -> str:
    return str(exc.orig if exc.orig is not None else exc).splitlines()[0][:500]


class Database:
    def __init__(self, url: str):
        self.url = url
        # this process's view of the store's health (GET /healthz, run answers)
        self.write_failure: WriteFailure | None = None
        self.engine = make_engine(url)
        self._writer_lock = threading.Lock()
        # the API's writes waiting for the writer thread (write_soon), and the thread
        self._api_writes: deque[tuple[Callable[[Session], Any], Future[Any]]] = deque()
        self._api_queued = threading.Condition(self._writer_lock)
        self._api_writer: threading.Thread | None = None
        self._api_closing = False
        self._api_pool: ThreadPoolExecutor | None = None
        self._released_at = float("-inf")
        self.is_sqlite = url.startswith("sqlite")
        self._turns = WriteTurns() if self.is_sqlite else None
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(
            self.engine.execution_options(sqlite_immediate=True), expire_on_commit=False
        )
        if not self.is_sqlite:
            event.listen(self._writer, "before_flush", _events_in_commit_order)

    @contextmanager
    def reading(self) -> Iterator[Session]:
        with self._reader() as session, session.begin():
            session.info["write_failure"] = self.write_failure  # run answers say when the store refuses writes
            yield session

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A transaction that holds the write lock from its first statement (BEGIN IMMEDIATE); on SQLite it
        waits for its turn among this process's writers first."""
        with self._turns.turn(WRITE_WAIT_SECONDS) if self._turns else contextlib.nullcontext():
            with self._transaction() as session:
                yield session

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        try:
            with self._writer() as session, session.begin():
                # read-then-write paths lock the rows they read where the database needs it (not SQLite)
                session.info["lock_rows"] = not self.is_sqlite
                yield session
        except OperationalError as exc:
            self.write_failure = WriteFailure(utcnow(), _first_line(exc))
            if self.is_sqlite and "full" in self.write_failure.error:
                self.release_log_space()
            raise
        self.write_failure = None

    def write_soon(self, work: Callable[[Session], T]) -> Future[T]:
        """`work` in a write transaction on this database's writer thread, the API's writes one after another in
        the order they came. A request that writes then never waits for a thread of the pool the reads share (on a
        loaded server each of a write's hops to the pool waited behind every queued read, while the write line was
        held: at 100 clients the writes' p99 was 5 s, 60 s on a slower box), and the write line is a queue.

        On SQLite the writer takes one turn among the process's writers for every API write queued when it comes,
        each in a transaction of its own, and goes ahead of the worker's writers in line (WriteTurns): a turn a
        write, in line behind the worker's ingest transactions (each storing all that a job wrote since the last
        tick), made 100 clients' writes wait for every ingest transaction queued before each of them, one write at
        a time: 23 of 147 failed after the 60 s wait beside two jobs writing 10,000 points a second. On PostgreSQL,
        where writers run at once (as those of several servers do), API_WRITERS threads write, each write waiting
        for the database's own locks only: one after another, each write's round trips to the server added up."""
        with self._writer_lock:
            if not self.is_sqlite:
                if self._api_pool is None:
                    self._api_pool = ThreadPoolExecutor(API_WRITERS, thread_name_prefix="api-writer")
                return self._api_pool.submit(self._write_one, work)
            future: Future[T] = Future()
            self._api_writes.append((work, future))
            if self._api_writer is None:
                self._api_writer = threading.Thread(target=self._write_api, name="api-writer", daemon=True)
                self._api_writer.start()
            self._api_queued.notify()
        return future

    def _write_one(self, work: Callable[[Session], T]) -> T:
        with self._transaction() as session:
            return work(session)

    def _write_api(self) -> None:
        """SQLite's API writer: every API write queued, in one turn."""
        while True:
            with self._writer_lock:
                while not self._api_writes and not self._api_closing:
                    self._api_queued.wait()
                if not self._api_writes:
                    return
            try:
                with self._turns.turn(WRITE_WAIT_SECONDS, first=True):
                    with self._writer_lock:
                        batch = list(self._api_writes)
                        self._api_writes.clear()
                    for work, future in batch:
                        if future.set_running_or_notify_cancel():  # not given up on by its request meanwhile
                            try:
                                result = self._write_one(work)
                            except BaseException as exc:  # noqa: BLE001 - the request's to answer
                                future.set_exception(exc)
                            else:
                                future.set_result(result)  # once committed
            except Unavailable as exc:  # no turn within the wait: what is queued is answered so
                with self._writer_lock:
                    batch = list(self._api_writes)
                    self._api_writes.clear()
                for _, future in batch:
                    if future.set_running_or_notify_cancel():
                        future.set_exception(exc)

    def release_log_space(self) -> None:
        """Hand back the disk space the write-ahead log holds: a write refused for want of room leaves the log as
        large as it grew (the refused transaction's pages, never committed), and every later write, however
        small, then finds the disk as full as before. A checkpoint folds what was committed into the database file
        and truncates the log, so that writes resume as soon as the disk has room again. Best effort: with no room
        even for that, or readers holding the log, the next refused write tries again."""
        database = self.engine.url.database
        if not database or database == ":memory:":
            return
        with self._writer_lock:  # once a second at most, however many writes are refused meanwhile
            if time.monotonic() - self._released_at < 1.0:
                return
            self._released_at = time.monotonic()
        try:
            with contextlib.closing(sqlite3.connect(database, timeout=RELEASE_WAIT_SECONDS)) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("could not hand back the write-ahead log's space of %s: %s", database, exc)

    def migrate(self) -> None:
        upgrade(self.url)

    def dispose(self) -> None:
        if self._api_pool is not None:
            self._api_pool.shutdown(wait=True)
            self._api_pool = None
        with self._writer_lock:
            writer, self._api_closing = self._api_writer, True
            self._api_queued.notify()
        if writer is not None:
            writer.join()  # what was queued is written first
        with self._writer_lock:
            self._api_writer, self._api_closing = None, False
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


def upgrade(url: str, revision: str = "head", on_version_apply: Any = None) -> None:
    """Bring the database to `revision`, all of it or nothing: the whole upgrade is one transaction, on SQLite too
    (migrations/env.py says how), so a process killed in the middle leaves the schema as it was, and the next start
    upgrades it again. Chosen over building the upgrade on a copy and renaming it into place: a copy of a large
    file costs its size in time and disk at every upgrade, and two servers starting together on a fresh file each
    built their own and unlinked the other's; one transaction is SQLite's own way to serialise them. The transaction
    takes the write lock first, so servers starting together migrate one at a time (on PostgreSQL an advisory lock
    does), the later ones finding the schema new. `on_version_apply`: alembic's hook, called after each migration
    (tests land a kill there)."""
    cfg = alembic_config(url)
    cfg.attributes["on_version_apply"] = on_version_apply
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(cfg, revision)
