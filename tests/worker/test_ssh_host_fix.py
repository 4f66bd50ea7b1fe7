"""A user fixes a host they registered with the wrong key, with the command the refusal names, through the real
`longrun` command against a real server and a real OpenSSH server; then addresses the run by its name to restart,
cancel and delete it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service import ROOT, Service
from tests.worker import test_ssh_service
from tests.worker.test_ssh_service import Rig, at_step, run_processes, ssh_spec

rig = test_ssh_service.rig  # its sshd rig, not the in-process one of tests/worker/conftest.py

pytestmark = pytest.mark.slow  # a real server, sshd and torchrun


def longrun(svc: Service, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "longrun.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LONGRUN_URL": svc.url}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr + done.stdout
    return done


def test_a_wrong_host_key_is_fixed_with_hosts_update_and_the_run_restarted_cancelled_and_deleted_by_name(
        rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    other = rig.tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    workspace = rig.host(svc, "box", sshd, host_key=Path(f"{other}.pub").read_text().strip())

    run = svc.submit(ssh_spec("box", steps=400, sleep=0.05, nproc=1) | {"name": "fix-me"})
    failed = svc.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=30)
    assert failed["status"] == "failed" and "refusing to connect" in failed["message"]
    command = re.search(r'longrun hosts update box --host-key "([^"]+)"', failed["message"])
    assert command, failed["message"]
    assert command.group(1) == " ".join(sshd.host_key_line.split()[:2])
    assert list(workspace.iterdir()) == []

    longrun(svc, "hosts", "update", "box", "--host-key", command.group(1))
    longrun(svc, "restart", "fix-me")
    running = svc.wait(run["id"], lambda r: r["attempt"] == 2 and at_step(3)(r), what="attempt 2 on the fixed host")
    assert running["attempts"][1]["status"] == "running"
    assert run_processes(workspace)

    cancelled = longrun(svc, "cancel", "fix-me", "--wait", "--json")
    assert '"status": "cancelled"' in cancelled.stdout
    assert run_processes(workspace) == []
    longrun(svc, "delete", "fix-me")
    assert svc.client.get(f"/v1/runs/{run['id']}").status_code == 404
    assert svc.client.get("/v1/runs/fix-me").status_code == 404
