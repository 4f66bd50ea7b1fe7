"""Service-side faults driven through the real worker services over in-memory hosts (tests/worker/fake_host.py):
an API call landing between the worker's transactions, and a job that writes what it should not."""

import json
from typing import Any

from server.lifecycle import nodes_of
from server.runs import request_restart
from server.schemas import RestartRequest
from tests.worker.conftest import Rig, migrated_db, rig  # noqa: F401 - the worker's fixtures, shared

__all__ = ["migrated_db", "rig"]


def _restart_via_api(rig: Rig, run_id: str, **overrides: Any) -> None:
    with rig.db.writing() as s:
        request_restart(s, run_id, RestartRequest(overrides=overrides))


def test_a_restart_landing_while_the_worker_launches_stops_the_attempt_it_launched(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id)  # queued -> launching
    host = rig.hosts["a"]
    launch = host._launch

    def restart_then_launch(req: dict[str, Any]) -> dict[str, Any]:
        # the API's restart commits after the worker planned the nodes and before the launch is recorded
        _restart_via_api(rig, run_id, args=["--again"])
        return launch(req)

    host._launch = restart_then_launch  # type: ignore[method-assign]
    rig.step(run_id)
    host._launch = launch  # type: ignore[method-assign]
    first = host.job(run_id, 1)
    assert first.alive, "attempt 1 was launched before the restart was seen"
    rig.step(run_id)
    run = rig.run(run_id)
    assert not first.alive, "the attempt launched during the restart is stopped before attempt 2 starts"
    assert run.status == "running" and run.attempt == 2
    assert [j.alive for j in host.jobs.values()] == [False, True], "exactly one copy of the job runs"
    assert run.attempts[0].status == "cancelled" and run.attempts[0].message == "superseded by attempt 2"
    rig.cancel(run_id)
    rig.step(run_id)
    assert rig.run(run_id).status == "cancelled" and not any(j.alive for j in host.jobs.values())


def test_a_restart_before_any_launch_still_drops_the_attempt_at_once(rig: Rig) -> None:
    run_id = rig.submit()
    _restart_via_api(rig, run_id, args=["--again"])
    first = rig.attempt(run_id, 1)
    assert (first.status, first.message) == ("cancelled", "never started")
    rig.step(run_id)
    assert rig.run(run_id).status == "running" and list(rig.hosts["a"].jobs) == ["/ws/.longrun/run1/2"]
    assert nodes_of(rig.attempt(run_id, 2))[0].state == "running"
    assert json.dumps(rig.statuses(run_id)) == json.dumps(["queued", "restarting", "launching", "running"])
