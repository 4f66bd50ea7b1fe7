"""The run state machine: every status change goes through `transition`.

    queued -> launching -> running -> succeeded | failed
    running -> cancelling -> cancelled
    any -> restarting -> launching           (attempt n+1 with the new spec)
    running -> launching                      (a failed attempt with retries left)

Callers hold a write transaction (Database.writing) so the check and the change are atomic.
"""

from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from server.models import Event, Run, utcnow


class RunStatus(StrEnum):
    QUEUED = "queued"
    LAUNCHING = "launching"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    RESTARTING = "restarting"


S = RunStatus
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset(set(S) - TERMINAL)

ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    S.QUEUED: frozenset({S.LAUNCHING, S.CANCELLING, S.RESTARTING, S.FAILED}),
    S.LAUNCHING: frozenset({S.RUNNING, S.FAILED, S.CANCELLING, S.RESTARTING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLING, S.RESTARTING, S.LAUNCHING}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED}),
    S.RESTARTING: frozenset({S.LAUNCHING, S.FAILED}),
    S.SUCCEEDED: frozenset({S.RESTARTING}),
    S.FAILED: frozenset({S.RESTARTING}),
    S.CANCELLED: frozenset({S.RESTARTING}),
}


class TransitionError(Exception):
    """The run is not in a state that allows the requested change."""

    def __init__(self, run: Run, target: RunStatus):
        self.run_id = run.id
        self.current = RunStatus(run.status)
        self.target = target
        super().__init__(f"run {run.id} is {self.current}; it cannot go to {target}")


def can_transition(current: str, target: RunStatus) -> bool:
    return target in ALLOWED[RunStatus(current)]


def transition(session: Session, run: Run, target: RunStatus, message: str | None = None,
               **data: Any) -> None:
    if not can_transition(run.status, target):
        raise TransitionError(run, target)
    previous = run.status
    run.status = target
    run.message = message
    run.updated_at = utcnow()
    if target in TERMINAL:
        run.ended_at = run.updated_at
        run.lease_owner = None
    elif previous in TERMINAL:
        run.ended_at = None
    session.add(Event(run_id=run.id, kind="status",
                      data={"from": previous, "to": str(target), "message": message,
                            "attempt": run.attempt, **data}))
