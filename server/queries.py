"""Run queries: what the API reads, each taking the caller's session. Nothing here writes."""

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, joinedload, selectinload

from server import eta, hosts, log_reads, pace, views
from server.advisor import CostModel, Drafting, advise
from server.errors import Conflict, FieldError, NotFound
from server.lifecycle import TERMINAL
from server.models import Attempt, Event, MetricPoint, Run
from server.retrain_time import retrain_seconds
from server.schemas import RunAdvicePublic

# how many recent measured attempts a prediction without a measurement of its own looks through
PACE_HISTORY_LIMIT = 50
# GET /v1/runs/{id}/metrics: the most points one answer holds (a caller follows next_cursor for the rest), and how
# many points each series is thinned to when the caller asks for neither a limit nor max_points
MAX_POINTS_PER_ANSWER = 20_000
DEFAULT_MAX_POINTS = 2000


# an id prefix shorter than this is too likely to match by accident (ids are 12 hex digits)
MIN_ID_PREFIX = 4
ID_CHARS = frozenset("0123456789abcdef")
MAX_CANDIDATES = 10


def resolve_run_id(session: Session, ref: str) -> str:
    """The id of the run that `ref` names (resolve_run_ref, without its note)."""
    return resolve_run_ref(session, ref)[0]


def _candidates(runs: list[Run]) -> str:
    listed = sorted(runs, key=lambda r: r.created_at, reverse=True)
    return "; ".join(f"{r.id} {r.name} ({r.status}, {r.created_at:%Y-%m-%d %H:%M})" for r in listed[:MAX_CANDIDATES])


def resolve_run_ref(session: Session, ref: str) -> tuple[str, str | None]:
    """The id of the run that `ref` names, and a note when a name chose among several runs.

    `ref` is an id, a unique prefix of one, or a name. A name is unique among live runs (server/runs.py refuses a
    second live one), so it names its live run; with none live, the newest of the ended runs of that name, the
    note saying which others it has. NotFound when nothing matches; Conflict listing the candidates when an id
    prefix matches several runs, or a name too, or a name several live runs (submitted before names were unique)."""
    if session.scalar(select(Run.id).where(Run.id == ref)) is not None:
        return ref, None
    prefixed: list[Run] = []
    if len(ref) >= MIN_ID_PREFIX and set(ref) <= ID_CHARS:
        prefixed = list(session.scalars(
            select(Run).where(Run.id.startswith(ref)).order_by(Run.created_at.desc()).limit(MAX_CANDIDATES + 1)))
    named = list(session.scalars(
        select(Run).where(Run.name == ref).order_by(Run.created_at.desc(), Run.id).limit(MAX_CANDIDATES + 1)))
    found = {r.id: r for r in [*prefixed, *named]}
    if len(found) == 1:
        return next(iter(found)), None
    if not found:
        raise NotFound(f"no run with id {ref!r} (nor one with that id prefix or name)")
    if named and not prefixed:
        live = [r for r in named if r.status not in TERMINAL]
        if len(live) == 1:
            return live[0].id, None
        if not live:
            newest, *others = named
            more = " and more" if len(named) > MAX_CANDIDATES else ""
            return newest.id, (f"{ref!r} names {len(named) if not more else 'more than ' + str(MAX_CANDIDATES)} "
                               f"ended runs: this is the newest, {newest.id} ({newest.status}, "
                               f"{newest.created_at:%Y-%m-%d %H:%M}); the others: {_candidates(others)}{more}; give "
                               "an id to name one of them")
        found = {r.id: r for r in live}
    more = " and more" if len(found) > MAX_CANDIDATES else ""
    raise Conflict(f"{ref!r} names {len(found) if not more else 'more than ' + str(MAX_CANDIDATES)} runs: "
                   f"{_candidates(list(found.values()))}{more}; give the id (or a longer prefix of it)")


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


@dataclass(frozen=True)
class MetricsPage:
    """One answer of GET /v1/runs/{id}/metrics: points by name, and where the next answer starts (None: the end)."""

    series: dict[str, list[dict[str, Any]]]
    next_cursor: str | None


# a cursor names where the next answer starts: "s" the next whole series (name, attempt) of a thinned read, "p" the
# last point (name, attempt, step, id) of a read of every point; it is the client's, so it is checked as input
_THINNED, _POINTS = "s", "p"
_INT64 = 2**63 - 1


def _cursor(*key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode().rstrip("=")


def _read_cursor(cursor: str, mode: str) -> tuple[Any, ...]:
    def bad(why: str) -> FieldError:
        return FieldError(("query", "cursor"), f"not a cursor this read gave ({why}): pass next_cursor as it came, "
                          "with the same names, attempt, since_step, limit and max_points", cursor[:200])

    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, UnicodeDecodeError):
        raise bad("unreadable") from None
    shape = (str, str, int) if mode == _THINNED else (str, str, int, (int, type(None)), int)
    if not isinstance(key, list) or len(key) != len(shape) or key[0] != mode:
        raise bad("another kind of read" if isinstance(key, list) and key[:1] in ([_THINNED], [_POINTS]) else
                  "unreadable")
    for value, kind in zip(key, shape, strict=True):
        if not isinstance(value, kind) or isinstance(value, bool) or (
                isinstance(value, int) and not -_INT64 <= value <= _INT64) or (isinstance(value, str) and len(value) > 256):
            raise bad("unreadable")
    return tuple(key[1:])


def _series_from(session: Session, filters: list[Any], names: list[str] | None, attempt: int | None,
                 first: tuple[str, int] | None) -> Iterator[tuple[str, int]]:
    """The series (name, attempt) of the run in that order from `first` on (inclusive), each found by a seek in the
    series index, never by reading the points of all of them."""
    wanted = sorted(set(names)) if names else None
    name, number = first if first else (None, None)
    while True:
        if name is not None and (wanted is None or name in wanted):
            q = select(MetricPoint.attempt).where(*filters, MetricPoint.name == name)
            if number is not None:
                q = q.where(MetricPoint.attempt >= number)
            found = session.scalar(q.order_by(MetricPoint.attempt).limit(1))
            if found is not None:
                yield name, found
                if attempt is not None:
                    number = None  # one attempt a name: on to the next name
                else:
                    number = found + 1
                    continue
        q = select(MetricPoint.name).where(*filters)
        if name is not None:
            q = q.where(MetricPoint.name > name)
        if wanted is not None:
            q = q.where(MetricPoint.name.in_(wanted))
        name, number = session.scalar(q.order_by(MetricPoint.name).limit(1)), None
        if name is None:
            return


_FIELDS = (MetricPoint.name, MetricPoint.attempt, MetricPoint.step, MetricPoint.value, MetricPoint.time,
           MetricPoint.id)


def _points_after(session: Session, where: list[Any], after: tuple[int | None, int] | None, limit: int) -> list[Any]:
    """Up to `limit` points of one series in step order (points without a step first, each part in id order), after
    the point `after` (its step, id) when given: each part read along the series index, from where the last ended."""
    step = MetricPoint.step
    if after is None:
        parts = [((step.is_(None),), (MetricPoint.id,)), ((step.is_not(None),), (step, MetricPoint.id))]
    elif after[0] is None:
        parts = [((step.is_(None), MetricPoint.id > after[1]), (MetricPoint.id,)),
                 ((step.is_not(None),), (step, MetricPoint.id))]
    else:
        parts = [((step == after[0], MetricPoint.id > after[1]), (MetricPoint.id,)),
                 ((step > after[0],), (step, MetricPoint.id))]
    rows: list[Any] = []
    for conditions, order in parts:
        if len(rows) >= limit:
            break
        # Core, not the ORM: plain rows, a page of 20,000 points in 40 % less time
        rows += session.connection().execute(select(*_FIELDS).where(*where, *conditions).order_by(*order)
                                             .limit(limit - len(rows))).all()
    return rows


def _thinned(session: Session, where: list[Any], n: int, max_points: int) -> list[Any]:
    """`max_points` of a series of `n` points, evenly by position in step order, its first and last kept; positions
    are counted over the series index alone (covering: no point is loaded but those kept)."""
    position = func.row_number().over(order_by=(MetricPoint.step, MetricPoint.id)).label("n")
    ranked = select(MetricPoint.id, position).where(*where).subquery()
    stride = -(-n // (max_points - 1))  # every stride-th from the first, and the last: at most max_points
    kept = select(ranked.c.id).where(((ranked.c.n - 1) % stride == 0) | (ranked.c.n == n))
    return session.connection().execute(select(*_FIELDS).where(MetricPoint.id.in_(kept))
                                        .order_by(MetricPoint.step, MetricPoint.id)).all()


def metric_page(session: Session, run_id: str, names: list[str] | None, attempt: int | None, since_step: int | None,
                limit: int | None, max_points: int | None, cursor: str | None = None) -> MetricsPage:
    """The run's points by name, series (a name in one attempt) in (name, attempt) order, each in step order; at
    most `limit` points in the answer (MAX_POINTS_PER_ANSWER at most), `next_cursor` where the next one starts.

    With max_points, each series of more points is thinned to at most that many (at most `limit`), evenly by
    position, its first and last points kept, and an answer holds whole series. Without, every point, an answer
    ending anywhere in a series. Each answer reads only what it holds (and one count a series when thinned), so a
    run of any size costs the same memory an answer."""
    get_run(session, run_id)
    cap = min(limit or MAX_POINTS_PER_ANSWER, MAX_POINTS_PER_ANSWER)
    filters = [MetricPoint.run_id == run_id]
    if attempt is not None:
        filters.append(MetricPoint.attempt == attempt)
    series: dict[str, list[dict[str, Any]]] = {}

    def keep(rows: list[Any]) -> None:
        for name, number, step, value, when, _ in rows:
            series.setdefault(name, []).append({"attempt": number, "step": step, "value": value, "time": when})

    if since_step is not None:
        filters.append(MetricPoint.step > since_step)
    if max_points is not None:
        if cap < 2:
            raise FieldError(("query", "limit"), "a thinned read keeps each series' first and last points: give "
                             "limit 2 or more with max_points (or no max_points for every point)", limit)
        per_series = min(max_points, cap)
        first = _read_cursor(cursor, _THINNED) if cursor else None
        left = cap
        for name, number in _series_from(session, filters, names, attempt, first):
            where = [*filters, MetricPoint.name == name, MetricPoint.attempt == number]
            n = session.scalar(select(func.count()).where(*where)) or 0
            if min(n, per_series) > left:
                return MetricsPage(series, _cursor(_THINNED, name, number))
            keep(_points_after(session, where, None, n) if n <= per_series else _thinned(session, where, n, per_series))
            left -= min(n, per_series)
        return MetricsPage(series, None)
    after = _read_cursor(cursor, _POINTS) if cursor else None
    left = cap
    for name, number in _series_from(session, filters, names, attempt, after[:2] if after else None):
        where = [*filters, MetricPoint.name == name, MetricPoint.attempt == number]
        here = tuple(after[2:]) if after and (name, number) == after[:2] else None
        rows = _points_after(session, where, here, left + 1)
        if len(rows) > left:  # more of this series than the answer holds: the next answer goes on after its last
            keep(rows[:left])
            if not left:  # the answer filled up with the series before: the next starts at this one's first point
                return MetricsPage(series, _cursor(_POINTS, name, number, None, -1))
            last = rows[left - 1]
            return MetricsPage(series, _cursor(_POINTS, last[0], last[1], last[2], last[5]))
        keep(rows)
        left -= len(rows)
    return MetricsPage(series, None)


def log_lines(session: Session, run_id: str, attempt: int | None, tail: int | None,
              since_offset: int | None, node: int = 0) -> tuple[int, str | None, log_reads.LogPage]:
    """Lines of an attempt's log as ingested from the host, within a bound per answer (server/log_reads.py);
    returns (attempt, path, page)."""
    run = get_run(session, run_id)
    number = attempt or run.attempt
    att = next((a for a in run.attempts if a.number == number), None)
    if att is None:
        raise NotFound(f"run {run_id} has no attempt {number}")
    return number, att.log_path, log_reads.read_log(session, run_id, number, node, tail, since_offset)


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
    seconds_by_ttt = retrain_seconds(measured, base, len(report.position_acceptance))
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
