"""Alembic environment: the URL comes from the caller (server.db.upgrade or `longrun migrate`)."""

from alembic import context
from sqlalchemy import create_engine, pool, text

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


def run_migrations_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    with engine.connect() as connection:
        # SQLite can only ALTER through table copies: batch mode does that for us
        hook = config.attributes.get("on_version_apply")
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                          **({"on_version_apply": hook} if hook else {}))
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
