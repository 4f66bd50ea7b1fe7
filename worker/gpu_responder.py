"""The host responder: answers what the API asked of a host and waits for: GET /v1/hosts/{name}/gpus, which marks
a host whose snapshot is too old (hosts.gpu_wanted_at), with a fresh nvidia-smi reading; and a submit's input paths
(hosts.paths_wanted), with what each is there, all asked in one call."""

from sqlalchemy import or_, select

from server.db import Database
from server.models import Host
from worker.clock import Clock
from worker.host_contact import HostContact, store_snapshot
from worker.host_errors import HostError

# answers kept for the submits that wait on them, newest last (a submit reads its own within seconds)
KEPT_ANSWERS = 64


class GpuSnapshotResponder:
    def __init__(self, db: Database, contact: HostContact, clock: Clock):
        self.db, self.contact, self.clock = db, contact, clock

    def run_once(self) -> list[Host]:
        """The hosts a fresh snapshot, or a look at some paths, is wanted of."""
        with self.db.reading() as s:
            return list(s.scalars(select(Host).where(or_(Host.gpu_wanted_at.is_not(None),
                                                         Host.paths_wanted.is_not(None)))))

    def answer(self, host: Host) -> None:
        if host.paths_wanted:
            self._paths(host, host.paths_wanted)
        if host.gpu_wanted_at is not None:
            self._gpus(host)

    def _paths(self, host: Host, wanted: dict) -> None:
        asked = sorted({p for paths in wanted.values() if isinstance(paths, list) for p in paths if isinstance(p, str)})
        try:
            kinds = dict(zip(asked, self.contact.agent(host).path_kinds(asked), strict=True)) if asked else {}
            found = {ident: {p: kinds.get(p) for p in paths} for ident, paths in wanted.items()}
        except HostError as exc:
            found = {ident: {"error": str(exc)[:1000]} for ident in wanted}
        with self.db.writing() as s:
            fresh = s.scalars(select(Host).where(Host.id == host.id).with_for_update()).one()
            kept = {**(fresh.paths_found or {}), **found}
            fresh.paths_found = dict(list(kept.items())[-KEPT_ANSWERS:])
            left = {k: v for k, v in (fresh.paths_wanted or {}).items() if k not in found}
            fresh.paths_wanted = left or None

    def _gpus(self, host: Host) -> None:
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
