"""The long-lived processes: the API server (with the worker embedded, by default) and the worker alone.

The one place where server and worker meet; `server` never imports `worker`.
"""

import logging
import signal
from importlib.metadata import version

from sqlalchemy.exc import IntegrityError

from server.config import Settings, is_loopback
from server.db import Database


def open_database() -> tuple[Settings, Database]:
    """Settings from LONGRUN_* and the database they name, migrated to the newest schema."""
    settings = Settings()
    db = Database(settings.resolved_database_url)
    db.migrate()
    return settings, db


def serve(host: str | None = None, port: int | None = None, with_worker: bool = True) -> None:
    """Run the API until interrupted; with_worker also drives runs in this process (the embedded default)."""
    import uvicorn

    from server.api.app import create_app
    from server.hosts import ensure_local_host

    settings = Settings()
    bind = host or settings.bind_host
    if not is_loopback(bind) and not settings.api_token:
        raise SystemExit(f"longrun: refusing to listen on {bind} without LONGRUN_API_TOKEN: anyone who reaches it "
                         f"could run commands on your hosts. Set LONGRUN_API_TOKEN (and LONGRUN_ALLOWED_HOSTS to "
                         f"the names clients use), or listen on 127.0.0.1")
    settings, db = open_database()
    try:
        with db.writing() as s:
            ensure_local_host(s, settings)
    except IntegrityError:
        # another server starting at the same time added it first
        with db.writing() as s:
            ensure_local_host(s, settings)
    supervisor = None
    if with_worker:
        from worker.supervisor import Supervisor

        supervisor = Supervisor(db, settings)
    app = create_app(db, settings, on_startup=supervisor.start if supervisor else None,
                     on_shutdown=supervisor.stop if supervisor else None, bind_host=bind)
    port = port or settings.port
    shown = f"[{bind}]" if ":" in bind else bind
    # uvicorn runs at log level warning (its access log would cost a line per poll): say where to go ourselves
    logging.getLogger("longrun").info(
        "longrun %s: serving on http://%s:%d (the page at /, the API under /v1, its schema at /docs); "
        "the host `local` runs jobs on this machine under %s", version("longrun"), shown, port,
        settings.local_workspace)
    # uvicorn believes X-Forwarded-For from 127.0.0.1 by default (uvicorn/config.py 0.55: proxy_headers=True,
    # forwarded_allow_ips from $FORWARDED_ALLOW_IPS, else "127.0.0.1,::1"): only from the proxies named here
    trusted = settings.forwarded_allow_ips.strip()
    uvicorn.run(app, host=bind, port=port, log_level="warning", proxy_headers=bool(trusted),
                forwarded_allow_ips=trusted or None)


def work() -> None:
    """Drive runs until SIGTERM or Ctrl-C; several of these share the database through leases."""
    from worker.supervisor import Supervisor

    settings, db = open_database()
    supervisor = Supervisor(db, settings)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    try:
        supervisor.serve()
    except KeyboardInterrupt:
        supervisor.stop()
