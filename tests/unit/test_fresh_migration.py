"""A SQLite database is migrated whole or not at all: SQLite's DDL ran outside a transaction under alembic, so a
kill landed between two migrations (here by alembic's own hook, not by timing) once left a schema half made that no
later start could finish. The whole upgrade is now one transaction (migrations/env.py)."""

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from server.db import Database, alembic_config, upgrade

HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


class Killed(BaseException):
    """What a kill -9 is to the migrating process: nothing after it runs (BaseException: no handler catches it)."""


def test_a_migration_killed_halfway_leaves_no_schema_and_the_next_start_makes_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "longrun.sqlite"
    applied = []

    def kill_after_the_third(step, heads, run_args, **kw) -> None:  # alembic's on_version_apply
        applied.append(step.up_revision_id)
        if len(applied) == 3:
            raise Killed

    with pytest.raises(Killed):
        upgrade(f"sqlite:///{path}", on_version_apply=kill_after_the_third)
    assert applied == ["0001", "0002", "0003"]
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        assert inspect(c).get_table_names() == [], "no half-made schema where the server looks for one"
    engine.dispose()
    database = Database(f"sqlite:///{path}")
    database.migrate()  # the next start
    database.dispose()
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == HEAD
        assert "reached" in {col["name"] for col in inspect(c).get_columns("hosts")}
    engine.dispose()


def test_an_existing_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "longrun.sqlite"
    upgrade(f"sqlite:///{path}", revision="0005")
    inode = path.stat().st_ino
    upgrade(f"sqlite:///{path}")
    assert path.stat().st_ino == inode
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == HEAD
    engine.dispose()
