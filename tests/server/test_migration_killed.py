"""A real kill -9 of a process upgrading a SQLite database, landed by a hook (not by timing): after the third
migration of a fresh file, and between two ADD COLUMNs of one migration of an existing file. Nothing is left half
made: the next start brings the file to the newest schema with its rows kept. And two real servers started at the
same moment on a fresh file both come up on it."""

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from server.db import Database, alembic_config, upgrade
from tests.service import Service

ROOT = Path(__file__).resolve().parents[2]
KILLED_AFTER_THREE = """
import os, signal, sys
from server.db import upgrade
applied = []
def hook(step, heads, run_args, **kw):
    applied.append(step.up_revision_id)
    if len(applied) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
upgrade("sqlite:///" + sys.argv[1], on_version_apply=hook)
"""
# killed just after the first ADD COLUMN of 0007 went through, before the second
KILLED_BETWEEN_ADD_COLUMNS = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
from server.db import upgrade
def after(conn, cursor, statement, parameters, context, executemany):
    if "ADD COLUMN verifier_wanted" in statement:
        os.kill(os.getpid(), signal.SIGKILL)
event.listen(Engine, "after_cursor_execute", after)
upgrade("sqlite:///" + sys.argv[1])
"""


def head() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def version_of(path: Path) -> str | None:
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as c:
            if not inspect(c).has_table("alembic_version"):
                return None
            return c.execute(text("SELECT version_num FROM alembic_version")).scalar()
    finally:
        engine.dispose()


def start_again(path: Path) -> None:
    database = Database(f"sqlite:///{path}")
    database.migrate()
    database.dispose()


def test_a_migration_of_a_fresh_file_killed_with_sigkill_leaves_nothing_half_made(tmp_path: Path) -> None:
    path = tmp_path / "longrun.sqlite"
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THREE, str(path)], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert version_of(path) is None, "the kill undid the whole upgrade: no schema half made"
    start_again(path)
    assert version_of(path) == head()


def test_an_upgrade_of_an_existing_file_killed_between_two_add_columns_starts_cleanly_next_time(
        tmp_path: Path) -> None:
    path = tmp_path / "longrun.sqlite"
    upgrade(f"sqlite:///{path}", "0006")
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as c:
        c.execute(text("INSERT INTO hosts (name, address, port, workspace, python, kind, created_at) "
                       "VALUES ('box', 'box.example', 22, '/ws', 'python3', 'direct', '2026-01-01 00:00:00')"))
    engine.dispose()
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_ADD_COLUMNS, str(path)], cwd=ROOT,
                            capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert version_of(path) == "0006", "the kill undid the half-made upgrade"
    start_again(path)  # before: "duplicate column name: verifier_wanted", at every start
    assert version_of(path) == head()
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        assert {"verifier_wanted", "verifier_error", "reached"} <= {col["name"] for col in inspect(c).get_columns("hosts")}
        assert c.execute(text("SELECT name FROM hosts")).scalars().all() == ["box"], "its rows kept"
    engine.dispose()


def test_two_servers_started_at_the_same_moment_on_a_fresh_file_both_come_up(tmp_path: Path) -> None:
    for round_ in range(3):
        url = f"sqlite:///{tmp_path / f'shared-{round_}.sqlite'}"
        services = [Service(tmp_path / f"home-{round_}-{i}", database_url=url) for i in range(2)]
        for svc in services:
            svc.home.mkdir()
        try:
            with ThreadPoolExecutor(2) as pool:  # each migrates the file it finds, then serves
                list(pool.map(lambda svc: svc.start(worker=False), services))
            for svc in services:
                assert svc.client.get("/v1/hosts/local").status_code == 200
        finally:
            for svc in services:
                svc.stop()
        assert version_of(tmp_path / f"shared-{round_}.sqlite") == head()
        assert not [p for p in tmp_path.iterdir() if "migrating" in p.name], "nothing built aside is left"
