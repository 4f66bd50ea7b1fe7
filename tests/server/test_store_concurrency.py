"""Two writers at once on the same run, on both stores: what several servers and workers sharing a PostgreSQL
database do all the time, and what one process on SQLite does between its threads."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx

from server.config import Settings
from server.db import Database
from server.lifecycle import RunStatus, load_run, transition
from server.models import Event, Run
from server.queries import events_after
from tests.inprocess import App
from worker.clock import Clock
from worker.lease_claimer import LeaseClaimer
from worker.notifier import WebhookNotifier
from worker.run_rows import fresh_run

# long enough for a writer that does not wait for the first to have committed on any machine
OVERLAP_SECONDS = 0.5


def _run(db: Database, status: RunStatus, run_id: str = "r1") -> str:
    with db.writing() as s:
        s.add(Run(id=run_id, name="r", status=status, spec={}, hosts=["local"], latest={}))
    return run_id


def _in_thread(work) -> tuple[threading.Thread, list]:  # noqa: ANN001
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    return thread, result


def test_a_reader_resuming_after_the_last_event_it_saw_misses_none_that_committed_late(db: Database) -> None:
    run_id = _run(db, RunStatus.RUNNING)

    def stall_event() -> int:
        with fresh_run(db, run_id) as (s, _):  # as the worker stores what it saw
            event = Event(run_id=run_id, kind="stall", data={"step": 1})
            s.add(event)
            s.flush()
            return event.id

    with db.writing() as first:
        # a transition whose event has its id and is not committed yet (the API's, say)
        transition(first, load_run(first, run_id), RunStatus.CANCELLING, "cancel requested")
        first.flush()
        other, stored = _in_thread(stall_event)  # the worker's, on another connection
        time.sleep(OVERLAP_SECONDS)
        with db.reading() as reader:
            seen, _ = events_after(reader, run_id, 0)  # an SSE stream's poll meanwhile
    other.join(30)
    last_seen = seen[-1].id if seen else 0
    with db.reading() as reader:
        later, _ = events_after(reader, run_id, last_seen)
    with db.reading() as s:
        stored_ids = [e.id for e in s.query(Event).filter_by(run_id=run_id).order_by(Event.id)]
    assert len(stored_ids) == 2 and stored[0] in stored_ids
    assert [e.id for e in seen + later] == stored_ids, "every event reaches the reader once, in id order"


def test_a_claim_never_takes_over_a_run_whose_row_another_writer_holds(db: Database) -> None:
    run_id = _run(db, RunStatus.RUNNING)
    clock = Clock()
    claimer = LeaseClaimer(db, "worker-b", lease_seconds=30, clock=clock)
    with db.writing() as first:
        # worker A's claim of the free run, not committed yet
        run = load_run(first, run_id)
        run.lease_owner, run.lease_until = "worker-a", clock.now() + timedelta(seconds=30)
        first.flush()
        other, claimed = _in_thread(claimer.run_once)
        time.sleep(OVERLAP_SECONDS)
    other.join(30)
    assert claimed == [[]], "worker B claimed a run worker A was claiming"
    with db.reading() as s:
        assert s.get(Run, run_id).lease_owner == "worker-a"
    assert claimer.run_once() == [], "and A's lease, once committed, keeps B away"


def test_the_webhook_notifier_sees_every_end_when_two_runs_end_at_once(db: Database, tmp_path) -> None:  # noqa: ANN001
    first_run, second_run = _run(db, RunStatus.RUNNING, "r1"), _run(db, RunStatus.RUNNING, "r2")
    # nothing listens there: what is queued is what this test reads, the posts just fail
    notifier = WebhookNotifier(db, Settings(home=tmp_path, webhook_url="http://127.0.0.1:9/hook", webhook_tries=1))

    def second_fails() -> None:
        with fresh_run(db, second_run) as (s, run):  # another worker thread, on the other run
            transition(s, run, RunStatus.FAILED, "exit 1")

    try:
        with db.writing() as first:
            transition(first, load_run(first, first_run), RunStatus.SUCCEEDED, "done")
            first.flush()
            other, _ = _in_thread(second_fails)
            time.sleep(OVERLAP_SECONDS)
            queued = notifier.run_once()  # the notifier's tick meanwhile
        other.join(30)
        queued += notifier.run_once()
    finally:
        notifier.close()
    assert sorted((n.run_id, n.event) for n in queued) == [(first_run, "succeeded"), (second_run, "failed")]


def test_submits_with_one_idempotency_key_sent_at_once_make_one_run(api: App) -> None:
    # the API's writes run at once on PostgreSQL (server/db.py API_WRITERS), one after another on SQLite
    spec = {"name": "once", "host": "local", "entrypoint": "/opt/train.py", "nproc_per_node": 1}

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/runs", json=spec, headers={"Idempotency-Key": "k"})
                                          for _ in range(20)))

    with ThreadPoolExecutor(1) as pool:  # on a thread of its own: a test before may leave a loop running here
        answers = pool.submit(asyncio.run, scenario()).result()
    assert sorted(r.status_code for r in answers) == [200] * 19 + [201], [r.text[:200] for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert len(api.client.get("/v1/runs").json()["items"]) == 1
