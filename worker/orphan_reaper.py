"""The orphan reaper: stops what is left of attempts given up on while their host was away (the unreachable
deadline of server/lifecycle.py marks their nodes abandoned), once the host answers again."""

import logging

from sqlalchemy import select

from server.db import Database
from server.lifecycle import ENDED_ATTEMPT, AttemptStatus
from server.models import Attempt
from worker.attempt_stopper import AttemptStopper
from worker.clock import Clock
from worker.host_contact import HostContact, mark_unreachable
from worker.host_errors import HostError, HostUnreachable
from worker.run_rows import read_run

log = logging.getLogger("longrun.worker")
# how often the worker looks for abandoned attempts
ORPHAN_SWEEP_SECONDS = 5.0


class OrphanReaper:
    interval = ORPHAN_SWEEP_SECONDS

    def __init__(self, db: Database, contact: HostContact, stopper: AttemptStopper, clock: Clock):
        self.db, self.contact, self.stopper, self.clock = db, contact, stopper, clock
        self._next = float("-inf")

    def due(self) -> bool:
        now = self.clock.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval
        return True

    def run_once(self) -> list[int]:
        """Ids of attempts with nodes given up on while their host was away."""
        with self.db.reading() as s:
            return list(s.scalars(select(Attempt.id).where(Attempt.abandoned.is_(True))))

    def stop(self, attempt_id: int) -> None:
        """Stop what is left of an abandoned attempt on its hosts (cancel is idempotent); retried until done."""
        with self.db.reading() as s:
            row = s.get(Attempt, attempt_id)
            run_id = row.run_id if row is not None else None
        run, hosts = read_run(self.db, run_id) if run_id else (None, {})
        attempt = next((a for a in run.attempts if a.id == attempt_id), None) if run else None
        # an attempt still in progress belongs to its run's driver
        if attempt is None or attempt.status not in ENDED_ATTEMPT or not attempt.abandoned:
            return
        started = self.clock.monotonic()
        try:
            remaining, _ = self.stopper.stop(run, [attempt], hosts, AttemptStatus(attempt.status), attempt.message)
        except HostUnreachable as exc:
            with self.db.writing() as s:
                mark_unreachable(s, exc.host, str(exc))
            return
        except HostError as exc:
            log.warning("run %s attempt %s: cannot stop what is left of it: %s", run.id, attempt.number, exc)
            return
        self.contact.mark_answered(hosts.values(), started)
        log.info("run %s attempt %s: host answered again; %s", run.id, attempt.number,
                 f"processes {remaining} still alive" if remaining else "no process of it remains")
