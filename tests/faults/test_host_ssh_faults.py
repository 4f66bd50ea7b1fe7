"""The host-side rows of the fault matrix that need a real sshd (docs/reliability.md): the SSH server killed in
the middle of an action, then started again."""

import sys
import time
from pathlib import Path

import pytest

from tests.faults.test_host_faults import HERE, steps_of
from tests.service import STUB_ENV, Service, attempt_processes, kill_leftovers
from tests.sshd import SshServer

pytestmark = pytest.mark.slow  # a real server, sshd and torchrun


def test_sshd_killed_mid_cancel_keeps_the_run_cancelling_until_the_host_answers_then_leaves_nothing(
        tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", ssh_connect_timeout=2, ssh_command_timeout=5, cancel_grace=4)
    svc.home.mkdir()
    workspace = tmp_path / "ws-box"
    workspace.mkdir()
    try:
        with SshServer() as sshd:
            svc.start()
            body = {"name": "box", **sshd.host_fields, "workspace": str(workspace), "python": sys.executable}
            assert svc.client.post("/v1/hosts", json=body).status_code == 201
            run = svc.submit({"name": "stubborn", "host": "box", "nproc_per_node": 1,
                              "entrypoint": str(HERE / "job_ignores_sigterm.py"), "args": [],
                              "env": STUB_ENV})
            running = svc.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                               what="five steps")
            assert attempt_processes(running, 1)
            assert svc.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
            time.sleep(1.5)  # the cancel waits out its grace on the host: the job ignores SIGTERM
            sshd.stop()
            away = svc.wait(run["id"], lambda r: r["host_reachable"] is False, timeout=60, what="host away")
            assert away["status"] == "cancelling" and "host not answering" in away["message"], away
            sshd.start()
            done = svc.wait_status(run["id"], "cancelled", "failed", timeout=60)
            assert done["status"] == "cancelled" and done["message"] == "cancelled; no process of the run remains"
            # the step that ends the run clears the unreachable mark in its next transaction
            svc.wait(run["id"], lambda r: r["host_reachable"] is True, timeout=30, what="host marked answering")
            assert attempt_processes(done, 1) == []
            steps = steps_of(svc, run["id"], 1)
            assert steps[:5] == [1, 2, 3, 4, 5] and steps == list(range(1, len(steps) + 1)), \
                "each metric line up to the stop stored once"
    finally:
        svc.stop()
        kill_leftovers(workspace)
