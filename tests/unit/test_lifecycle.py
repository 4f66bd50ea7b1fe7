
import pytest

from server.db import Database
from server.lifecycle import (
    ACTIVE,
    ALLOWED,
    TERMINAL,
    AttemptStatus,
    NodeState,
    RunStatus,
    TransitionError,
    abandon_nodes,
    end_attempt,
    ended_badly,
    node_probed,
    nodes_launched,
    nodes_of,
    open_attempt,
    plan_nodes,
    transition,
)
from server.models import Attempt, Event, Run


def _run(db: Database, status: RunStatus) -> str:
    with db.writing() as s:
        s.add(Run(id="r1", name="r", status=status, spec={}, hosts=["local"], latest={}))
    return "r1"


def test_terminal_states_only_leave_through_restart() -> None:
    for state in TERMINAL:
        assert ALLOWED[state] == {RunStatus.RESTARTING}
    assert ACTIVE | TERMINAL == set(RunStatus)


def test_a_transition_records_an_event_and_end_time(db: Database) -> None:
    run_id = _run(db, RunStatus.RUNNING)
    with db.writing() as s:
        transition(s, s.get(Run, run_id), RunStatus.SUCCEEDED, "done")
    with db.reading() as s:
        run = s.get(Run, run_id)
        assert run.status == "succeeded" and run.ended_at is not None
        event = s.query(Event).one()
        assert event.data["from"] == "running" and event.data["to"] == "succeeded"


def test_a_forbidden_transition_changes_nothing(db: Database) -> None:
    run_id = _run(db, RunStatus.CANCELLED)
    with pytest.raises(TransitionError) as err, db.writing() as s:
        transition(s, s.get(Run, run_id), RunStatus.CANCELLING)
    assert err.value.current == RunStatus.CANCELLED
    with db.reading() as s:
        assert s.get(Run, run_id).status == "cancelled" and s.query(Event).count() == 0


def test_migrations_create_exactly_the_models_schema(db: Database) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from server.models import Base

    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], "the models changed without a migration: add one in migrations/versions/"


@pytest.mark.both_stores
def test_an_attempt_given_up_on_before_the_abandoned_column_keeps_its_mark(empty_database_url: str) -> None:
    from sqlalchemy import text

    from server.db import upgrade

    url = empty_database_url
    upgrade(url, "0001")
    old = Database(url)
    with old.engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, status, spec, hosts, attempt, max_retries, retries_used, "
                          "clean_pending, host_reachable, latest, created_at, updated_at) VALUES ('r1', 'r', "
                          "'failed', '{}', '[\"a\"]', 2, 0, 0, :no, :yes, '{}', '2026-01-01', '2026-01-01')"),
                     {"no": False, "yes": True})
        for number, state in ((1, "abandoned"), (2, "exited")):
            nodes = f'[{{"host": "a", "dir": "/ws/.longrun/r1/{number}", "state": "{state}"}}]'
            conn.execute(text("INSERT INTO attempts (run_id, number, spec, status, token, created_at, nodes, "
                              f"metrics_lines) VALUES ('r1', {number}, '{{}}', 'failed', 't', '2026-01-01', "
                              f":nodes, 0)"), {"nodes": nodes})
    old.dispose()
    upgraded = Database(url)
    upgraded.migrate()
    with upgraded.reading() as s:
        assert [(a.number, a.abandoned) for a in s.query(Attempt).order_by(Attempt.number)] == [(1, True), (2, False)]


def test_node_states_are_typed_and_the_abandoned_mark_follows_them(db: Database) -> None:
    run_id = _run(db, RunStatus.RUNNING)
    with db.writing() as s:
        run = s.get(Run, run_id)
        attempt = open_attempt(s, run, {}, 1)
        plan_nodes(attempt, [("a", "/ws/.longrun/r1/1"), ("b", "/ws/.longrun/r1/1/node1")])
        nodes_launched(attempt, [10, 20], [[0], None])
        node_probed(attempt, 1, 5, 7, NodeState.EXITED, 0, (0, False))
        abandon_nodes(attempt)
    with db.reading() as s:
        attempt = s.query(Attempt).one()
        first, second = nodes_of(attempt)
        assert (first.state, first.pid, first.gpus) == (NodeState.ABANDONED, 10, [0])
        assert (second.state, second.exit_code, second.metrics_offset, second.log_offset) == (NodeState.EXITED, 0, 5, 7)
        assert attempt.abandoned and attempt.nodes[0]["state"] == "abandoned"


def test_an_attempt_ends_once(db: Database) -> None:
    run_id = _run(db, RunStatus.RUNNING)
    with db.writing() as s:
        attempt = open_attempt(s, s.get(Run, run_id), {}, 1)
        end_attempt(attempt, AttemptStatus.CANCELLED, None, "cancelled on request")
        end_attempt(attempt, AttemptStatus.FAILED, 1, "too late")
        assert (attempt.status, attempt.message) == ("cancelled", "cancelled on request")


def test_only_nodes_that_vanished_or_exited_non_zero_fail_their_attempt() -> None:
    assert ended_badly(NodeState.LOST, None) and ended_badly(NodeState.MISSING, None)
    assert ended_badly(NodeState.EXITED, 1) and not ended_badly(NodeState.EXITED, 0)
    assert not ended_badly(NodeState.RUNNING, None)
