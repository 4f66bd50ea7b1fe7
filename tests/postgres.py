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
from psycopg import sql

from tests.service import free_port

INSTALL_HINT = ("the PostgreSQL tests need Debian's postgresql package: run `sudo apt-get install postgresql` "
                "(`make system-deps` does it as root), then the tests again")
# the cluster holds nothing worth keeping: durability costs test time for nothing
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                 "max_connections": "400", "listen_addresses": "127.0.0.1"}
TEMPLATE = "longrun_migrated"
# what a database's schema is, read from the catalog: a used database goes back to the pool only when it matches the
# template's (a test that changed the schema gets its database dropped)
SCHEMA_QUERY = """
SELECT md5(coalesce(string_agg(item, E'\\n' ORDER BY item), '')) FROM (
    SELECT format('%s.%s %s %s %s', table_name, column_name, data_type, is_nullable, column_default) AS item
      FROM information_schema.columns WHERE table_schema = 'public'
    UNION ALL SELECT indexdef FROM pg_indexes WHERE schemaname = 'public'
    UNION ALL SELECT conrelid::regclass || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
     WHERE connamespace = 'public'::regnamespace
    UNION ALL SELECT 'version ' || version_num FROM alembic_version
) schema
"""


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
        # migrated databases a test is done with, emptied and renamed (tests/conftest.py's `database_url` hands them
        # out again): a CREATE DATABASE from the 8 MB template cost the server about 0.2 CPU-s, its TRUNCATE 0.05
        self._spare: list[str] = []
        self._schema: str | None = None
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

    def _connect(self, database: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=database, autocommit=True)

    def execute(self, statement: str) -> None:
        """One statement outside a transaction (CREATE / DROP DATABASE need that)."""
        with self._connect() as conn:
            conn.execute(statement)

    def _make_template(self) -> None:
        # imported here: the GPU host runs the trainer tests without SQLAlchemy
        from server.db import Database

        self.execute(f"CREATE DATABASE {TEMPLATE}")
        database = Database(self.url(TEMPLATE))
        database.migrate()
        database.dispose()  # a template must have no connection when it is copied
        with self._connect(TEMPLATE) as conn:
            self._schema = conn.execute(SCHEMA_QUERY).fetchone()[0]

    def create_database(self, migrated: bool = True) -> str:
        """A new database's URL, of a name never handed out before: at the newest migration (a used one emptied, or a
        copy of the template) or empty."""
        name = f"test_{uuid.uuid4().hex[:12]}"
        if migrated and self._spare:
            self.execute(f"ALTER DATABASE {self._spare.pop()} RENAME TO {name}")
        else:
            self.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {TEMPLATE}" if migrated else ""))
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Done with the database: whatever connection is still open to it (a killed server's) is closed, and it is
        emptied into the pool when its schema is still the template's, or dropped. Either way its name is gone: a
        process of the test still connecting reaches no later test's data."""
        name = url.rsplit("/", 1)[1]
        if not self._recycle(name):
            self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def _recycle(self, name: str) -> bool:
        close_others = ("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                        "AND pid <> pg_backend_pid()")
        spare = f"spare_{uuid.uuid4().hex[:12]}"
        try:
            with self._connect(name) as conn:
                conn.execute(close_others, (name,))
                tables = [row[0] for row in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'")]
                if conn.execute(SCHEMA_QUERY).fetchone()[0] != self._schema:
                    return False
                conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                    sql.SQL(", ").join(map(sql.Identifier, tables))))
            with self._connect() as conn:
                conn.execute(close_others, (name,))
                conn.execute(f"ALTER DATABASE {name} RENAME TO {spare}")
        except psycopg.Error:
            return False
        self._spare.append(spare)
        return True
