from pathlib import Path

import pytest

from server.db import Database
from server.lifecycle import ACTIVE, ALLOWED, TERMINAL, RunStatus, TransitionError, transition
from server.models import Event, Run


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    database.migrate()
    return database


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
