"""A write refused for want of room hands back the space the write-ahead log took: the log of a SQLite file stays as
large as its largest transaction grew it, a refused one included, so on a disk that was full every later write,
however small, found it as full as before (issue 39: writes still 503 long after space came back)."""

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from server.db import WAL_KEPT_BYTES, Database

pytestmark = pytest.mark.sqlite_only


def test_a_write_refused_for_a_full_disk_truncates_the_write_ahead_log(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    db = Database(f"sqlite:///{path}")
    with db.writing() as s:
        s.execute(text("CREATE TABLE blob (b BLOB)"))
    wal = Path(f"{path}-wal")
    with pytest.raises(OperationalError), db.writing() as s:
        # a large transaction that grows the log by 8 MiB, then is refused at its end as a full disk refuses
        for _ in range(8):
            s.execute(text("INSERT INTO blob VALUES (zeroblob(1048576))"))
        s.flush()
        assert wal.stat().st_size > 4 << 20
        raise OperationalError("COMMIT", {}, sqlite3.OperationalError("database or disk is full"))
    assert db.write_failure is not None and "full" in db.write_failure.error
    assert wal.stat().st_size <= WAL_KEPT_BYTES, "the refused transaction's log space is handed back"
    with db.writing() as s:  # and the next write goes through, clearing the failure
        s.execute(text("INSERT INTO blob VALUES (x'00')"))
    assert db.write_failure is None
    db.dispose()
