"""Run operations: what the API handlers and the worker do to runs, each inside one transaction."""

import hashlib
import json
import uuid
from datetime import timedelta
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from server import eta
from server.lifecycle import (
    TERMINAL,
    RunStatus,
    TransitionError,
    drop_unstarted_attempt,
    open_attempt,
    queue_new_run,
    transition,
)
from server.models import Attempt, Host, LogChunk, MetricPoint, Run, utcnow
from server.schemas import (
    RESTART_TOP_LEVEL,
    TRAINER_FIELDS,
    AttemptPublic,
    DryRunPublic,
    RestartRequest,
    RunCreate,
    RunPublic,
)


class NotFound(Exception):
    pass


class Conflict(Exception):
    """The request clashes with the run's current state (HTTP 409)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


def field_error(loc: tuple[str | int, ...], message: str, value: Any = None) -> RequestValidationError:
    """A 422 that names the field, like pydantic's own."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": message, "input": value}])


def get_run(session: Session, run_id: str) -> Run:
    """The run with its attempts; in a write transaction on a server database, row-locked until commit."""
    query = select(Run).where(Run.id == run_id).options(selectinload(Run.attempts))
    if session.info.get("lock_rows"):
        query = query.with_for_update(of=Run)
    run = session.scalar(query)
    if run is None:
        raise NotFound(f"no run with id {run_id!r}")
    return run


def spec_dict(spec: RunCreate) -> dict[str, Any]:
    return spec.model_dump(mode="json", exclude_none=True)


def _check_hosts(session: Session, spec: RunCreate) -> list[Host]:
    names = spec.host_names
    field = "host" if spec.host is not None else "hosts"
    hosts = {h.name: h for h in session.scalars(select(Host).where(Host.name.in_(names)))}
    for i, name in enumerate(names):
        if name not in hosts:
            loc = (field,) if field == "host" else (field, i)
            raise field_error(loc, f"unknown host {name!r}; register it with POST /v1/hosts first", name)
    if len(set(names)) != len(names):
        raise field_error(("hosts",), "a host may appear only once in `hosts`", names)
    return [hosts[n] for n in names]


def submit_run(session: Session, spec: RunCreate, idempotency_key: str | None = None) -> tuple[Run, bool]:
    """Create a queued run; with an idempotency key a repeat of the same request returns the first run."""
    body = spec_dict(spec)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    if idempotency_key:
        existing = session.scalar(select(Run).where(Run.idempotency_key == idempotency_key))
        if existing is not None:
            if existing.request_hash != digest:
                raise Conflict(f"Idempotency-Key {idempotency_key!r} was used for a different request")
            return get_run(session, existing.id), False
    _check_hosts(session, spec)
    run = Run(id=uuid.uuid4().hex[:12], name=spec.name, spec=body,
              hosts=spec.host_names, max_retries=spec.max_retries, idempotency_key=idempotency_key,
              request_hash=digest, latest={}, attempts=[])
    session.add(run)
    open_attempt(session, run, body, 1)
    queue_new_run(session, run)
    return run, True


def request_cancel(session: Session, run_id: str) -> Run:
    run = get_run(session, run_id)
    try:
        transition(session, run, RunStatus.CANCELLING, "cancel requested")
    except TransitionError as exc:
        raise Conflict(f"run {run_id} is {exc.current}: only a queued, launching or running run can be "
                       f"cancelled", exc.current) from None
    return run


def apply_overrides(current: dict[str, Any], overrides: dict[str, Any]) -> RunCreate:
    """The current spec with `overrides` applied; unknown keys or bad values are 422s naming the key."""
    spec = json.loads(json.dumps(current))
    for key, value in overrides.items():
        if key in RESTART_TOP_LEVEL:
            spec[key] = value
        elif key in TRAINER_FIELDS and spec.get("trainer") is not None:
            spec["trainer"][key] = value
        elif key in TRAINER_FIELDS:
            raise field_error(("overrides", key), f"{key!r} is a trainer field, but this run has no `trainer`")
        else:
            allowed = sorted(RESTART_TOP_LEVEL | (TRAINER_FIELDS if spec.get("trainer") else set()))
            raise field_error(("overrides", key), f"unknown override {key!r}; allowed: {', '.join(allowed)}")
    try:
        return RunCreate.model_validate(spec)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = err["loc"]
            if loc and loc[0] == "trainer" and len(loc) > 1:
                loc = loc[1:]
            errors.append({**err, "loc": ("body", "overrides", *loc)})
        raise RequestValidationError(errors) from None


def _restart_spec(session: Session, run: Run, req: RestartRequest) -> RunCreate:
    spec = apply_overrides(run.spec, req.overrides)
    if req.init_from_last:
        if spec.trainer is None:
            raise field_error(("init_from_last",), "only trainer runs can start from the last draft")
        previous = run.spec["trainer"]["output_dir"]
        if req.clean and spec.trainer.output_dir == previous:
            # the clean would delete it: the worker moves the draft here first (hostside clean keep_into)
            host = _check_hosts(session, spec)[0]
            previous = f"{host.workspace.rstrip('/')}/.longrun/{run.id}/draft-before-attempt-{run.attempt + 1}"
        spec.trainer.init_from = previous
    elif spec.trainer and spec.trainer.init_from and "/.longrun/" in spec.trainer.init_from:
        spec.trainer.init_from = None  # a stash from an earlier warm restart is not this restart's start
    if req.clean:
        target = spec.clean_dir
        if target is None:
            raise field_error(("clean",), "clean needs an `output_dir` (trainer.output_dir for trainer runs)")
        for host in _check_hosts(session, spec):
            ws = host.workspace.rstrip("/")
            if not target.startswith(ws + "/"):
                raise field_error(("clean",), f"refusing to clean {target}: it is outside the workspace "
                                  f"{host.workspace} of host {host.name}", target)
    return spec


def request_restart(session: Session, run_id: str, req: RestartRequest) -> Run:
    run = get_run(session, run_id)
    spec = _restart_spec(session, run, req)
    previous = run.current
    try:
        transition(session, run, RunStatus.RESTARTING, f"restart requested: attempt {run.attempt + 1}",
                   overrides=req.overrides)
    except TransitionError as exc:
        raise Conflict(f"run {run_id} is {exc.current}; wait until it settles, then restart", exc.current) from None
    attempt = open_attempt(session, run, spec_dict(spec), run.attempt + 1)
    predicted, basis = eta.predict_duration(measured_attempts(session, run), attempt.spec)
    attempt.predicted_duration_seconds, attempt.prediction_basis = predicted, basis
    run.clean_pending = req.clean
    run.max_retries = spec.max_retries
    run.retries_used = 0
    run.latest = {}
    drop_unstarted_attempt(previous)
    return run


def dry_run_restart(session: Session, run_id: str, req: RestartRequest) -> DryRunPublic:
    run = get_run(session, run_id)
    spec = spec_dict(_restart_spec(session, run, req))
    if run.status in (RunStatus.RESTARTING, RunStatus.CANCELLING):
        raise Conflict(f"run {run_id} is {run.status}; wait until it settles, then restart", run.status)
    seconds, basis = eta.predict_duration(measured_attempts(session, run), spec)
    finish = utcnow() + timedelta(seconds=seconds) if seconds is not None else None
    return DryRunPublic(new_spec=spec, predicted_duration_seconds=seconds, predicted_finish=finish, basis=basis)


def measured_attempts(session: Session, run: Run) -> list[eta.Measured]:
    """This run's attempts with a measured pace, newest first; else similar runs on the same hosts."""
    own = [_measured(a) for a in sorted(run.attempts, key=lambda a: -a.number) if a.sec_per_step and a.total_steps]
    if own:
        return own
    return similar_attempts(session, run.spec, exclude_run=run.id)


def _measured(a: Attempt) -> eta.Measured:
    startup = wrapup = 0.0
    if a.first_step_at and a.started_at:
        startup = max(0.0, (a.first_step_at - a.started_at).total_seconds() - a.sec_per_step)
        if a.status == "succeeded" and a.ended_at:  # all its steps ran: the rest of its time is the wrap-up
            taken = (a.ended_at - a.started_at).total_seconds()
            wrapup = max(0.0, taken - startup - a.total_steps * a.sec_per_step)
    return eta.Measured(a.spec, a.sec_per_step, a.total_steps, startup, wrapup)


def similar_attempts(session: Session, spec: dict[str, Any], exclude_run: str | None = None,
                     limit: int = 50) -> list[eta.Measured]:
    """Earlier attempts on the same hosts with the same program and process count."""
    rows = session.execute(
        select(Attempt, Run.hosts).join(Run).where(Attempt.sec_per_step.is_not(None),
                                                   Attempt.total_steps.is_not(None))
        .order_by(Attempt.created_at.desc()).limit(limit)).all()
    hosts = spec.get("hosts") or [spec.get("host")]
    out = []
    for attempt, run_hosts in rows:
        s = attempt.spec
        if attempt.run_id == exclude_run or run_hosts != hosts:
            continue
        same_program = (s.get("entrypoint") == spec.get("entrypoint") and
                        bool(s.get("trainer")) == bool(spec.get("trainer")))
        if same_program and s.get("nproc_per_node") == spec.get("nproc_per_node"):
            out.append(_measured(attempt))
    return out


def _attempt_public(a: Attempt) -> AttemptPublic:
    actual = None
    error = None
    if a.ended_at and a.started_at:
        actual = (a.ended_at - a.started_at).total_seconds()
        if a.predicted_duration_seconds and a.status == "succeeded":
            error = (actual - a.predicted_duration_seconds) / a.predicted_duration_seconds
    return AttemptPublic(number=a.number, spec=a.spec, status=a.status, created_at=a.created_at,
                         started_at=a.started_at, first_step_at=a.first_step_at, ended_at=a.ended_at, exit_code=a.exit_code, message=a.message,
                         log_path=a.log_path, nodes=a.nodes, last_step=a.last_step, total_steps=a.total_steps,
                         seconds_per_step=a.sec_per_step, predicted_duration_seconds=a.predicted_duration_seconds,
                         actual_duration_seconds=actual, prediction_error=error)


def progress_and_eta(session: Session, run: Run) -> tuple[float | None, float | None]:
    a = run.current
    progress = None
    if a.total_steps and a.last_step is not None:
        progress = min(1.0, a.last_step / a.total_steps)
    if run.status == RunStatus.SUCCEEDED:
        return 1.0, 0.0
    if run.status in TERMINAL:
        return progress, None
    if a.sec_per_step is not None:
        since = (utcnow() - a.last_metric_at).total_seconds() if a.last_metric_at else 0.0
        return progress, eta.remaining_seconds(a.total_steps, a.last_step, a.sec_per_step, since)
    # nothing measured yet: the pace of this run's or similar earlier attempts
    seconds, _ = eta.predict_duration(measured_attempts(session, run), a.spec)
    return progress, seconds


def run_public(session: Session, run: Run) -> RunPublic:
    progress, eta_seconds = progress_and_eta(session, run)
    return RunPublic(id=run.id, name=run.name, status=run.status, message=run.message, attempt=run.attempt,
                     hosts=run.hosts, spec=run.spec, progress=progress, eta_seconds=eta_seconds,
                     host_reachable=run.host_reachable, latest=run.latest or {}, created_at=run.created_at,
                     updated_at=run.updated_at, ended_at=run.ended_at,
                     attempts=[_attempt_public(a) for a in run.attempts])


def list_runs(session: Session, status: str | None, limit: int, cursor: str | None) -> tuple[list[Run], str | None]:
    """Newest first; the cursor is the last run's (created_at, id) so pages stay stable under inserts."""
    q = select(Run).options(selectinload(Run.attempts)).order_by(Run.created_at.desc(), Run.id.desc())
    if status:
        q = q.where(Run.status == status)
    if cursor:
        anchor = session.get(Run, cursor)
        if anchor is None:
            raise field_error(("cursor",), f"unknown cursor {cursor!r}")
        q = q.where((Run.created_at < anchor.created_at) |
                    ((Run.created_at == anchor.created_at) & (Run.id < anchor.id)))
    runs = list(session.scalars(q.limit(limit + 1)))
    more = len(runs) > limit
    runs = runs[:limit]
    return runs, (runs[-1].id if more and runs else None)


def metric_series(session: Session, run_id: str, names: list[str] | None, attempt: int | None,
                  since_step: int | None, limit: int) -> dict[str, list[dict[str, Any]]]:
    get_run(session, run_id)
    q = select(MetricPoint).where(MetricPoint.run_id == run_id)
    if names:
        q = q.where(MetricPoint.name.in_(names))
    if attempt is not None:
        q = q.where(MetricPoint.attempt == attempt)
    if since_step is not None:
        q = q.where(MetricPoint.step > since_step)
    q = q.order_by(MetricPoint.name, MetricPoint.attempt, MetricPoint.line, MetricPoint.id).limit(limit)
    series: dict[str, list[dict[str, Any]]] = {}
    for p in session.scalars(q):
        series.setdefault(p.name, []).append({"attempt": p.attempt, "step": p.step, "value": p.value, "time": p.time})
    return series


def log_lines(session: Session, run_id: str, attempt: int | None, tail: int | None,
              since_offset: int | None, node: int = 0) -> tuple[int, str | None, list[str], int]:
    """Lines of an attempt's log as ingested from the host; returns (attempt, path, lines, next_offset)."""
    run = get_run(session, run_id)
    number = attempt or run.attempt
    att = next((a for a in run.attempts if a.number == number), None)
    if att is None:
        raise NotFound(f"run {run_id} has no attempt {number}")
    q = select(LogChunk).where(LogChunk.run_id == run_id, LogChunk.attempt == number, LogChunk.node == node)
    if since_offset is not None:
        q = q.where(LogChunk.offset >= since_offset)
    chunks = list(session.scalars(q.order_by(LogChunk.offset)))
    text = "".join(c.text for c in chunks)
    end = chunks[-1].end if chunks else (since_offset or 0)
    lines = text.splitlines()
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    return number, att.log_path, lines, end


def evaluations(run: Run) -> list[dict[str, Any]]:
    """Every attempt's acceptance report, oldest first."""
    return [{"attempt": a.number, "ttt_steps": eta.ttt_of(a.spec), **a.evaluation}
            for a in run.attempts if a.evaluation]


def run_advice(session: Session, run_id: str, interconnect: str, tp: int, attempt: int | None = None) -> dict[str, Any]:
    """The depth advice for a run's evaluated draft, with predicted retraining times from its measured pace."""
    from server.advice import advise

    run = get_run(session, run_id)
    reports = evaluations(run)
    if attempt is not None:
        reports = [r for r in reports if r["attempt"] == attempt]
    if not reports:
        raise NotFound(f"run {run_id} has no evaluation{f' for attempt {attempt}' if attempt else ''} yet: "
                       "give the trainer an eval_corpus, or run python -m trainer.evaluate")
    report = reports[-1]
    measured = measured_attempts(session, run)
    base = next(a.spec for a in run.attempts if a.number == report["attempt"])
    seconds_by_ttt = {}
    if base.get("trainer") and measured:
        for ttt in range(1, len(report["position_acceptance"]) + 1):
            spec = {**base, "trainer": {**base["trainer"], "ttt_steps": ttt}}
            seconds, _ = eta.predict_duration(measured, spec)
            if seconds is not None:
                seconds_by_ttt[ttt] = seconds
    try:
        out = advise(report, interconnect, tp, trained_ttt=report["ttt_steps"],
                     retrain_seconds_by_ttt=seconds_by_ttt or None)
    except ValueError as exc:
        raise Conflict(f"the evaluation of attempt {report['attempt']} cannot be advised on: {exc}") from None
    return {"attempt": report["attempt"], **out}
