"""The lifecycle: every change of run, attempt and node state, and the rules that decide them.

Runs:

    queued -> launching -> running -> succeeded | failed
    running -> cancelling -> cancelled
    any -> restarting -> launching           (attempt n+1 with the new spec)
    running -> launching                      (the retry rule: a failed attempt with retries left)

Attempts: pending -> running -> succeeded | failed | cancelled (an attempt that never started may end at once).
Nodes (one per host of an attempt): pending -> running -> exited | lost | missing, and abandoned when
the unreachable-deadline rule gives up on a node whose host is away (the orphan reaper stops it later).

The rules are named functions below: `retry_or_fail` (retries), `host_unreachable` (the unreachable
deadline), `wait_for_gpus` (the GPU-wait deadline), `step_failed` (worker steps that raise) and `stall_seen`
(a step that stopped moving). Callers hold a write transaction
(Database.writing) and pass the run as read in it (`load_run`), so the check and the change are atomic.
Nothing outside this module assigns a status.
"""

import secrets
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from server.models import Attempt, Event, Run, utcnow
from server.spec import RunCreate, spec_dict


class RunStatus(StrEnum):
    QUEUED = "queued"
    LAUNCHING = "launching"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    RESTARTING = "restarting"


class AttemptStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class NodeState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"
    # the wrapper is gone without an exit code (host restarted, or killed)
    LOST = "lost"
    # the attempt directory has no pid file: the launch never happened there
    MISSING = "missing"
    # given up on while its host was away: its processes are stopped once the host answers
    ABANDONED = "abandoned"


S = RunStatus
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})
ACTIVE = frozenset(set(S) - TERMINAL)
ENDED_ATTEMPT = frozenset({AttemptStatus.SUCCEEDED, AttemptStatus.FAILED, AttemptStatus.CANCELLED})

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

# how a run's message starts while its host is away; replaced once the host answers again
NOT_ANSWERING = "host not answering"


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
               now: datetime | None = None, **data: Any) -> None:
    if not can_transition(run.status, target):
        raise TransitionError(run, target)
    previous = run.status
    run.status = target
    run.message = message
    run.updated_at = now or utcnow()
    if target in TERMINAL:
        run.ended_at = run.updated_at
        run.lease_owner = None
    elif previous in TERMINAL:
        run.ended_at = None
    session.add(Event(run_id=run.id, kind="status",
                      data={"from": previous, "to": str(target), "message": message,
                            "attempt": run.attempt, **data}))


def load_run(session: Session, run_id: str) -> Run | None:
    """The run with its attempts; in a write transaction on a server database, row-locked until commit."""
    query = select(Run).where(Run.id == run_id).options(selectinload(Run.attempts))
    if session.info.get("lock_rows"):
        query = query.with_for_update(of=Run)
    return session.scalar(query)


def is_unchanged(run: Run, status: RunStatus, attempt: int) -> bool:
    """The run, re-read in a write transaction, is still where a worker step found it: else the API changed it
    meanwhile, and the API's change wins."""
    return run.status == status and run.attempt == attempt


# runs and attempts come into being

def queue_new_run(session: Session, run: Run) -> None:
    """A submitted run, with its first attempt opened, enters the lifecycle queued."""
    run.status = RunStatus.QUEUED
    session.flush()
    session.add(Event(run_id=run.id, kind="status", data={"from": None, "to": run.status, "attempt": run.attempt}))


def open_attempt(session: Session, run: Run, spec: dict[str, Any], number: int) -> Attempt:
    attempt = Attempt(run_id=run.id, number=number, spec=spec, token=secrets.token_hex(16), nodes=[],
                      status=AttemptStatus.PENDING, created_at=utcnow(), metrics_lines=0)
    run.attempts.append(attempt)
    run.attempt = number
    run.spec = spec
    session.add(attempt)
    return attempt


def restart_run(session: Session, run: Run, spec: RunCreate, clean: bool, message: str,
                **data: Any) -> Attempt:
    """`restart` from any state: attempt n+1 with `spec` (its output emptied first when `clean`), retries
    counted afresh; an attempt n that never started ends there. Raises TransitionError while it settles."""
    previous = run.current
    transition(session, run, RunStatus.RESTARTING, message, **data)
    attempt = open_attempt(session, run, spec_dict(spec), run.attempt + 1)
    run.clean_pending = clean
    run.max_retries = spec.max_retries
    run.retries_used = 0
    run.latest = {}
    drop_unstarted_attempt(previous)
    return attempt


def start_attempt(attempt: Attempt, now: datetime) -> None:
    attempt.status, attempt.started_at = AttemptStatus.RUNNING, attempt.started_at or now


def end_attempt(attempt: Attempt, status: AttemptStatus, exit_code: int | None, message: str | None,
                now: datetime | None = None) -> None:
    """Record how the attempt ended; an attempt ends once, and never after a later attempt of its run started (the
    end a host or a scheduler recorded, set against the server's clock, is an estimate)."""
    if attempt.status in ENDED_ATTEMPT:
        return
    attempt.status, attempt.exit_code, attempt.message = status, exit_code, message
    ended = now or utcnow()
    later = [a.started_at for a in (attempt.run.attempts if attempt.run is not None else ())
             if a.number > attempt.number and a.started_at is not None]
    attempt.ended_at = min([ended, *later])


def drop_unstarted_attempt(attempt: Attempt) -> None:
    """A restart supersedes an attempt that never started: it ends there, cancelled.

    An attempt whose nodes are planned may be starting right now (the worker plans them in one transaction and
    records the launch in the next): it is left to the restart handler, which stops it before launching n+1."""
    if attempt.started_at is None and not attempt.nodes:
        end_attempt(attempt, AttemptStatus.CANCELLED, None, "never started")


# nodes: one per host of an attempt, stored as JSON on the attempt, typed here

@dataclass
class AttemptNode:
    host: str
    dir: str
    state: NodeState = NodeState.PENDING
    metrics_offset: int = 0
    log_offset: int = 0
    pid: int | None = None
    exit_code: int | None = None
    gpus: list[int] | None = None
    log_records: int = 0  # records of the log read into metrics (worker/log_metrics.py), and
    log_midline: bool = False  # whether the log offset stands inside one
    # a batch job waiting in its scheduler's queue: {"job_id", "state", "reason", "expected_start"} (epoch seconds)
    queue: dict[str, Any] | None = None
    # each file's identity at its offset, as the host said it (read again from the start once it differs), and
    # the bytes of the log stored before the job last wrote it anew (its text is stored after them)
    metrics_identity: dict[str, Any] | None = None
    log_identity: dict[str, Any] | None = None
    log_base: int = 0
    # when the host's wrapper started the job (seconds since the epoch, set against the server's clock) and how
    # long it ran by the host's clock, once it has ended: the attempt's start and end are taken from them
    started: float | None = None
    ran: float | None = None
    # node 0 of an entrypoint run: how its total steps were found from what the host read (server/log_patterns.py
    # FoundTotal.note: an estimate says so, and from what), said in the run's answer
    total_note: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "AttemptNode":
        return cls(host=raw["host"], dir=raw["dir"], state=NodeState(raw.get("state", NodeState.PENDING)),
                   metrics_offset=raw.get("metrics_offset", 0), log_offset=raw.get("log_offset", 0),
                   pid=raw.get("pid"), exit_code=raw.get("exit_code"), gpus=raw.get("gpus"),
                   log_records=raw.get("log_records", 0), log_midline=raw.get("log_midline", False),
                   queue=raw.get("queue"), metrics_identity=raw.get("metrics_identity"),
                   log_identity=raw.get("log_identity"), log_base=raw.get("log_base", 0),
                   started=raw.get("started"), ran=raw.get("ran"), total_note=raw.get("total_note"))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": str(self.state)}


def ended_badly(state: NodeState, exit_code: int | None) -> bool:
    """A node that vanished or exited non-zero fails its attempt."""
    return state in (NodeState.LOST, NodeState.MISSING) or (state == NodeState.EXITED and exit_code != 0)


def nodes_of(attempt: Attempt) -> list[AttemptNode]:
    return [AttemptNode.from_dict(n) for n in attempt.nodes or []]


def set_nodes(attempt: Attempt, nodes: list[AttemptNode]) -> None:
    attempt.nodes = [n.to_dict() for n in nodes]
    attempt.abandoned = any(n.state == NodeState.ABANDONED for n in nodes)


def plan_nodes(attempt: Attempt, placement: list[tuple[str, str]]) -> None:
    """Where each node of the attempt lives (host, directory), recorded before anything starts."""
    set_nodes(attempt, [AttemptNode(host, directory) for host, directory in placement])


def nodes_launched(attempt: Attempt, pids: list[int], gpus: list[list[int] | None],
                   queued: list[dict[str, Any] | None] | None = None) -> None:
    """The nodes run; a batch job that waits in its scheduler's queue (`queued`: what the scheduler said of it)
    stays pending."""
    nodes = nodes_of(attempt)
    for node, pid, assigned, queue in zip(nodes, pids, gpus, queued or [None] * len(nodes), strict=True):
        node.pid, node.gpus, node.queue = pid, assigned, queue
        node.state = NodeState.PENDING if queue is not None else NodeState.RUNNING
    set_nodes(attempt, nodes)


def total_found(session: Session, run: Run, attempt: Attempt, steps: int | None, note: str) -> None:
    """What node 0's host read for a foreign trainer's total steps: the total, unless one is known already (a total
    the trainer prints later still wins), with how it was found; or, `steps` None, why it could not be read."""
    if steps is not None and attempt.total_steps is None:
        attempt.total_steps = steps
        nodes = nodes_of(attempt)
        if nodes:
            nodes[0].total_note = note
            set_nodes(attempt, nodes)
    session.add(Event(run_id=run.id, kind="total_found" if steps is not None else "total_unknown",
                      data={"attempt": attempt.number, "steps": steps, "note": note[:1000]}))


def total_note(attempt: Attempt) -> str | None:
    nodes = nodes_of(attempt)
    return nodes[0].total_note if nodes else None


def expected_start(attempt: Attempt) -> datetime | None:
    """When the scheduler expects the attempt's batch job to start, while it waits in the queue."""
    starts = [n.queue.get("expected_start") for n in nodes_of(attempt) if n.state == NodeState.PENDING and n.queue]
    known = [s for s in starts if s is not None]
    return datetime.fromtimestamp(max(known), UTC) if known else None


def node_probed(attempt: Attempt, index: int, metrics_offset: int, log_offset: int, state: NodeState,
                exit_code: int | None, log_position: tuple[int, bool],
                identities: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
                log_base: int | None = None, job_times: tuple[float | None, float | None] = (None, None)) -> None:
    """What the host said of one node: how far its files were read (and their identities there), and whether it
    still runs; `log_base` when its log was read again from the start; `job_times` (started, ran) once known."""
    nodes = nodes_of(attempt)
    node = nodes[index]
    node.metrics_offset, node.log_offset, node.state, node.exit_code = metrics_offset, log_offset, state, exit_code
    node.log_records, node.log_midline = log_position
    node.metrics_identity, node.log_identity = identities
    if log_base is not None:
        node.log_base = log_base
    node.started, node.ran = job_times
    set_nodes(attempt, nodes)


def job_ended_at(attempt: Attempt) -> datetime | None:
    """When the attempt's last node ended by its host's record (set against the server's clock), or None where a
    node's is not known (a batch job, a wrapper that could not write it, or a host agent before it kept it)."""
    nodes = nodes_of(attempt)
    if not nodes or any(n.started is None or n.ran is None for n in nodes):
        return None
    return datetime.fromtimestamp(max(n.started + n.ran for n in nodes), UTC)


def abandon_nodes(attempt: Attempt, indices: set[int] | None = None) -> None:
    """Mark nodes (those given, else every one that has not exited) to be stopped once their host answers."""
    nodes = nodes_of(attempt)
    for i, node in enumerate(nodes):
        if (i in indices) if indices is not None else node.state != NodeState.EXITED:
            node.state = NodeState.ABANDONED
    set_nodes(attempt, nodes)


# the worker's steps, as rules over a run re-read in the step's write transaction

def start_launching(session: Session, run: Run, now: datetime) -> None:
    if run.status == RunStatus.QUEUED:
        run.clean_pending = False  # a fresh start's output directory is emptied (worker/run_driver.py _queue)
        transition(session, run, RunStatus.LAUNCHING, "launching", now=now)


def job_queued(run: Run, why: str) -> None:
    """The attempt's batch job waits in its scheduler's queue: the run stays launching, saying why (the scheduler's
    reason and expected start); the attempt stays pending."""
    run.message = why


def launched(session: Session, run: Run, now: datetime) -> None:
    start_attempt(run.current, now)
    transition(session, run, RunStatus.RUNNING, f"attempt {run.attempt} running", now=now)


@dataclass(frozen=True)
class NodeFailure:
    """The first node that ended badly: on which host, and how."""

    host: str
    state: NodeState
    exit_code: int | None
    note: str | None = None  # what the host saw that the job's log may not say (a full disk)
    # its scheduler ended it at its time limit: retried (from its checkpoint) by the retry rule like any failure
    time_limit: bool = False
    # the exception its first failed rank recorded, and that rank (worker/failure_cause.py)
    cause: str | None = None

    @property
    def why(self) -> str:
        return self._what() + (f"; {self.note}" if self.note else "")

    def _what(self) -> str:
        if self.time_limit:
            return f"reached its time limit on {self.host}: the scheduler ended it (exit code {self.exit_code})"
        if self.state == NodeState.EXITED and self.cause:
            return f"exited with code {self.exit_code} on {self.host}: {self.cause}"
        if self.state == NodeState.EXITED:
            return f"exited with code {self.exit_code} on {self.host}; see its log"
        # the host agent stops whatever a dead wrapper left before it answers the node lost
        return (f"lost its wrapper on {self.host}: it died without recording the job's exit code (killed, out of "
                "memory, or the host restarted); no process of the attempt is left there")


def attempt_finished(session: Session, run: Run, failure: NodeFailure | None, now: datetime) -> None:
    """Every node of the current attempt has ended and its output is stored: succeeded, or the retry rule."""
    current = run.current
    # the job's own end, not when the worker saw it (the server may have been down meanwhile)
    ended = job_ended_at(current) or now
    if failure is None:
        # a note made while it ran (metric lines skipped, a stall) stays
        end_attempt(current, AttemptStatus.SUCCEEDED, 0, current.message, ended)
        transition(session, run, RunStatus.SUCCEEDED, f"attempt {current.number} finished", now=now)
        return
    why = f"attempt {current.number} {failure.why}"
    end_attempt(current, AttemptStatus.FAILED, failure.exit_code if failure.state == NodeState.EXITED else None,
                why, ended)
    retry_or_fail(session, run, why, now)


def retry_or_fail(session: Session, run: Run, why: str, now: datetime) -> None:
    """The retry rule: a failed attempt with retries left is relaunched as attempt n+1 with the same spec
    (the trainer resumes from its last checkpoint); otherwise the run fails."""
    current = run.current
    if run.retries_used < run.max_retries:
        run.retries_used += 1
        open_attempt(session, run, current.spec, current.number + 1)
        transition(session, run, RunStatus.LAUNCHING, f"retry {run.retries_used} of {run.max_retries}: {why}",
                   now=now)
    else:
        transition(session, run, RunStatus.FAILED, why, now=now, exit_code=current.exit_code)


def fail_run(session: Session, run: Run, message: str, now: datetime) -> None:
    """A failure retrying cannot cure (the host refused our key, or refused the action). What may still run of the
    attempt on its hosts is marked for the orphan reaper, which stops it (a run that fails leaves no job behind)."""
    if run.status in ACTIVE:
        end_attempt(run.current, AttemptStatus.FAILED, None, message, now)
        if run.current.nodes:
            abandon_nodes(run.current)
        transition(session, run, RunStatus.FAILED, message, now=now)


def attempt_stopped(attempt: Attempt, status: AttemptStatus, message: str | None, nodes_left: set[int],
                    exit_code: int | None, now: datetime) -> None:
    """A stop of the attempt's nodes came back: with nothing left it has ended; an attempt given up on
    earlier keeps the nodes still alive (`nodes_left`, by index) marked, to be stopped again."""
    if not nodes_left:
        end_attempt(attempt, status, exit_code, message, now)
    elif attempt.status in ENDED_ATTEMPT:
        abandon_nodes(attempt, nodes_left)


def cancel_settled(session: Session, run: Run, remaining: list[int], now: datetime) -> None:
    if run.status != RunStatus.CANCELLING:
        return
    if remaining:
        run.message = f"cancelling: processes {remaining} still alive; trying again"
        return
    transition(session, run, RunStatus.CANCELLED, "cancelled; no process of the run remains", now=now)


def restart_blocked(run: Run, remaining: list[int]) -> None:
    run.message = f"restarting: processes {remaining} still alive; trying again"


def restart_cleared(session: Session, run: Run, attempt: int, now: datetime) -> bool:
    """The earlier attempts are gone (and the output cleaned): launch the new one. False if the API moved on."""
    if not is_unchanged(run, RunStatus.RESTARTING, attempt):
        return False
    run.clean_pending = False
    transition(session, run, RunStatus.LAUNCHING, f"previous attempts stopped; launching attempt {run.attempt}",
               now=now)
    return True


def host_unreachable(session: Session, run: Run, error: str, now: datetime, deadline: float) -> None:
    """The unreachable-deadline rule: a host that stops answering does not fail the run until `deadline`
    seconds have passed; then its unfinished attempts fail and their nodes are abandoned."""
    if run.status not in ACTIVE:
        return
    if run.unreachable_since is None:
        run.unreachable_since = now
    run.host_reachable = False
    waited = (now - run.unreachable_since).total_seconds()
    if waited <= deadline:
        run.message = f"{NOT_ANSWERING} since {run.unreachable_since:%H:%M:%S} UTC: {error}"
        return
    why = (f"host unreachable for {waited:.0f}s (deadline {deadline:.0f}s): "
           f"{error}; what is left of it there is stopped once the host answers again")
    for attempt in run.attempts:
        if attempt.status not in ENDED_ATTEMPT:
            end_attempt(attempt, AttemptStatus.FAILED, None, why, now)
            # the job may still run there: mark it, so that the orphan reaper stops it later
            abandon_nodes(attempt)
    transition(session, run, RunStatus.FAILED, f"host unreachable for more than {deadline:.0f}s: {error}", now=now)


def host_answering(run: Run, now: datetime) -> None:
    """The run's hosts answer again: clear the unreachable mark and say how long they were away."""
    if run.unreachable_since is not None and (run.message or "").startswith(NOT_ANSWERING):
        away = (now - run.unreachable_since).total_seconds()
        run.message = f"host answering again after {away:.0f}s away"
    run.host_reachable, run.unreachable_since = True, None


def wait_for_gpus(session: Session, run: Run, why: str, now: datetime, deadline: float) -> None:
    """The GPU-wait rule: a launching run whose GPUs others hold waits, saying who holds them, for at most
    `deadline` seconds since it started launching; then it fails."""
    if run.status != RunStatus.LAUNCHING:
        return
    waited = (now - run.updated_at).total_seconds()
    if waited > deadline:
        message = f"gave up after {waited:.0f}s waiting for GPUs: {why}"
        end_attempt(run.current, AttemptStatus.FAILED, None, message, now)
        transition(session, run, RunStatus.FAILED, message, now=now)
    else:
        run.message = f"waiting for GPUs ({waited:.0f}s of {deadline:.0f}s): {why}"


# --- service hardening (issue 15): worker steps that raise, and stalled attempts ---

# worker steps in a row that may raise something unexpected before the run fails with the error
MAX_STEP_FAILURES = 3


def step_failed(session: Session, run: Run, error: str, now: datetime, limit: int = MAX_STEP_FAILURES) -> None:
    """The step-failure rule: a worker step that raised something unexpected (a bug, a host's or a job's
    nonsense) is counted and said in the message; after `limit` in a row the run fails with it, never wedges.
    What may still run of it on its hosts is marked for the orphan reaper, as the unreachable rule does."""
    if run.status not in ACTIVE:
        return
    run.step_failures += 1
    if run.step_failures < limit:
        run.message = f"worker step failed ({run.step_failures} of {limit} in a row; trying again): {error}"
        return
    why = f"gave up after {limit} failed worker steps in a row: {error}"
    for attempt in run.attempts:
        if attempt.status not in ENDED_ATTEMPT:
            end_attempt(attempt, AttemptStatus.FAILED, None, why, now)
            if attempt.nodes:
                abandon_nodes(attempt)
    run.step_failures = 0
    transition(session, run, RunStatus.FAILED, why, now=now)


def step_succeeded(run: Run) -> None:
    """A worker step went through: the count of failed steps in a row starts again."""
    run.step_failures = 0


def stall_seen(session: Session, run: Run, now: datetime, factor: float, floor: float,
               still_watched: float | None = None) -> None:
    """The stall rule: a running attempt whose step has not moved for `factor` times its own measured seconds per
    step (and at least `floor` seconds, by the server's clock) is marked stalled in the run's message and a
    `stall` event, once. With `"on_stall": "restart"` in its spec and retries left it is restarted as attempt n+1
    with the same spec (counted as a retry; the trainer resumes from its last checkpoint), the old one stopped first.
    `still_watched`: seconds the worker has watched the step stand still by its monotonic clock; the stall is the
    shorter of that and the server clock's reading."""
    attempt = run.current
    if run.status != RunStatus.RUNNING or attempt.sec_per_step is None or attempt.step_seen_at is None:
        return
    if attempt.stalled_at is not None:
        if attempt.step_seen_at > attempt.stalled_at:
            attempt.stalled_at = None
            run.message = f"attempt {attempt.number} running; its step moved again after a stall"
        return
    still = (now - attempt.step_seen_at).total_seconds()
    if still_watched is not None:
        # how long the worker itself has watched the step stand still, by a clock that never jumps: a server clock
        # set forward an hour would otherwise make every running attempt look stalled (and restart it)
        still = min(still, still_watched)
    allowed = max(floor, factor * attempt.sec_per_step)
    if still <= allowed:
        return
    attempt.stalled_at = now
    why = (f"stalled: step {attempt.last_step} has not advanced for {still:.0f}s ({factor:g} x its "
           f"{attempt.sec_per_step:.3g}s per step, at least {floor:.0f}s)")
    session.add(Event(run_id=run.id, kind="stall", data={"attempt": attempt.number, "step": attempt.last_step,
                                                          "seconds": round(still), "message": why}))
    if attempt.typed_spec.on_stall != "restart":
        run.message = why
    elif run.retries_used < run.max_retries:
        run.retries_used += 1
        transition(session, run, RunStatus.RESTARTING,
                   f"retry {run.retries_used} of {run.max_retries}: attempt {attempt.number} {why}", now=now)
        open_attempt(session, run, attempt.spec, attempt.number + 1)
    else:
        run.message = f"{why}; not restarted: no retries left (max_retries {run.max_retries})"
