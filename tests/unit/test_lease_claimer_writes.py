"""The lease claimer writes only when a lease is to be taken or renewed: a worker's tick (every second) used to take
the write lock for every active run's lease, in line with every request that writes, and on a full disk it was one
more refused write a second (issue 39: worker/lease_claimer.py:21 failing every tick)."""

from datetime import timedelta

import pytest
from sqlalchemy import event

from server.db import Database
from server.lifecycle import RunStatus
from server.models import Run, utcnow
from worker.clock import Clock
from worker.lease_claimer import LeaseClaimer

pytestmark = pytest.mark.sqlite_only


class Moved(Clock):
    def __init__(self) -> None:
        self.at = utcnow()

    def now(self):  # noqa: ANN201
        return self.at


def test_a_tick_with_every_lease_fresh_writes_nothing_and_a_lease_half_gone_is_renewed(db: Database) -> None:
    with db.writing() as s:
        s.add(Run(id="r1", name="r", status=RunStatus.RUNNING, spec={}, hosts=["local"], latest={}))
        s.add(Run(id="r2", name="q", status=RunStatus.SUCCEEDED, spec={}, hosts=["local"], latest={}))
    writes: list[str] = []
    event.listen(db.engine, "before_cursor_execute",
                 lambda _c, _cur, sql, *_: writes.append(sql) if sql.lstrip().upper().startswith("UPDATE") else None)
    clock = Moved()
    claimer = LeaseClaimer(db, "w1", lease_seconds=30, clock=clock)
    assert claimer.run_once() == ["r1"]
    assert len(writes) == 1
    start = clock.at
    for seconds in (1, 5, 14):
        clock.at = start + timedelta(seconds=seconds)
        assert claimer.run_once() == ["r1"]
    assert len(writes) == 1, "ticks with the lease fresh wrote"
    clock.at = start + timedelta(seconds=16)  # less than half of the 30 s lease left
    assert claimer.run_once() == ["r1"]
    assert len(writes) == 2
    with db.reading() as s:
        assert s.get(Run, "r1").lease_until.replace(tzinfo=None) == (clock.at + timedelta(seconds=30)).replace(
            tzinfo=None)
    # another worker keeps away while the lease holds, and takes the run once it lapsed
    other = LeaseClaimer(db, "w2", lease_seconds=30, clock=clock)
    assert other.run_once() == []
    clock.at += timedelta(seconds=31)
    assert other.run_once() == ["r1"]
