"""Millions of metric points in a SQLite file in seconds, for tests and benchmarks of reads: one INSERT … SELECT
over a recursive count inside SQLite (no Python object a point), into the real schema (the migrations' tables and
indexes), under an ended run of its own."""

import sqlite3
from pathlib import Path

from server.db import Database
from server.lifecycle import RunStatus
from server.models import Attempt, Run


def ended_run(database_url: str, run_id: str = "bigread") -> str:
    """A succeeded run with one attempt (nothing for a worker to drive)."""
    db = Database(database_url)
    try:
        with db.writing() as s:
            s.add(Run(id=run_id, name=run_id, status=RunStatus.SUCCEEDED, spec={}, hosts=["local"], latest={},
                      attempt=1))
            s.add(Attempt(run_id=run_id, number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    finally:
        db.dispose()
    return run_id


def store_points(path: Path, run_id: str, names: list[str], lines: int) -> int:
    """`lines` metric lines of attempt 1, each with one point of every name (step = line); the points stored."""
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA cache_size=-100000")  # 100 MB of pages while the indexes grow
        for name in names:
            c.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                      "INSERT INTO metric_points (run_id, attempt, line, name, step, value, time) "
                      "SELECT ?, 1, i, ?, i, 1.0 / i, '2026-12-04 00:00:00.000000' FROM n", (lines, run_id, name))
    return lines * len(names)


def rss_mib(pid: int) -> tuple[float, float]:
    """A process's resident memory now and its peak (VmRSS, VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
