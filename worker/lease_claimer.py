"""The lease claimer: takes (or renews) the lease of every active run that no other live worker holds, so two
workers never drive the same run."""

from datetime import timedelta

from sqlalchemy import or_, select, update

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
        with self.db.writing() as s:
            free = or_(Run.lease_owner.is_(None), Run.lease_owner == self.worker_id, Run.lease_until < now)
            claimable = select(Run.id).where(Run.status.in_([str(x) for x in ACTIVE]), free)
            if s.info.get("lock_rows"):
                # another worker's claim holds the rows it takes until it commits: skip them, never wait and overwrite
                claimable = claimable.with_for_update(skip_locked=True)
            ids = list(s.scalars(claimable))
            if ids:
                s.execute(update(Run).where(Run.id.in_(ids)).values(
                    lease_owner=self.worker_id, lease_until=now + timedelta(seconds=self.lease_seconds)))
        return ids
