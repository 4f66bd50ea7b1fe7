"""The lease claimer: takes (or renews) the lease of every active run that no other live worker holds, so two
workers never drive the same run.

A lease is renewed once less than half of it is left, and a tick that finds nothing to take or renew writes
nothing: the claimer's write used to take the write lock every tick (every second), in line with every request
that writes, and on a full disk it was one more refused write a tick."""

from datetime import timedelta

from sqlalchemy import and_, or_, select, update

from server.db import Database
from server.lifecycle import ACTIVE
from server.models import Run
from worker.clock import Clock


class LeaseClaimer:
    def __init__(self, db: Database, worker_id: str, lease_seconds: float, clock: Clock):
        self.db, self.worker_id, self.lease_seconds, self.clock = db, worker_id, lease_seconds, clock

    def run_once(self) -> list[str]:
        """The ids of the runs this worker now holds."""
        now = self.clock.now()
        active = Run.status.in_([str(x) for x in ACTIVE])
        fresh = now + timedelta(seconds=self.lease_seconds / 2)
        # to take: free, lapsed, or ours with less than half of the lease left
        due = or_(Run.lease_owner.is_(None), Run.lease_until < now,
                  and_(Run.lease_owner == self.worker_id, Run.lease_until < fresh))
        with self.db.reading() as s:
            held = list(s.scalars(select(Run.id).where(active, Run.lease_owner == self.worker_id,
                                                       Run.lease_until >= fresh)))
            if s.scalar(select(Run.id).where(active, due).limit(1)) is None:
                return held
        with self.db.writing() as s:
            claimable = select(Run.id).where(active, due)
            if s.info.get("lock_rows"):
                # another worker's claim holds the rows it takes until it commits: skip them, never wait and overwrite
                claimable = claimable.with_for_update(skip_locked=True)
            ids = list(s.scalars(claimable))
            if ids:
                s.execute(update(Run).where(Run.id.in_(ids)).values(
                    lease_owner=self.worker_id, lease_until=now + timedelta(seconds=self.lease_seconds)))
            # ours still, renewed or not (a run can end meanwhile: only the active ones)
            held = list(s.scalars(select(Run.id).where(active, Run.lease_owner == self.worker_id)))
        return held
