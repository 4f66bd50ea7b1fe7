"""The GPU snapshot responder: answers GET /v1/hosts/{name}/gpus, which marks a host whose snapshot is too old
(hosts.gpu_wanted_at), with a fresh nvidia-smi reading of that host."""

from sqlalchemy import select

from server.db import Database
from server.models import Host
from worker.clock import Clock
from worker.host_contact import HostContact, store_snapshot
from worker.host_errors import HostError


class GpuSnapshotResponder:
    def __init__(self, db: Database, contact: HostContact, clock: Clock):
        self.db, self.contact, self.clock = db, contact, clock

    def run_once(self) -> list[Host]:
        """The hosts a fresh snapshot is wanted of."""
        with self.db.reading() as s:
            return list(s.scalars(select(Host).where(Host.gpu_wanted_at.is_not(None))))

    def answer(self, host: Host) -> None:
        try:
            view = self.contact.agent(host).gpus([])
        except HostError as exc:
            with self.db.writing() as s:
                fresh = s.get(Host, host.id)
                fresh.reachable, fresh.last_error, fresh.gpu_wanted_at = False, str(exc), None
            return
        with self.db.writing() as s:
            store_snapshot(s, host.id, view, self.clock.now())
            s.get(Host, host.id).gpu_wanted_at = None
