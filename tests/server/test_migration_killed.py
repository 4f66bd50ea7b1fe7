"""A real kill -9 of a process migrating a fresh SQLite database, landed by alembic's hook after the third migration
(not by timing): no half-made database is left where the server looks, and the next start makes it whole."""

import signal
import subprocess
import sys
from pathlib import Path

from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from server.db import Database, alembic_config

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


def test_a_migration_killed_with_sigkill_leaves_nothing_half_made(tmp_path: Path) -> None:
    path = tmp_path / "longrun.sqlite"
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THREE, str(path)], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert not path.exists()
    assert {p.name.split("-")[0] for p in tmp_path.iterdir()} == {"longrun.sqlite.migrating"}  # and its journal
    database = Database(f"sqlite:///{path}")
    database.migrate()
    database.dispose()
    engine = create_engine(f"sqlite:///{path}")
    with engine.connect() as c:
        head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
        assert c.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
    engine.dispose()
    assert [p.name for p in tmp_path.iterdir()] == ["longrun.sqlite"]
