from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from server.config import Settings
from server.db import Database
from server.lifecycle import RunStatus, drop_unstarted_attempt, open_attempt, queue_new_run, transition
from server.models import Attempt, Event, Host, Run
from tests.worker.fake_host import FakeClock, FakeHost, FakeTransports
from worker.supervisor import Supervisor

UNREACHABLE_DEADLINE = 60.0
GPU_WAIT_DEADLINE = 120.0


@dataclass
class Rig:
    """A worker over in-memory hosts `a` and `b` (two GPUs each), with a clock that moves only when told."""

    db: Database
    clock: FakeClock
    supervisor: Supervisor
    hosts: dict[str, FakeHost]

    def submit(self, *hosts: str, max_retries: int = 0, **spec: Any) -> str:
        names = list(hosts or ["a"])
        body = {"name": "r", "nproc_per_node": 2, "entrypoint": "/ws/train.py", "args": [],
                **({"host": names[0]} if len(names) == 1 else {"hosts": names}), **spec}
        with self.db.writing() as s:
            run = Run(id=f"run{s.query(Run).count() + 1}", name="r", spec=body, hosts=names,
                      max_retries=max_retries, latest={}, attempts=[])
            s.add(run)
            open_attempt(s, run, body, 1)
            queue_new_run(s, run)
            return run.id

    def step(self, run_id: str, times: int = 1) -> None:
        """What one worker tick does for this run, without the thread pool."""
        for _ in range(times):
            assert run_id in self.supervisor.claimer.run_once()
            self.supervisor.driver.step(run_id)

    def run(self, run_id: str) -> Run:
        with self.db.reading() as s:
            run = s.get(Run, run_id)
            run.attempts  # noqa: B018 - loaded before the session closes
            return run

    def attempt(self, run_id: str, number: int) -> Attempt:
        return next(a for a in self.run(run_id).attempts if a.number == number)

    def statuses(self, run_id: str) -> list[str]:
        with self.db.reading() as s:
            return [e.data["to"] for e in s.query(Event).filter_by(run_id=run_id, kind="status").order_by(Event.id)]

    def cancel(self, run_id: str) -> None:
        """What POST /v1/runs/{id}/cancel does."""
        with self.db.writing() as s:
            transition(s, s.get(Run, run_id), RunStatus.CANCELLING, "cancel requested")

    def restart(self, run_id: str, clean: bool = False, **changes: Any) -> None:
        """What POST /v1/runs/{id}/restart does."""
        with self.db.writing() as s:
            run = s.get(Run, run_id)
            previous = run.current
            transition(s, run, RunStatus.RESTARTING, f"restart requested: attempt {run.attempt + 1}")
            open_attempt(s, run, {**run.spec, **changes}, run.attempt + 1)
            run.clean_pending = clean
            drop_unstarted_attempt(previous)


@pytest.fixture
def rig(tmp_path: Path, database_url: str) -> Iterator[Rig]:
    db = Database(database_url)
    hosts = {name: FakeHost(name, gpus=2) for name in ("a", "b")}
    with db.writing() as s:
        for name in hosts:
            s.add(Host(name=name, address=f"{name}.example", port=22, workspace="/ws", python="python3"))
    settings = Settings(home=tmp_path, cancel_grace=0, unreachable_deadline=UNREACHABLE_DEADLINE,
                        gpu_wait_deadline=GPU_WAIT_DEADLINE, gpu_sample_interval=5)
    clock = FakeClock()
    supervisor = Supervisor(db, settings, worker_id="w1", transports=FakeTransports(*hosts.values()), clock=clock)
    yield Rig(db, clock, supervisor, hosts)
    supervisor.close()
    db.dispose()
