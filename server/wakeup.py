"""Waking the workers when the API changes what they drive, so that a submit, cancel or restart is acted on at
once instead of on a worker's next tick (the tick stays, as the fallback for a wake-up that got lost).

The API marks its write transaction (`wake_workers`); once it commits, every worker of the same database wakes:
- in this process (`longrun serve` with its embedded worker): each listener's own pipe gets a byte;
- in other processes on the same SQLite file (`longrun worker`): each listening worker owns a FIFO in a directory
  beside the database file, and gets one byte through it (a FIFO nobody reads any more is removed);
- on PostgreSQL: NOTIFY inside the transaction (the server delivers it at commit) to the workers' LISTEN.

A listener (`WakeupListener`) waits on its pipe (and its LISTEN connection) with the tick as the timeout.
"""

import contextlib
import errno
import logging
import os
import secrets
import select
import threading
from pathlib import Path

from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session

log = logging.getLogger("longrun.worker")

CHANNEL = "longrun_wakeup"
_PENDING = "longrun_wake_workers"

_lock = threading.Lock()
# database (engine URL) -> the listeners in this process
_listeners: dict[str, set["WakeupListener"]] = {}


def _key(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def wakeup_dir(engine: Engine) -> Path | None:
    """Where the workers of a SQLite file keep their FIFOs; None where no other process can share the database."""
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return None
    database = Path(engine.url.database)
    return database.with_name(database.name + "-wakeup")


def workers_listening(engine: Engine) -> bool:
    """Whether a worker of this database listens for wake-ups: in this process, through a FIFO beside the SQLite
    file, or with a LISTEN on PostgreSQL (what an API that waits for a worker's answer first asks)."""
    with _lock:
        if _listeners.get(_key(engine)):
            return True
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            return bool(conn.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                         "AND query = :q"), {"q": f"LISTEN {CHANNEL}"}))
    directory = wakeup_dir(engine)
    return directory is not None and directory.is_dir() and any(_has_reader(f) for f in directory.iterdir())


def _has_reader(fifo: Path) -> bool:
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        return False  # ENXIO: the worker that made it is gone
    return True


def wake_workers(session: Session) -> None:
    """Once this write transaction commits, wake every worker of its database."""
    if session.info.get(_PENDING):
        return
    session.info[_PENDING] = True
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"NOTIFY {CHANNEL}"))


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    if session.info.pop(_PENDING, False):
        _wake_all(session.get_bind())


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


def _wake_all(engine: Engine) -> None:
    with _lock:
        local = list(_listeners.get(_key(engine), ()))
    for listener in local:
        listener.wake()
    directory = wakeup_dir(engine)
    if directory is None or not directory.is_dir():
        return
    ours = {listener.fifo for listener in local}
    for fifo in directory.iterdir():
        if fifo not in ours:
            _poke(fifo)


def _poke(fifo: Path) -> None:
    """One byte into another worker's FIFO; a FIFO with no reader is a worker that is gone."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            fifo.unlink(missing_ok=True)
        return
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # its buffer is full of wake-ups it has not read yet: it is awake
    finally:
        os.close(fd)


class WakeupListener:
    """What a worker waits on between ticks: returns early when the API changed something."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._closed = False
        self.fifo = _own_fifo(wakeup_dir(engine))
        if self.fifo is not None:
            # read and write: the FIFO then always has a reader (us), and wake() can write to it
            self._read_fd = self._write_fd = os.open(self.fifo, os.O_RDWR | os.O_NONBLOCK)
        else:
            self._read_fd, self._write_fd = os.pipe()
            for fd in (self._read_fd, self._write_fd):
                os.set_blocking(fd, False)
        self._notices = _PgListen(engine) if engine.dialect.name == "postgresql" else None
        if self._notices is not None:
            self._notices.fileno()  # LISTEN now: a NOTIFY between here and the first wait is not lost
        with _lock:
            _listeners.setdefault(_key(engine), set()).add(self)

    def wake(self) -> None:
        with _lock, contextlib.suppress(BlockingIOError):
            if not self._closed:
                os.write(self._write_fd, b"\0")

    def wait(self, timeout: float) -> bool:
        """Wait until woken or `timeout` seconds have passed; True when woken."""
        listening = self._notices.fileno() if self._notices is not None else None
        poller = select.poll()  # not select(): a server holding many connections has descriptors past 1024
        for fd in [self._read_fd] + ([listening] if listening is not None else []):
            poller.register(fd, select.POLLIN)
        ready = dict(poller.poll(timeout * 1000))
        woken = False
        if self._read_fd in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read_fd, 4096):
                    woken = True
        if listening is not None and listening in ready:
            woken = self._notices.drain(broken=bool(ready[listening] & ~select.POLLIN)) or woken
        return woken

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            _listeners.get(_key(self.engine), set()).discard(self)
        if self._notices is not None:
            self._notices.close()
        os.close(self._read_fd)
        if self._write_fd != self._read_fd:
            os.close(self._write_fd)
        if self.fifo is not None:
            self.fifo.unlink(missing_ok=True)


def _own_fifo(directory: Path | None) -> Path | None:
    """A new FIFO in `directory`, or None where there is none (wake-ups then come from this process only)."""
    if directory is None:
        return None
    fifo = directory / f"{os.getpid()}-{secrets.token_hex(4)}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        os.mkfifo(fifo, 0o600)
    except OSError as exc:
        log.warning("an API in another process cannot wake this worker (no FIFO in %s: %s): it ticks", directory, exc)
        return None
    return fifo


class _PgListen:
    """A connection of its own that LISTENs on the channel; re-made at the next wait after it fails."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._raw = self._conn = None

    def fileno(self) -> int | None:
        if self._conn is None:
            try:
                self._raw = self.engine.raw_connection()
                self._conn = self._raw.driver_connection
                self._conn.autocommit = True
                self._conn.execute(f"LISTEN {CHANNEL}")
            except Exception:
                self.close()
                return None  # the database is away: the tick notices, and the next wait tries again
        return self._conn.fileno()

    def drain(self, broken: bool) -> bool:
        """Read the notifications that arrived; a connection that broke counts as one (and is re-made)."""
        try:
            if not broken:
                return bool(list(self._conn.notifies(timeout=0)))
        except Exception:
            pass
        self.close()
        return True

    def close(self) -> None:
        if self._raw is not None:
            with contextlib.suppress(Exception):
                self._raw.invalidate()
        self._raw = self._conn = None
