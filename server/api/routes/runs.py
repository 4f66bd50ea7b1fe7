import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, Header, Query, Response, status
from pydantic import Field
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from server import feeds, hosts, proposal, queries, runs, tracebacks, views
from server.api.deps import DB, ReadSession
from server.api.run_ref import NOTE_HEADER, RUN_ID_PATH, RunRef, noted
from server.db import WRITE_WAIT_SECONDS, Database
from server.errors import NotFound, Unavailable
from server.lifecycle import RunStatus
from server.models import Run
from server.schemas import (
    DryRunPublic,
    EvaluationPublic,
    LogsPublic,
    MetricsPublic,
    RestartRequest,
    RunAdvicePublic,
    RunCreate,
    RunPage,
    RunPublic,
    TracebackPublic,
)
from server.wakeup import workers_listening

router = APIRouter(prefix="/runs", tags=["runs"])
T = TypeVar("T")
# how long a submit waits for a worker to say whether a trainer's inputs are on the host, and how often it looks
PATHS_WAIT_SECONDS = 10.0
PATHS_POLL_SECONDS = 0.05

NOT_FOUND = {404: {"description": "no such run"}}

# every integer a client sends is held to what the database compares without overflowing (SQLite's integers are
# 64-bit, PostgreSQL's INTEGER columns 32-bit): past it, a 422 naming the parameter, never an OverflowError's 500
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
Step = Annotated[int | None, Query(ge=-INT32_MAX, le=INT32_MAX)]
AttemptNumber = Annotated[int | None, Query(ge=1, le=INT32_MAX)]
CONFLICT = {409: {"description": "the run's state does not allow it; `status` says which it is in"}}


def _public(session: Session, run: Run) -> RunPublic:
    """The run's response, loading the earlier attempts its ETA needs (one query, only when it does)."""
    return views.run_public(run, queries.pace_history_for(session, [run]), session.info.get("write_failure"))


@router.post("", status_code=status.HTTP_201_CREATED,
             responses={200: {"model": RunPublic, "description": "the run an earlier request with this "
                              "Idempotency-Key created"},
                        409: {"description": "a live run has this name (`status` is its state), or the "
                              "Idempotency-Key was used for another request"}})
async def submit_run(body: RunCreate, db: DB, idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
                     name_suffix: Annotated[bool, Query(description="when a live run has the name: name this one "
                                                        "NAME-2 (the first NAME-N no run has) instead of a 409")]
                     = False,
                     start: Annotated[Literal["fresh", "resume"] | None, Query(
                         description="trainer runs whose output_dir holds another run's checkpoint (else a 422): "
                         "resume it, or fresh, emptying the directory before the first attempt")] = None) -> RunPublic:
    """Queue a run. Its name is unique among live runs: a name a live run has is a 409 naming that run, unless
    `name_suffix`; an ended run's name may be given again (a name then resolves to its live run, else its newest)."""
    await _inputs_on_hosts(db, body)

    def submit(session: Session) -> tuple[str, bool]:
        run, created = runs.submit_run(session, body, idempotency_key, name_suffix, start)
        return _public(session, run).model_dump_json(), created

    text, created = await _write(db, submit)
    return Response(text, status_code=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
                    media_type="application/json")


async def _inputs_on_hosts(db: Database, spec: RunCreate) -> None:
    """A trainer run's input paths, looked for on each of its hosts in one call (a worker answers): one that is not
    there is a 422 naming the field. Where no worker listens or none answers within PATHS_WAIT_SECONDS (a host away),
    the submit goes on, and the launch finds out."""
    paths = sorted(set(runs.input_paths(spec).values()))
    if not paths or not await run_in_threadpool(workers_listening, db.engine):
        return
    for name in dict.fromkeys(spec.host_names):
        ident = await _write(db, partial(hosts.request_path_check, name=name, paths=paths))
        if ident is None:
            continue
        deadline = time.monotonic() + PATHS_WAIT_SECONDS
        while (found := await run_in_threadpool(_path_answer, db, name, ident)) is None:
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(PATHS_POLL_SECONDS)
        if "error" not in found:
            runs.refuse_missing_inputs(spec, name, found)


def _path_answer(db: Database, name: str, ident: str) -> dict | None:
    with db.reading() as s:
        return hosts.path_check_answer(s, name, ident)


async def _write(db: Database, work: Callable[[Session], T]) -> T:
    """`work` in a write transaction on the database's writer thread, in line with the API's other writes (a 503
    when its turn has not come within WRITE_WAIT_SECONDS; then it never runs)."""
    future = db.write_soon(work)
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), WRITE_WAIT_SECONDS)
    except TimeoutError:
        if future.cancel():
            raise Unavailable(f"the database is busy: no turn to write within {WRITE_WAIT_SECONDS:.0f}s; "
                              "try again") from None
        return await asyncio.wrap_future(future)  # begun meanwhile: its answer is the one


def _write_on_run(run_ref: str, response: Response, command: Callable[[Session, str], T]) -> Callable[[Session], T]:
    """A write of the run `run_ref` names, resolved inside the write transaction (no hop of its own)."""
    def work(session: Session) -> T:
        found, note = queries.resolve_run_ref(session, run_ref)
        noted(response, note)
        return command(session, found)

    return work


@router.get("")
def list_runs(session: ReadSession, status: RunStatus | None = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50, cursor: str | None = None) -> RunPage:
    items, next_cursor = queries.list_runs(session, status, limit, cursor)
    history = queries.pace_history_for(session, items)
    failure = session.info.get("write_failure")
    return RunPage(items=[views.run_public(r, history, failure) for r in items], next_cursor=next_cursor)


@router.get("/{run_id}", response_model=RunPublic, responses=NOT_FOUND)
async def get_run(run_id: str, db: DB) -> Response:
    # the hot path of every watcher: one hop to a thread for the whole read (a sync route and its session would
    # take three), serialised once, skipping FastAPI's second validation pass
    def body() -> tuple[str, str | None]:
        with db.reading() as session:
            found, note = queries.resolve_run_ref(session, run_id)
            return _public(session, queries.get_run(session, found)).model_dump_json(), note

    text, note = await run_in_threadpool(body)
    response = Response(text, media_type="application/json")
    noted(response, note)
    return response


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT})
async def delete_run(run_id: Annotated[str, RUN_ID_PATH], db: DB, response: Response) -> Response:
    """Forget an ended run with its attempts, metrics, logs and events (409 while it has not ended); the files
    its attempts left on the host stay."""
    await _write(db, _write_on_run(run_id, response, runs.delete_run))
    return _answer(None, status.HTTP_204_NO_CONTENT, response)


@router.post("/{run_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=RunPublic,
             responses={**NOT_FOUND, **CONFLICT})
async def cancel_run(run_id: Annotated[str, RUN_ID_PATH], db: DB, response: Response) -> Response:
    text = await _write(db, _write_on_run(run_id, response, lambda s, found: _public(
        s, runs.request_cancel(s, found)).model_dump_json()))
    return _answer(text, status.HTTP_202_ACCEPTED, response)


def _answer(text: str | None, code: int, noted_on: Response) -> Response:
    """An answer already serialised (JSON, or none), with the note set on the route's response."""
    answer = Response(text, status_code=code, media_type="application/json" if text is not None else None)
    note = noted_on.headers.get(NOTE_HEADER)
    if note:
        answer.headers[NOTE_HEADER] = note
    return answer


@router.post("/{run_id}/restart", status_code=status.HTTP_202_ACCEPTED,
             responses={200: {"model": DryRunPublic, "description": "dry run: the prediction, nothing changed"},
                        **NOT_FOUND, **CONFLICT})
async def restart_run(run_id: RunRef, db: DB, response: Response,
                      body: RestartRequest | None = None, dry_run: bool = False) -> RunPublic | DryRunPublic:
    req = body or RestartRequest()
    if dry_run:
        # changes nothing: a read, never in line for the write lock
        def predict() -> DryRunPublic:
            with db.reading() as session:
                return runs.dry_run_restart(session, run_id, req)

        response.status_code = status.HTTP_200_OK
        return await run_in_threadpool(predict)
    return await _write(db, lambda session: _public(session, runs.request_restart(session, run_id, req)))


class MetricsPage(MetricsPublic):
    next_cursor: str | None = Field(description="where the next answer starts: pass it as `cursor`, with the same "
                                    "other parameters; null once this answer holds the last point")


@router.get("/{run_id}/metrics", response_model=MetricsPage, responses=NOT_FOUND)
def get_metrics(run_id: RunRef, session: ReadSession, names: str | None = None, attempt: AttemptNumber = None,
                since_step: Step = None,
                limit: Annotated[int | None, Query(ge=1, le=queries.MAX_POINTS_PER_ANSWER)] = None,
                max_points: Annotated[int | None, Query(ge=2, le=queries.MAX_POINTS_PER_ANSWER)] = None,
                cursor: Annotated[str | None, Query(max_length=1024)] = None) -> Response:
    """Points by metric name, each series (a name in one attempt) in step order; at most `limit` points an answer
    (20000 at most), and `next_cursor` to pass as `cursor` for the rest.

    `max_points` thins each series to at most that many points, evenly spread, its first and last kept, and an
    answer then holds whole series. Without `limit` or `max_points`, series are thinned to DEFAULT_MAX_POINTS (2000)
    each, so a run of millions of points reads in a moment; ask for a `limit` to have every point, page by page."""
    wanted = [n for n in names.split(",") if n] if names else None
    if max_points is None and limit is None:
        max_points = queries.DEFAULT_MAX_POINTS
    page = queries.metric_page(session, run_id, wanted, attempt, since_step, limit, max_points, cursor)
    # serialised once (FastAPI would validate a returned model again): an answer is up to 20000 points
    return Response(MetricsPage(series=page.series, next_cursor=page.next_cursor).model_dump_json(),
                    media_type="application/json")


@router.get("/{run_id}/logs", responses=NOT_FOUND)
def get_logs(run_id: RunRef, session: ReadSession, tail: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
             attempt: AttemptNumber = None, since_offset: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None,
             node: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0) -> LogsPublic:
    number, path, page = queries.log_lines(session, run_id, attempt, tail, since_offset, node)
    return LogsPublic(attempt=number, log_path=path, lines=page.lines, next_offset=page.next_offset,
                      dropped_bytes=page.dropped, more=page.more)


@router.get("/{run_id}/traceback", responses={404: {"description": "no such run or attempt, or that rank did "
                                                "not fail in it (the answer says which did)"}})
def get_traceback(run_id: RunRef, session: ReadSession, rank: Annotated[int, Query(ge=0, le=INT32_MAX)],
                  attempt: AttemptNumber = None) -> TracebackPublic:
    """A failed rank's traceback in the current attempt (or `attempt`), from torchrun's failure summary at the end of
    the log of the node it ran on."""
    number, node, failure = tracebacks.rank_traceback(session, queries.get_run(session, run_id), attempt, rank)
    return TracebackPublic(attempt=number, node=node, rank=failure.rank, root_cause=failure.root_cause,
                           traceback=failure.traceback)


@router.get("/{run_id}/evaluation", responses={404: {"description": "no such run, or not evaluated yet"}})
def get_evaluation(run_id: RunRef, session: ReadSession) -> EvaluationPublic:
    """The acceptance report of the run's newest evaluated draft, and every attempt's in `by_attempt`."""
    reports = views.evaluations(queries.get_run(session, run_id))
    if not reports:
        raise NotFound(f"run {run_id} has no evaluation yet")
    return EvaluationPublic(**dict(reports[-1]), by_attempt=reports)


@router.get("/{run_id}/advice", responses={404: {"description": "no such run or host, or not evaluated yet"},
                                           409: {"description": "the evaluation cannot be advised on, or the "
                                                 "deploy host has no table measured at this tp"}})
def get_advice(run_id: RunRef, session: ReadSession, interconnect: Literal["pcie", "nvlink"] | None = None,
               tp: Annotated[int | None, Query(ge=1, le=64)] = None,
               attempt: AttemptNumber = None,
               deploy_host: Annotated[str | None, Query(max_length=64)] = None,
               engine: Annotated[Literal["sglang", "vllm", "measured"] | None, Query(
                   description="the serving engine: sglang or vllm (V1: the draft sharded at the target's tp, "
                   "whatever draft_tp says; vllm/v1/spec_decode/eagle.py builds it with the target's config), "
                   "measured (round_ms as timed); unset: the draft's own collectives are not priced")] = None,
               topk: Annotated[int | None, Query(ge=1, le=64, description="with engine: 1 chain drafting, more a "
                                                 "tree of top-k per draft step")] = None,
               draft_tp: Annotated[int | None, Query(ge=1, le=64, description="with engine vllm: its "
                                                     "draft_tensor_parallel_size, which V1 checks and does not "
                                                     "apply (vllm#17499); a run's deploy.engine_version prices V0's "
                                                     "replicated draft")] = None,
               round_ms: Annotated[list[str] | None, Query(max_length=65, description="with engine measured, "
                                                           "repeated: DEPTH=MS, a round's cost as timed (0: "
                                                           "without speculation)")] = None) -> RunAdvicePublic:
    """Expected tokens/s per speculation depth on this interconnect, the depth to serve, and whether a deeper
    TTT retrain pays off (with its predicted training time from this run's measured steps).

    With deploy_host, the all-reduce times are the ones probe-interconnect measured there (tp defaults to the
    measured one, interconnect to its links); without, the built-in tables (nvlink, tp=8 by default). With
    engine, each round is priced the way that engine runs the draft and every depth shows its terms."""
    drafting = queries.advice_drafting(engine, topk, draft_tp, round_ms)
    return queries.run_advice(session, run_id, interconnect, tp, attempt, deploy_host, drafting)


@router.get("/{run_id}/proposal", responses=NOT_FOUND)
def get_proposal(run_id: RunRef, session: ReadSession) -> proposal.ProposalPublic:
    """After each validation: restart at a deeper TTT (with the dry run, the GPU-hours and the tokens/s gained on
    the spec's `deploy` host) or keep going; `action` unavailable says what is missing. Changes nothing."""
    run = queries.get_run(session, run_id)
    return proposal.current(session, run, queries.measured_attempts(session, run))


@router.post("/{run_id}/proposal/probe", status_code=status.HTTP_202_ACCEPTED, responses={**NOT_FOUND, **CONFLICT})
async def take_probe(run_id: RunRef, db: DB) -> RunPublic:
    """Take the probe the proposal offers (`probe`): the current checkpoint resumed at the candidate TTT for its N
    steps; at its validation the service decides on measured acceptance and the run continues as that says. A 409
    where the proposal offers none."""
    return await _write(db, lambda session: _public(session, proposal.take_probe_by_hand(session, run_id)))


@router.get("/{run_id}/events", response_class=EventSourceResponse,
            responses={200: {"content": {"text/event-stream": {}}}, **NOT_FOUND})
async def run_events(run_id: str, db: DB, last_event_id: Annotated[int | None, Header(ge=0, le=INT64_MAX)] = None) -> EventSourceResponse:
    """Server-Sent Events: `status`, `metrics`, `stall` and `proposal` events as they are stored; resumable with Last-Event-ID."""

    def resolve() -> tuple[str, str | None]:
        with db.reading() as s:
            return queries.resolve_run_ref(s, run_id)

    run_id, note = await run_in_threadpool(resolve)  # 404 before the stream starts

    async def stream():
        # every stream of this run reads from its one feed: one database read per interval, however many follow
        async for e in feeds.run_feed(db, run_id).follow(last_event_id or 0):
            yield ServerSentEvent(e.data, event=e.kind, id=str(e.id))

    # sse-starlette frames the events, sends a comment every `ping` seconds so proxies keep the stream open, and
    # ends the generator when the client goes away or the server shuts down
    answer = EventSourceResponse(stream(), ping=5, sep="\n", headers={"Cache-Control": "no-cache"})
    noted(answer, note)
    return answer
