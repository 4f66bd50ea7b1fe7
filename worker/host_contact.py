"""The worker's line to its hosts: an agent per host that names the host in its errors and notes when it
last answered, and the hosts table's record of reachability and GPU snapshots."""

import logging
import threading
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from server.db import Database
from server.layout import HostLayout
from server.models import Host
from worker.clock import Clock
from worker.host_agent import HostAgent
from worker.host_errors import CommandFailed, HostError, in_one_sentence
from worker.protocol import GpuView, Request
from worker.transport_pool import TransportPool

log = logging.getLogger("longrun.worker")

# how often a host's last_seen_at is refreshed while it keeps answering
SEEN_REFRESH_SECONDS = 10.0


class _NamedAgent(HostAgent):
    """A HostAgent that names its host in errors and notes when the host last answered."""

    def __init__(self, contact: "HostContact", name: str, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.contact, self.name = contact, name

    def call(self, request: Request, timeout: float | None = None) -> Any:
        try:
            answer = super().call(request, timeout)
        except CommandFailed as exc:
            exc.host = exc.host or self.name
            short = in_one_sentence(str(exc), self.name, self.layout.workspace)
            if short is None:
                raise
            # a run's message is read in a terminal or a page: the traceback goes to the log, whole
            log.warning("host %s: %s", self.name, exc)
            raise type(exc)(short, exc.host) from exc
        except HostError as exc:
            exc.host = exc.host or self.name
            raise
        self.contact.answered(self.name)
        return answer


def store_snapshot(session: Session, host_id: int, view: GpuView, now: datetime) -> None:
    host = session.get(Host, host_id)
    host.gpu_snapshot, host.gpu_snapshot_at = view.snapshot.to_dict(), now
    host.reachable, host.last_seen_at, host.last_error = True, now, None


def mark_unreachable(session: Session, host: str | None, error: str) -> None:
    row = session.scalar(select(Host).where(Host.name == host)) if host else None
    if row is not None:
        row.reachable, row.last_error = False, error


class HostContact:
    def __init__(self, db: Database, transports: TransportPool, command_timeout: float, clock: Clock):
        self.db, self.transports, self.command_timeout, self.clock = db, transports, command_timeout, clock
        self._lock = threading.Lock()
        # host name -> monotonic time of its last answer
        self._answered: dict[str, float] = {}

    @staticmethod
    def layout(host: Host) -> HostLayout:
        return HostLayout(host.workspace)

    def agent(self, host: Host) -> HostAgent:
        return _NamedAgent(self, host.name, self.transports.get(host), host.workspace, host.python,
                           timeout=self.command_timeout, registered_real=host.workspace_real)

    def answered(self, name: str) -> None:
        with self._lock:
            self._answered[name] = self.clock.monotonic()

    def mark_answered(self, hosts: Iterable[Host], since: float) -> None:
        """Hosts that answered since `since` are reachable; their last_seen_at is refreshed now and then."""
        now = self.clock.now()
        with self._lock:
            answered = dict(self._answered)
        due = [h.id for h in hosts if answered.get(h.name, float("-inf")) >= since and (
            h.reachable is not True or h.last_seen_at is None
            or (now - h.last_seen_at).total_seconds() > SEEN_REFRESH_SECONDS)]
        if due:
            reached = {h.id: self.transports.destination(h.name) for h in hosts if h.id in due}
            with self.db.writing() as s:
                s.execute(update(Host).where(Host.id.in_(due)).values(reachable=True, last_seen_at=now,
                                                                      last_error=None))
                for host_id, destination in reached.items():
                    if destination is not None:
                        s.execute(update(Host).where(Host.id == host_id).values(reached=destination[:512]))
