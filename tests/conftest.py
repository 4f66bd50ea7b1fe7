import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import Service, kill_leftovers

# torch's worker threads spin while idle; on a small shared machine that starves the other processes
# (servers, torchrun ranks) a test starts, so every process the suite starts waits passively
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts a real server is slow: the fast subset (-m 'not slow') leaves it out."""
    for item in items:
        if "service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "home")
    svc.home.mkdir()
    svc.start()
    yield svc
    svc.stop()
    kill_leftovers(svc.workspace)


@pytest.fixture
def db(tmp_path: Path) -> "Database":  # noqa: F821
    """An empty SQLite database made by the migrations, as the service makes its own."""
    # imported here, not at the top: the GPU host runs the trainer tests without SQLAlchemy
    from server.db import Database

    database = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    database.migrate()
    return database
