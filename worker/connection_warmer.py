"""The connection warmer: opens the connection to each registered host before its first command, so that the first
submit, cancel or restart on it pays no SSH handshake. The connection then stays open (worker/transport_pool.py keeps
one per host, with keepalives) and the next command re-makes it after a failure."""

import logging
import threading

from sqlalchemy import select

from server.db import Database
from server.models import Host
from worker.host_errors import HostError
from worker.transport_pool import TransportPool, settings_of

log = logging.getLogger("longrun.worker")


class ConnectionWarmer:
    def __init__(self, db: Database, transports: TransportPool):
        self.db, self.transports = db, transports
        self._lock = threading.Lock()
        # host name -> the settings it was last warmed with: each once, and again when they change
        self._warmed: dict[str, tuple] = {}

    def run_once(self) -> list[Host]:
        """The hosts not connected to yet with their current settings."""
        with self.db.reading() as s:
            hosts = list(s.scalars(select(Host)))
        with self._lock:
            return [h for h in hosts if self._warmed.get(h.name) != settings_of(h)]

    def warm(self, host: Host) -> None:
        with self._lock:
            self._warmed[host.name] = settings_of(host)
        try:
            self.transports.get(host).connect()
        except HostError as exc:
            # the host's first command tries again, and reports it on the run it is for
            log.info("host %s: not connected ahead of use: %s", host.name, exc)
