"""One real `longrun serve` per test module and store, for the tests whose use of a server is to submit runs and read
those runs back (by id): a server's start and stop costs about 2 CPU-s, and such tests need no server of their own.

A test module takes both fixtures in as its own names (the module-scoped cache is what makes the server the
module's; names bound so, not imported, keep ruff's F811 off the tests that take them):

    from tests import shared_service as shared

    shared_servers, shared_service = shared.shared_servers, shared.shared_service  # fixtures

A test sharing the server must address only its own runs (by id, never the whole runs list or every host), change no
host or setting, and leave the server running (a test that kills or restarts it takes the function-scoped `service`
of tests/conftest.py). Each test still cleans up: after it, every run not yet over is cancelled and waited for, and
any process left in the workspace is killed; at the module's end the server stops, its jobs are killed and its
PostgreSQL database is dropped, as the `service` fixture does after each test.

The server's store follows the test's `store` (tests/conftest.py parametrizes `both_stores` tests over SQLite and
PostgreSQL as --stores picks), one server per store, each on a database of its own like `database_url`'s.
`shared_service` does not count as `service` for the slow mark tests/conftest.py gives: a module sharing it marks
its tests slow itself.
"""

import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.service import Service, kill_leftovers

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class _Shared:
    service: Service
    drop_database: Callable[[], None] | None = None


@pytest.fixture(scope="module")
def shared_servers() -> Iterator[dict[str, _Shared]]:
    """The module's servers by store, started on first use; stopped, their jobs killed and databases dropped after."""
    servers: dict[str, _Shared] = {}
    yield servers
    for shared in servers.values():
        shared.service.stop()
        kill_leftovers(shared.service.workspace)
        shared.service.client.close()
        if shared.drop_database:
            shared.drop_database()


def _start(request: pytest.FixtureRequest, store: str, tmp_path_factory: pytest.TempPathFactory) -> _Shared:
    """A started server on a database of its own in `store`, at the newest migration (as `database_url` gives)."""
    directory = tmp_path_factory.mktemp(f"shared-{request.module.__name__.rpartition('.')[2]}-{store}")
    drop = None
    if store == "sqlite":
        path = directory / "store.sqlite"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
    else:
        cluster = request.getfixturevalue("postgres")
        url = cluster.create_database(True)
        drop = lambda: cluster.drop_database(url)  # noqa: E731
    svc = Service(directory / "home", database_url=url)
    svc.home.mkdir()
    shared = _Shared(svc, drop)
    try:
        svc.start()
    except BaseException:
        svc.stop()
        if drop:
            drop()
        raise
    return shared


def _active_runs(svc: Service) -> list[str]:
    ids, cursor = [], None
    while True:
        page = svc.client.get("/v1/runs", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
        ids += [r["id"] for r in page["items"] if r["status"] not in TERMINAL]
        cursor = page["next_cursor"]
        if not cursor:
            return ids


def _settle(svc: Service, timeout: float = 60) -> None:
    """Cancel every run not yet over and wait until each is, then kill what is left in the workspace: the next test
    finds a quiet server. (Tests on one server run one after the other, so these are the finished test's runs.)"""
    active = _active_runs(svc)
    for run_id in active:
        svc.client.post(f"/v1/runs/{run_id}/cancel")
    deadline = time.time() + timeout
    while active and time.time() < deadline:
        active = [i for i in active if svc.run(i)["status"] not in TERMINAL]
        if active:
            time.sleep(0.2)
    kill_leftovers(svc.workspace)


@pytest.fixture
def shared_service(request: pytest.FixtureRequest, store: str, shared_servers: dict[str, _Shared],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The module's server for the test's store; see the module's docstring for what a test using it may do."""
    shared = shared_servers.get(store)
    if shared is None:
        shared = shared_servers[store] = _start(request, store, tmp_path_factory)
    svc = shared.service
    if svc.proc is None or svc.proc.poll() is not None:
        svc.start()  # it died during an earlier test, whose teardown failed for it: this one gets a fresh process
    yield svc
    if svc.proc.poll() is not None:
        kill_leftovers(svc.workspace)  # its jobs go with it; the next test starts the server afresh
        pytest.fail(f"the module's shared server exited during this test (code {svc.proc.returncode}):\n"
                    f"{(svc.home / 'server.log').read_text()[-3000:]}")
    _settle(svc)
