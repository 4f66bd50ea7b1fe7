"""A throw-away PostgreSQL server for the tests: Debian's `postgresql` binaries, a cluster made by initdb in a
temporary directory, listening on a free port of 127.0.0.1 (and a unix socket in that directory).

initdb refuses to run as root: as root the cluster belongs to the `postgres` user the package creates."""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

from tests.service import free_port

INSTALL_HINT = ("the PostgreSQL tests need Debian's postgresql package: run `sudo apt-get install postgresql` "
                "(`make system-deps` does it as root), then the tests again")
# the cluster holds nothing worth keeping: durability costs test time for nothing
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                 "max_connections": "400", "listen_addresses": "127.0.0.1"}
TEMPLATE = "longrun_migrated"


def server_binary(name: str) -> str:
    """A PostgreSQL program: on PATH, or where Debian puts it (/usr/lib/postgresql/<version>/bin)."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise RuntimeError(INSTALL_HINT)
    return found


def _cluster_owner() -> pwd.struct_passwd | None:
    """As root, the `postgres` user the package made (initdb and postgres refuse root); else nobody to become."""
    if os.getuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(INSTALL_HINT) from None


class PostgresCluster:
    """One server for the session; `create_database()` gives each test a database of its own."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="longrun-pg-"))
        self.data = self.directory / "data"
        self.port = free_port()
        self._owner = _cluster_owner()
        if self._owner is not None:
            os.chown(self.directory, self._owner.pw_uid, -1)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str) -> None:
        owner = self._owner
        done = subprocess.run(argv, user=owner and owner.pw_uid, group=owner and owner.pw_gid,
                              capture_output=True, text=True, cwd=self.directory)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> "PostgresCluster":
        self._run(server_binary("initdb"), "--no-sync", "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "-D", str(self.data))
        options = " ".join(f"-c {k}={v}" for k, v in
                           {**FAST_SETTINGS, "port": self.port, "unix_socket_directories": self.directory}.items())
        self._run(server_binary("pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                  "-l", str(self.directory / "server.log"), "-o", options)
        self._make_template()
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(server_binary("pg_ctl"), "stop", "-m", "immediate", "-D", str(self.data))
        shutil.rmtree(self.directory, ignore_errors=True)

    def execute(self, sql: str) -> None:
        """One statement outside a transaction (CREATE / DROP DATABASE need that)."""
        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql)

    def _make_template(self) -> None:
        # imported here: the GPU host runs the trainer tests without SQLAlchemy
        from server.db import Database

        self.execute(f"CREATE DATABASE {TEMPLATE}")
        database = Database(self.url(TEMPLATE))
        database.migrate()
        database.dispose()  # a template must have no connection when it is copied

    def create_database(self, migrated: bool = True) -> str:
        """A new database's URL: at the newest migration (a copy of the template, fast) or empty."""
        name = f"test_{uuid.uuid4().hex[:12]}"
        self.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {TEMPLATE}" if migrated else ""))
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop the database, closing whatever connection is still open to it (a killed server's)."""
        self.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")
