"""The connection warmer: opens the connection to each registered host before its first command, so that the first
submit, cancel or restart on it pays no SSH handshake. The connection then stays open (worker/transport_pool.py keeps
one per host, with keepalives) and the next command re-makes it after a failure. A host whose workspace is not
resolved on the host yet (registered, or changed) has it resolved then (`check`: worker/workspace_check.py), which
registration waits for."""

import logging
import threading
from collections.abc import Callable

from sqlalchemy import select

from server.db import Database
from server.models import Host
from worker.host_errors import HostError
from worker.transport_pool import TransportPool
from worker.workspace_check import reached_with

log = logging.getLogger("longrun.worker")


class ConnectionWarmer:
    def __init__(self, db: Database, transports: TransportPool,
                 check: Callable[[Host, HostError | None], None] | None = None):
        self.db, self.transports, self.check = db, transports, check
        self._lock = threading.Lock()
        # host name -> the settings it was last warmed with: each once, and again when they change
        self._warmed: dict[str, tuple] = {}

    def run_once(self) -> list[Host]:
        """The hosts not connected to yet with their current settings, or with their workspace not resolved."""
        with self.db.reading() as s:
            hosts = list(s.scalars(select(Host)))
        with self._lock:
            return [h for h in hosts if self._warmed.get(h.name) != reached_with(h)]

    def warm(self, host: Host) -> None:
        with self._lock:
            self._warmed[host.name] = reached_with(host)
        failed = None
        try:
            self.transports.get(host).connect()
        except HostError as exc:
            # the host's first command tries again, and reports it on the run it is for
            log.info("host %s: not connected ahead of use: %s", host.name, exc)
            failed = exc
        if self.check is not None and host.workspace_real is None:
            self.check(host, failed)

