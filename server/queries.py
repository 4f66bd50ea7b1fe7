"""Run queries: what the API reads, each taking the caller's session. Nothing here writes."""

from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session, joinedload, selectinload

from server import eta, hosts, pace, proposal, views
from server.advisor import CostModel, Drafting, advise
from server.errors import Conflict, FieldError, NotFound
from server.models import Attempt, Event, LogChunk, MetricPoint, Run
from server.schemas import RunAdvicePublic

# how many recent measured attempts a prediction without a measurement of its own looks through
PACE_HISTORY_LIMIT = 50
# GET /v1/runs/{id}/metrics: the points of one answer unless the caller asks for a limit, and how many points
# each series is thinned to when the caller asks for neither a limit nor max_points
MAX_POINTS_PER_ANSWER = 100_000
DEFAULT_MAX_POINTS = 2000


# an id prefix shorter than this is too likely to match by accident (ids are 12 hex digits)
MIN_ID_PREFIX = 4
ID_CHARS = frozenset("0123456789abcdef")
MAX_CANDIDATES = 10


def resolve_run_id(session: Session, ref: str) -> str:
    """The id of the run that `ref` names: its id, a unique prefix of its id, or its unique name. NotFound when
    none matches; Conflict listing the candidates when several do."""
    if session.scalar(select(Run.id).where(Run.id == ref)) is not None:
        return ref
    found: dict[str, Run] = {}
    if len(ref) >= MIN_ID_PREFIX and set(ref) <= ID_CHARS:
        found.update((r.id, r) for r in session.scalars(
            select(Run).where(Run.id.startswith(ref)).order_by(Run.created_at.desc()).limit(MAX_CANDIDATES + 1)))
    found.update((r.id, r) for r in session.scalars(
        select(Run).where(Run.name == ref).order_by(Run.created_at.desc()).limit(MAX_CANDIDATES + 1)))
    if len(found) == 1:
        return next(iter(found))
    if not found:
        raise NotFound(f"no run with id {ref!r} (nor one with that id prefix or name)")
    listed = sorted(found.values(), key=lambda r: r.created_at, reverse=True)
    names = "; ".join(f"{r.id} {r.name} ({r.status}, {r.created_at:%Y-%m-%d %H:%M})" for r in listed[:MAX_CANDIDATES])
    more = " and more" if len(listed) > MAX_CANDIDATES else ""
    raise Conflict(f"{ref!r} names {len(listed) if not more else 'more than ' + str(MAX_CANDIDATES)} runs: {names}"
                   f"{more}; give the id (or a longer prefix of it)")


def get_run(session: Session, run_id: str) -> Run:
    """The run with its attempts; in a write transaction on a server database, row-locked until commit."""
    if session.info.get("lock_rows"):
        # FOR UPDATE does not go with an outer join everywhere: the attempts come in a second query
        query = select(Run).options(selectinload(Run.attempts)).with_for_update(of=Run)
    else:
        # one query on the read path every watcher polls
        query = select(Run).options(joinedload(Run.attempts))
    run = session.scalars(query.where(Run.id == run_id)).unique().one_or_none()
    if run is None:
        raise NotFound(f"no run with id {run_id!r}")
    return run


def list_runs(session: Session, status: str | None, limit: int, cursor: str | None) -> tuple[list[Run], str | None]:
    """Newest first, attempts loaded; the cursor is the last run's (created_at, id) so pages stay stable."""
    q = select(Run).options(selectinload(Run.attempts)).order_by(Run.created_at.desc(), Run.id.desc())
    if status:
        q = q.where(Run.status == status)
    if cursor:
        anchor = session.get(Run, cursor)
        if anchor is None:
            raise FieldError(("cursor",), f"unknown cursor {cursor!r}")
        q = q.where((Run.created_at < anchor.created_at) |
                    ((Run.created_at == anchor.created_at) & (Run.id < anchor.id)))
    runs = list(session.scalars(q.limit(limit + 1)))
    more = len(runs) > limit
    runs = runs[:limit]
    return runs, (runs[-1].id if more and runs else None)


def pace_history(session: Session, limit: int = PACE_HISTORY_LIMIT) -> list[pace.PastAttempt]:
    """The newest attempts with a measured pace, with their runs' hosts: one query."""
    rows = session.execute(
        select(Attempt, Run.hosts).join(Run).where(Attempt.sec_per_step.is_not(None),
                                                   Attempt.total_steps.is_not(None))
        .order_by(Attempt.created_at.desc()).limit(limit)).all()
    return [pace.PastAttempt(a.run_id, hosts, pace.measured(a)) for a, hosts in rows]


def pace_history_for(session: Session, runs: list[Run]) -> list[pace.PastAttempt]:
    """What building responses for `runs` needs from earlier attempts: one query, or none when no run does."""
    return pace_history(session) if any(views.needs_pace_history(r) for r in runs) else []


def measured_attempts(session: Session, run: Run) -> list[eta.Measured]:
    """This run's attempts with a measured pace, newest first; else similar runs on the same hosts."""
    return pace.own_paces(run) or pace.similar_paces(pace_history(session), run.typed_spec, exclude_run=run.id)


def metric_series(session: Session, run_id: str, names: list[str] | None, attempt: int | None,
                  since_step: int | None, limit: int, max_points: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """The run's points by name, each series in the order its lines were written, at most `limit` in all.

    With max_points, a series (a name in one attempt) of more points is thinned to at most that many, evenly
    by position in step order, its first and last points kept; the database picks them from the series index,
    and only the points kept are loaded."""
    get_run(session, run_id)
    filters = [MetricPoint.run_id == run_id]
    if names:
        filters.append(MetricPoint.name.in_(names))
    if attempt is not None:
        filters.append(MetricPoint.attempt == attempt)
    if since_step is not None:
        filters.append(MetricPoint.step > since_step)
    fields = (MetricPoint.name, MetricPoint.attempt, MetricPoint.step, MetricPoint.value, MetricPoint.time)
    big: dict[tuple[str, int], int] = {}
    if max_points is not None:
        counts = session.execute(select(MetricPoint.name, MetricPoint.attempt, func.count()).where(*filters)
                                 .group_by(MetricPoint.name, MetricPoint.attempt))
        big = {(name, number): n for name, number, n in counts if n > max_points}
    rows: dict[tuple[str, int], list[Any]] = {}
    q = select(*fields).where(*filters)
    if big:
        q = q.where(tuple_(MetricPoint.name, MetricPoint.attempt).not_in(list(big)))
    for row in session.execute(q.order_by(MetricPoint.name, MetricPoint.attempt, MetricPoint.line, MetricPoint.id)
                               .limit(limit)):
        rows.setdefault((row[0], row[1]), []).append(row)
    for (name, number), n in big.items():
        # positions counted over the series index alone (covering: no point is loaded but those kept)
        position = func.row_number().over(order_by=(MetricPoint.step, MetricPoint.id)).label("n")
        ranked = select(MetricPoint.id, position).where(*filters, MetricPoint.name == name,
                                                        MetricPoint.attempt == number).subquery()
        stride = -(-n // (max_points - 1))  # every stride-th from the first, and the last: at most max_points
        kept = select(ranked.c.id).where(((ranked.c.n - 1) % stride == 0) | (ranked.c.n == n))
        rows[name, number] = list(session.execute(select(*fields).where(MetricPoint.id.in_(kept))
                                                  .order_by(MetricPoint.step, MetricPoint.id)))
    out: dict[str, list[dict[str, Any]]] = {}
    left = limit
    for key in sorted(rows):
        for name, number, step, value, when in rows[key][:left]:
            out.setdefault(name, []).append({"attempt": number, "step": step, "value": value, "time": when})
        left -= min(left, len(rows[key]))
    return out


def log_lines(session: Session, run_id: str, attempt: int | None, tail: int | None,
              since_offset: int | None, node: int = 0) -> tuple[int, str | None, list[str], int, int]:
    """Lines of an attempt's log as ingested from the host; returns (attempt, path, lines, next_offset, bytes
    asked for that were dropped as the log outgrew what is kept)."""
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
    # the worker keeps a log's tail only (worker/ingest.py): what was asked for before it is gone
    dropped = chunks[0].offset - (since_offset or 0) if chunks else 0
    lines = text.splitlines()
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    return number, att.log_path, lines, end, dropped


def events_after(session: Session, run_id: str, after: int, limit: int = 500) -> tuple[list[Event], str]:
    """The run's events with an id above `after`, oldest first, and its status now."""
    run = get_run(session, run_id)
    events = list(session.scalars(select(Event).where(Event.run_id == run_id, Event.id > after)
                                  .order_by(Event.id).limit(limit)))
    return events, run.status


def advice_drafting(engine: str | None, topk: int | None, draft_tp: int | None,
                    round_ms: list[str] | None) -> Drafting | None:
    """The advice's serving engine from its query parameters (None: no engine); FieldError naming the parameter."""
    if engine is None:
        given = next((name for name, value in (("topk", topk), ("draft_tp", draft_tp), ("round_ms", round_ms))
                      if value is not None), None)
        if given:
            raise FieldError(("query", given), f"{given} prices the draft the way an engine runs it: give engine "
                             "(sglang, vllm or measured) with it", {"topk": topk, "draft_tp": draft_tp,
                                                                    "round_ms": round_ms}[given])
        return None
    if draft_tp is not None and engine != "vllm":
        raise FieldError(("query", "draft_tp"), "draft_tp is vLLM's draft_tensor_parallel_size: give it with "
                         "engine vllm (SGLang runs the draft at the target's tp)", draft_tp)
    if (round_ms is not None) != (engine == "measured"):
        raise FieldError(("query", "round_ms"), "round_ms goes with engine measured, and engine measured needs it: "
                         "DEPTH=MS, repeated (e.g. round_ms=0=20.5&round_ms=3=24.1)", round_ms)
    timed: dict[int, float] = {}
    for item in round_ms or []:
        depth, _, ms = item.partition("=")
        try:
            timed[int(depth)] = float(ms)
        except ValueError:
            raise FieldError(("query", "round_ms"), f"want DEPTH=MS, e.g. 3=24.1; got {item!r}", item) from None
        if not 0 <= int(depth) <= 64:
            raise FieldError(("query", "round_ms"), f"the depth is 0..64; got {item!r}", item)
    try:
        return Drafting(engine=engine, topk=topk or 1, draft_tp=draft_tp, round_ms=timed or None)
    except ValueError as exc:
        raise FieldError(("query", "round_ms" if engine == "measured" else "engine"), str(exc), engine) from None


def run_advice(session: Session, run_id: str, interconnect: str | None, tp: int | None, attempt: int | None = None,
               deploy_host: str | None = None, drafting: Drafting | None = None) -> RunAdvicePublic:
    """The depth advice for a run's evaluated draft, with predicted retraining times from its measured pace;
    with deploy_host, on the all-reduce table measured there; with drafting, priced the way that engine runs
    the draft."""
    run = get_run(session, run_id)
    reports = views.evaluations(run)
    if attempt is not None:
        reports = [r for r in reports if r.attempt == attempt]
    if not reports:
        raise NotFound(f"run {run_id} has no evaluation{f' for attempt {attempt}' if attempt else ''} yet: "
                       "give the trainer an eval_corpus, or run python -m trainer.evaluate")
    report = reports[-1]
    cost = basis = None
    if deploy_host is not None:
        tp, links, table, basis = hosts.measured_allreduce(session, deploy_host, tp)
        if interconnect is not None and links is not None and interconnect != links:
            raise Conflict(f"{deploy_host}'s GPUs are linked by {links}, not {interconnect}: leave out interconnect "
                           "to use what was measured there")
        interconnect = interconnect or links or "pcie"
        cost = CostModel.for_interconnect(interconnect, tp, allreduce_us=table) if table else None
    interconnect, tp = interconnect or "nvlink", tp or 8
    measured = measured_attempts(session, run)
    base = next(a.typed_spec for a in run.attempts if a.number == report.attempt)
    seconds_by_ttt = proposal.retrain_seconds(measured, base, len(report.position_acceptance))
    if drafting is not None:
        try:
            drafting.sharded(tp)
        except ValueError as exc:
            raise FieldError(("query", "draft_tp"), str(exc), drafting.draft_tp) from None
    try:
        advice = advise(report.model_dump(), interconnect, tp, cost, trained_ttt=report.ttt_steps,
                        retrain_seconds_by_ttt=seconds_by_ttt or None, allreduce_basis=basis if tp > 1 else None,
                        drafting=drafting)
    except ValueError as exc:
        raise Conflict(f"the evaluation of attempt {report.attempt} cannot be advised on: {exc}") from None
    return RunAdvicePublic(attempt=report.attempt, deploy_host=deploy_host,
                           allreduce_source="deploy host" if deploy_host else "built-in default", **dict(advice))
