"""Stopping attempts on their hosts and recording that they are gone: used on cancel, on restart, and by the
orphan reaper for attempts given up on while their host was away."""

from dataclasses import dataclass, field

from server.db import Database
from server.lifecycle import AttemptStatus, attempt_stopped, nodes_of
from server.models import Attempt, Host, Run
from worker.attempt_io import NodeProbe, read_from, store_probes
from worker.clock import Clock
from worker.gpu_placement import gpu_holders
from worker.host_contact import HostContact, store_snapshot
from worker.protocol import GpuView
from worker.run_rows import attempt_numbered, fresh_run


@dataclass
class Stopped:
    """What cancelling one attempt found, one call per node: pids still alive, last output, GPU snapshots."""

    number: int
    probes: list[NodeProbe] = field(default_factory=list)
    left: dict[int, list[int]] = field(default_factory=dict)  # node index -> pids of the attempt still alive there
    views: dict[str, GpuView] = field(default_factory=dict)  # host -> snapshot once nothing of it remained there

    @property
    def remaining(self) -> list[int]:
        return sorted(p for pids in self.left.values() for p in pids)

    @property
    def exit_code(self) -> int | None:
        return next((p.answer.exit_code for p in self.probes if p.answer.exit_code is not None), None)


class AttemptStopper:
    def __init__(self, db: Database, contact: HostContact, grace: float, clock: Clock):
        self.db, self.contact, self.grace, self.clock = db, contact, grace, clock

    def stop_attempt(self, attempt: Attempt, hosts: dict[str, Host]) -> Stopped:
        """Cancel every node of the attempt, check that none of its processes holds GPU memory, and read
        what it wrote last: one call per node (the host-side cancel does all three)."""
        stopped = Stopped(attempt.number)
        for i, (node, offsets) in enumerate(zip(nodes_of(attempt), read_from(attempt), strict=True)):
            answer = self.contact.agent(hosts[node.host]).cancel(node.dir, self.grace, read_from=offsets,
                                                                 gpu_tokens=[attempt.token])
            left = list(answer.remaining)
            if not left and answer.gpus is not None:
                view = answer.gpus.view()
                if answer.signalled:
                    left = gpu_holders(view, attempt.token, set(answer.signalled))
                if not left:
                    stopped.views[node.host] = view
            if left:
                stopped.left[i] = left
            stopped.probes.append(NodeProbe(i, offsets, answer.probe))
        return stopped

    def stop(self, run: Run, attempts: list[Attempt], hosts: dict[str, Host], status: AttemptStatus,
             message: str | None) -> tuple[list[int], dict[str, GpuView]]:
        """Stop these attempts, store their last output, and mark them ended when nothing is left.

        Returns the pids still alive, and per host a GPU snapshot taken once the attempts were gone there."""
        results = [self.stop_attempt(attempt, hosts) for attempt in attempts]
        views: dict[str, GpuView] = {}
        for r in results:
            views.update(r.views)  # a later snapshot of a host also saw the earlier attempts gone
        now = self.clock.now()
        with fresh_run(self.db, run.id) as (s, fresh):
            for name, view in views.items():
                store_snapshot(s, hosts[name].id, view, now)
            for r in results:
                current = attempt_numbered(fresh, r.number)
                store_probes(s, fresh, current, r.probes, now)
                attempt_stopped(current, status, message, set(r.left), r.exit_code, now)
        return sorted(p for r in results for p in r.remaining), views
