import os
import shutil
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.service import Service, kill_leftovers

# torch's worker threads spin while idle; on a small shared machine that starves the other processes
# (servers, torchrun ranks) a test starts, so every process the suite starts waits passively
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

STORES = ("sqlite", "postgres")
# the fixtures that hand a test a database in this process: every test using one runs on both stores
IN_PROCESS_DATABASE = {"db", "api", "rig"}
ROOT = Path(__file__).resolve().parent.parent
# Two lanes collect less than all of tests/, leaving out only what they would deselect: importing it cost each of
# their pytest processes seconds of CPU (torch, transformers, the trainer) for no test they keep. The other lanes
# check that nothing they would keep is left out: a test that breaks the rule fails its module's collection.
# The PostgreSQL lane (--stores postgres) keeps the tests that take a store, and no test under these paths takes one:
STORELESS = tuple(ROOT / path for path in ("tests/trainer", "tests/test_benchmark_decode_tp.py"))
# The Slurm lane (-m slurm) keeps the tests whose id names slurm (pytest_collection_modifyitems marks them): it
# collects only the test modules whose text names it


_ENVIRON = os.environ


@pytest.fixture(autouse=True)
def _environ_kept() -> Iterator[None]:
    """os.environ is this process's environment after every test: datasets' map (speculators' data code) binds a copy
    of it in its place, and a later test's monkeypatch.setenv (COLUMNS, say) then reaches no one."""
    yield
    if os.environ is not _ENVIRON:
        os.environ = _ENVIRON  # noqa: B003


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--stores", default="sqlite", help="the stores the tests that take one run on: sqlite, postgres, "
                     "or both (sqlite,postgres). The PostgreSQL lane (`--stores postgres`) runs only the tests that "
                     "take a store, each on PostgreSQL")


def _stores(config: pytest.Config) -> set[str]:
    stores = {s.strip() for s in config.getoption("--stores").split(",") if s.strip()}
    unknown = stores - set(STORES)
    if unknown or not stores:
        raise pytest.UsageError(f"--stores takes {', '.join(STORES)} (comma-separated), not {sorted(unknown)}")
    return stores


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """What the PostgreSQL and the Slurm lanes would only deselect, left uncollected (STORELESS above)."""
    if collection_path in STORELESS and _stores(config) == {"postgres"}:
        return True
    if (config.option.markexpr == "slurm" and collection_path.name.startswith("test_")
            and collection_path.suffix == ".py" and "slurm" not in collection_path.read_text(encoding="utf-8")):
        return True
    return None


def _left_out(item: pytest.Function) -> str | None:
    """Why the PostgreSQL or the Slurm lane would miss `item`, a test it keeps, not collecting its module."""
    store = getattr(item, "callspec", None) and item.callspec.params.get("store")
    if store is not None and any(item.path == path or path in item.path.parents for path in STORELESS):
        return (f"{item.nodeid} takes a store, and the PostgreSQL lane does not collect {item.path.relative_to(ROOT)}: "
                "move the test, or take its path out of STORELESS in tests/conftest.py")
    if "slurm" in item.nodeid and "slurm" not in item.path.read_text(encoding="utf-8"):
        return (f"{item.nodeid} is a Slurm test (its id names slurm), and the Slurm lane does not collect "
                f"{item.path.relative_to(ROOT)}, whose text never does (tests/conftest.py)")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A module holding a test that the PostgreSQL or the Slurm lane would not collect fails its collection, in every
    lane (a collection error, which pytest-xdist reports as such)."""
    report = yield
    if report.passed and isinstance(collector, pytest.Module | pytest.Class):
        left_out = [why for item in report.result if isinstance(item, pytest.Function) and (why := _left_out(item))]
        if left_out:
            report.outcome, report.longrepr, report.result = "failed", "\n".join(left_out), []
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts a real server is slow (-m 'not slow' leaves it out); the Slurm tests are marked `slurm`
    (their lane); a test's store follows --stores, and the PostgreSQL lane keeps only the tests that take a store."""
    stores = _stores(config)
    store_lane = stores == {"postgres"}
    kept, deselected = [], []
    for item in items:
        store = getattr(item, "callspec", None) and item.callspec.params.get("store")
        if (store is not None and store not in stores) or (store_lane and store != "postgres"):
            deselected.append(item)
            continue
        kept.append(item)
        if "service" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if "slurm" in item.nodeid:
            # one Slurm cluster per test process is plenty for this machine: every Slurm test in one xdist worker
            item.add_marker(pytest.mark.xdist_group("slurm"))
            item.add_marker(pytest.mark.slurm)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    # the longest work first, so the suite's end is short tests that even out across the pytest processes (xdist
    # hands work out in this order): the Slurm group (one process runs it all, about 5 minutes), then what starts
    # real processes, then the rest
    items.sort(key=lambda item: 0 if item.get_closest_marker("xdist_group") else
               1 if item.get_closest_marker("slow") else 2)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """In-process database tests, and real-server tests marked both_stores, take a store: SQLite or PostgreSQL, as
    --stores picks (the lanes: SQLite in the unit and integration lanes, PostgreSQL in a lane of its own)."""
    if "store" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("sqlite_only"):
        metafunc.parametrize("store", ["sqlite"], indirect=True)
    elif metafunc.definition.get_closest_marker("both_stores") or IN_PROCESS_DATABASE & set(metafunc.fixturenames):
        metafunc.parametrize("store", STORES, indirect=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator["PostgresCluster"]:  # noqa: F821
    """The session's PostgreSQL server, started on first use."""
    from tests.postgres import PostgresCluster

    try:
        cluster = PostgresCluster().start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator["SlurmCluster"]:  # noqa: F821
    """A real single-node Slurm cluster (tests/slurm.py), shared by the tests of this process that need one."""
    from tests.slurm import SlurmCluster

    with SlurmCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file at the newest migration: the migrations run once per session, tests copy the file."""
    from server.db import Database

    path = tmp_path_factory.mktemp("template") / "migrated.sqlite"
    database = Database(f"sqlite:///{path}")
    database.migrate()
    database.dispose()
    return path


@pytest.fixture
def store(request: pytest.FixtureRequest) -> str:
    """The database engine the test keeps its state in: SQLite unless the test is run on both."""
    return getattr(request, "param", "sqlite")


def _own_database(request: pytest.FixtureRequest, store: str, tmp_path: Path, migrated: bool) -> Iterator[str]:
    if store == "sqlite":
        path = tmp_path / "store.sqlite"
        if migrated:
            shutil.copy(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    cluster = request.getfixturevalue("postgres")
    url = cluster.create_database(migrated)
    yield url
    cluster.drop_database(url)


@pytest.fixture
def database_url(request: pytest.FixtureRequest, store: str, tmp_path: Path) -> Iterator[str]:
    """A database of the test's own at the newest migration, as the service makes its own, in the test's store."""
    yield from _own_database(request, store, tmp_path, migrated=True)


@pytest.fixture
def empty_database_url(request: pytest.FixtureRequest, store: str, tmp_path: Path) -> Iterator[str]:
    """A database of the test's own with no table yet, in the test's store."""
    yield from _own_database(request, store, tmp_path, migrated=False)


@pytest.fixture
def service(tmp_path: Path, database_url: str) -> Iterator[Service]:
    svc = Service(tmp_path / "home", database_url=database_url)
    svc.home.mkdir()
    svc.start()
    yield svc
    svc.stop()
    kill_leftovers(svc.workspace)


@pytest.fixture
def db(database_url: str) -> Iterator["Database"]:  # noqa: F821
    # imported here, not at the top: the GPU host runs the trainer tests without SQLAlchemy
    from server.db import Database

    database = Database(database_url)
    yield database
    database.dispose()


@pytest.fixture
def api(tmp_path: Path, database_url: str) -> Iterator["App"]:  # noqa: F821
    """The API in this process over the test's database (tests/inprocess.py)."""
    from tests.inprocess import App

    app = App(tmp_path / "home", database_url)
    yield app
    app.close()


@pytest.fixture
def cli(api: "App", monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> "App":  # noqa: F821
    """`longrun` commands in this process, talking to the in-process API (no worker); no config file."""
    from longrun import Client

    monkeypatch.setattr("longrun.commands.common.Client",
                        lambda url=None, token=None: Client(api.client.base_url, token=token, http=api.client))
    monkeypatch.setenv("LONGRUN_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("LONGRUN_API_TOKEN", raising=False)
    return api


@pytest.fixture
def rule_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retrain rule's record (server/advisor/rule_record.py) as one that held on every restart from TTT=3, for
    the tests of what a restart proposal does once made: the measured record has it miss on restarts from 3, so it
    would answer cannot_tell there (tests/server/test_proposal.py checks that)."""
    from server.advisor import rule_record

    monkeypatch.setattr(rule_record, "MEASURED", tuple(
        rule_record.Checked("a record that held", "regenerated", link, 3, to, 0.1, 0.1, 0.0)
        for link in ("nvlink", "pcie", "unknown") for to in range(4, 17)))


@pytest.fixture
def rule_unbounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retrain rule without its record's bounds (server/advisor/rule_record.py DEEPEST_MEASURED and
    HIGHEST_ACCEPTANCE), for the tests of how evidence and intervals decide: their figures were made for the rule
    as it reads the decay; tests/unit/test_depth_step_rule.py checks the bounds."""
    from server.advisor import rule_record

    monkeypatch.setattr(rule_record, "DEEPEST_MEASURED", 64)
    monkeypatch.setattr(rule_record, "HIGHEST_ACCEPTANCE", 1.0)
