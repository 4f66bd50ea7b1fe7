"""Alembic environment: the URL comes from the caller (server.db.upgrade or `longrun migrate`)."""

from alembic import context
from sqlalchemy import Engine, create_engine, event, pool, text

from server.models import Base

config = context.config
target_metadata = Base.metadata
# any constant that no other program takes on the same database: the key of the migration lock
MIGRATION_LOCK_KEY = 0x6C6F6E6772756E


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def sqlite_in_one_transaction(engine: Engine) -> None:
    """SQLite's DDL is transactional, but Python's sqlite3 driver starts its implicit transactions only before
    INSERT, UPDATE and DELETE: under it each CREATE or ALTER commits on its own, and a process killed between two
    ADD COLUMNs left a schema that no later start could finish ("duplicate column name"). With the driver's own
    handling off and BEGIN IMMEDIATE emitted here (SQLAlchemy's pysqlite docs, "Serializable isolation / Savepoints
    / Transactional DDL"), the whole upgrade is one transaction: killed, it is rolled back when the file is next
    opened. IMMEDIATE takes the write lock before alembic reads the schema's version, so that servers starting
    together on one file migrate one at a time (the busy timeout is the later ones' wait), the later ones finding
    it new. Foreign keys stay off here, as SQLite's connections start: batch mode's table copies drop tables."""

    @event.listens_for(engine, "connect")
    def _autocommit(dbapi_conn, _record) -> None:  # noqa: ANN001
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # noqa: ANN001
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    sqlite = url.startswith("sqlite")
    # a later server waits this long for the one migrating (server.db.WRITE_WAIT_SECONDS)
    engine = create_engine(url, poolclass=pool.NullPool, **({"connect_args": {"timeout": 60.0}} if sqlite else {}))
    if sqlite:
        sqlite_in_one_transaction(engine)
    with engine.connect() as connection:
        # SQLite can only ALTER through table copies: batch mode does that for us
        hook = config.attributes.get("on_version_apply")
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                          transactional_ddl=True, **({"on_version_apply": hook} if hook else {}))
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # servers and workers starting together migrate one at a time; the later ones find the schema new
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
