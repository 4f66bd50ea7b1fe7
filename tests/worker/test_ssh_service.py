"""Runs on SSH hosts through a real `longrun serve`: real OpenSSH servers, on 127.0.0.1 or inside network
namespaces (separate hosts with their own addresses), and real torchrun jobs (examples/toy_train.py)."""

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.netns import NetNamespace, PrivateNetwork
from tests.service import Service, attempt_processes, kill_leftovers, toy_spec
from tests.sshd import SshServer

# real sshd, servers and torchrun: excluded from the fast subset (-m 'not slow')
pytestmark = pytest.mark.slow

# fail fast while a host is away, so outages in these tests stay a few seconds long
SSH_SETTINGS = {"ssh_connect_timeout": 2, "ssh_command_timeout": 5}

pytestmark = pytest.mark.slow  # a real server and sshd


class Rig:
    """Services, sshd servers, namespaces and host workspaces of one test, all torn down after it."""

    def __init__(self, tmp_path: Path, stack: contextlib.ExitStack):
        self.tmp_path = tmp_path
        self.stack = stack
        self.services: list[Service] = []
        self.workspaces: list[Path] = []

    def service(self, **settings: Any) -> Service:
        svc = Service(self.tmp_path / f"home{len(self.services)}", **{**SSH_SETTINGS, **settings})
        svc.home.mkdir()
        self.services.append(svc)
        self.workspaces.append(svc.workspace)
        svc.start()
        return svc

    def sshd(self, netns: NetNamespace | None = None) -> SshServer:
        return self.stack.enter_context(SshServer(netns=netns))

    def network(self) -> PrivateNetwork:
        return self.stack.enter_context(PrivateNetwork())

    def namespace(self, network: PrivateNetwork | None = None) -> NetNamespace:
        return self.stack.enter_context(network.namespace() if network else NetNamespace())

    def host(self, svc: Service, name: str, sshd: SshServer, **fields: Any) -> Path:
        """Register `sshd` as host `name`; returns its workspace (a directory of ours: namespaces share our files)."""
        workspace = self.tmp_path / f"ws-{name}"
        workspace.mkdir(exist_ok=True)
        self.workspaces.append(workspace)
        body = {"name": name, **sshd.host_fields, "workspace": str(workspace), "python": sys.executable, **fields}
        r = svc.client.post("/v1/hosts", json=body)
        assert r.status_code == 201, r.text
        return workspace

    def close(self) -> None:
        # services first, so no worker launches anything while we sweep
        for svc in self.services:
            svc.stop()
        for workspace in self.workspaces:
            kill_leftovers(workspace)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with contextlib.ExitStack() as stack:
        r = Rig(tmp_path, stack)
        try:
            yield r
        finally:
            # services and jobs go before the sshd servers and namespaces they ran under
            r.close()


def run_processes(workspace: Path) -> list[int]:
    """Every live process of any run on the host with this workspace (each carries its attempt dir)."""
    prefix = f"LONGRUN_ATTEMPT_DIR={workspace}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(v.startswith(prefix) for v in (entry / "environ").read_bytes().split(b"\0")):
                    found.append(int(entry.name))
    return found


def ssh_spec(host: str | list[str], **kwargs: Any) -> dict[str, Any]:
    spec = toy_spec(**kwargs)
    del spec["host"]
    spec["hosts" if isinstance(host, list) else "host"] = host
    return spec


def steps_of(svc: Service, run_id: str, **params: Any) -> list[int]:
    return [p["step"] for p in svc.series(run_id, "loss", **params)]


def at_step(n: int):
    return lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= n


def test_submit_watch_restart_and_cancel_over_ssh(rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    workspace = rig.host(svc, "box", sshd)

    run = svc.submit(ssh_spec("box", steps=400, sleep=0.05))
    running = svc.wait(run["id"], at_step(5), what="metrics over SSH")
    assert 0 < running["progress"] < 1 and running["eta_seconds"] is not None
    assert running["host_reachable"] is True and "loss" in running["latest"]
    assert running["attempts"][0]["log_path"] == f"{workspace}/.longrun/{run['id']}/1/output.log"
    assert len(attempt_processes(running, 1)) >= 4, "wrapper, torchrun agent and two workers expected"
    svc.wait(run["id"], lambda r: any("world size 2" in line for line in svc.logs(r["id"], tail=50)),
             what="the job's log")
    assert svc.client.get("/v1/hosts/box").json()["reachable"] is True

    # restart with changed args: attempt 1 is stopped on the host before attempt 2 starts there, with the new args
    new_args = ["--steps", "1000", "--sleep", "0.05", "--label", "second"]
    r = svc.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": new_args}})
    assert r.status_code == 202, r.text
    running = svc.wait(run["id"], lambda x: x["attempt"] == 2 and at_step(2)(x), what="attempt 2 running")
    first, second = running["attempts"]
    assert first["status"] == "cancelled" and second["status"] == "running"
    assert first["ended_at"] <= second["started_at"]
    assert attempt_processes(running, 1) == [] and attempt_processes(running, 2)
    assert any('"--label", "second"' in line for line in svc.logs(run["id"], attempt=2, tail=50))
    assert not any('"second"' in line for line in svc.logs(run["id"], attempt=1, tail=50))

    # cancel: no process of the run remains on the host
    assert svc.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    cancelled = svc.wait_status(run["id"], "cancelled", "failed", timeout=60)
    assert cancelled["status"] == "cancelled", cancelled
    assert [a["status"] for a in cancelled["attempts"]] == ["cancelled", "cancelled"]
    assert run_processes(workspace) == []


def test_wrong_host_key_fails_the_run_and_runs_nothing(rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    other = rig.tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    workspace = rig.host(svc, "impostor", sshd, host_key=Path(f"{other}.pub").read_text().strip())

    run = svc.submit(ssh_spec("impostor", steps=5, nproc=1))
    done = svc.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=30)
    assert done["status"] == "failed"
    assert "host key" in done["message"] and "refusing to connect" in done["message"]
    assert done["attempts"][0]["status"] == "failed" and "host key" in done["attempts"][0]["message"]
    assert list(workspace.iterdir()) == [], "nothing may be written or run on a host we do not trust"
    assert run_processes(workspace) == []


def test_sshd_stopped_mid_run_then_back_loses_and_duplicates_no_metric(rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    rig.host(svc, "box", sshd)

    run = svc.submit(ssh_spec("box", steps=120, sleep=0.08, nproc=1))
    svc.wait(run["id"], at_step(10), what="ten steps")
    sshd.stop()
    # a command in flight fails after ssh_command_timeout (5 s) and the connection's check after ssh_connect_timeout
    # (2 s), so the host is marked away about 7 s after the link went down on a quiet machine; 60 s bounds that on a
    # loaded one (20 s ran out beside the rest of the integration lane)
    away = svc.wait(run["id"], lambda r: r["host_reachable"] is False, timeout=60, what="host_reachable: false")
    assert away["status"] == "running" and "host not answering" in away["message"], away
    host = svc.client.get("/v1/hosts/box").json()
    assert host["reachable"] is False and host["last_error"], host
    time.sleep(2)  # the job keeps writing metrics nobody can read
    assert svc.run(run["id"])["status"] == "running"
    sshd.start()
    back = svc.wait(run["id"], lambda r: r["host_reachable"] is True, timeout=60, what="host back")
    assert back["status"] in ("running", "succeeded"), back
    assert "not answering" not in back["message"], back["message"]
    host = svc.client.get("/v1/hosts/box").json()
    assert host["reachable"] is True and host["last_error"] is None and host["last_seen_at"], host
    done = svc.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert steps_of(svc, run["id"]) == list(range(1, 121))
    assert sum("step 120/120" in line for line in svc.logs(run["id"])) == 1


def test_link_down_while_the_job_ends_reports_its_real_exit_code_and_every_metric(rig: Rig) -> None:
    svc = rig.service()
    ns = rig.namespace()
    sshd = rig.sshd(netns=ns)
    rig.host(svc, "far", sshd)

    run = svc.submit(ssh_spec("far", steps=60, sleep=0.1, nproc=1, args=["--fail-at", "60"]))
    running = svc.wait(run["id"], at_step(10), what="ten steps")
    exit_file = Path(running["attempts"][0]["nodes"][0]["dir"]) / "exit_code"
    ns.set_link(False)
    # a command in flight fails after ssh_command_timeout (5 s) and the connection's check after ssh_connect_timeout
    # (2 s), so the host is marked away about 7 s after the link went down on a quiet machine; 60 s bounds that on a
    # loaded one (20 s ran out beside the rest of the integration lane)
    away = svc.wait(run["id"], lambda r: r["host_reachable"] is False, timeout=60, what="host_reachable: false")
    assert away["status"] == "running", away
    deadline = time.monotonic() + 60
    while not exit_file.exists():  # the job ends while nobody can see the host
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.2)
    assert svc.run(run["id"])["status"] == "running"
    ns.set_link(True)
    # the outcome is stored in the step that reads it, the host marked answering just after: wait for both
    done = svc.wait(run["id"], lambda r: r["status"] in ("succeeded", "failed") and r["host_reachable"] is True,
                    timeout=60, what="the run ended and its host answering")
    code = int(exit_file.read_text())
    assert code not in (0, None)
    assert done["status"] == "failed" and done["host_reachable"] is True
    assert done["attempts"][0]["exit_code"] == code
    assert f"exited with code {code} on far" in done["message"]
    assert steps_of(svc, run["id"]) == list(range(1, 61))


def test_host_away_past_the_deadline_fails_the_run_saying_so(rig: Rig) -> None:
    svc = rig.service(unreachable_deadline=3)
    sshd = rig.sshd()
    rig.host(svc, "box", sshd)

    run = svc.submit(ssh_spec("box", steps=1000, sleep=0.05, nproc=1))
    svc.wait(run["id"], at_step(2), what="running")
    sshd.stop()
    started = time.monotonic()
    done = svc.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=30)
    assert time.monotonic() - started >= 3
    assert done["status"] == "failed" and done["host_reachable"] is False
    assert "unreachable" in done["message"] and "3s" in done["message"], done["message"]
    assert "unreachable" in done["attempts"][0]["message"]


def test_a_job_left_running_past_the_deadline_is_stopped_once_the_host_answers_again(rig: Rig) -> None:
    svc = rig.service(unreachable_deadline=3)
    sshd = rig.sshd()
    workspace = rig.host(svc, "box", sshd)

    run = svc.submit(ssh_spec("box", steps=2000, sleep=0.05, nproc=1))
    svc.wait(run["id"], at_step(2), what="running")
    sshd.stop()
    failed = svc.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=30)
    assert failed["status"] == "failed" and "unreachable" in failed["message"], failed
    assert run_processes(workspace), "the job goes on while nobody can reach the host"
    assert svc.client.get("/v1/hosts/box").json()["reachable"] is False
    sshd.start()
    deadline = time.monotonic() + 30
    while run_processes(workspace):
        assert time.monotonic() < deadline, f"processes of the failed run still alive: {run_processes(workspace)}"
        time.sleep(0.2)
    done = svc.run(run["id"])
    assert done["status"] == "failed" and done["attempts"][0]["status"] == "failed", done
    assert svc.wait(run["id"], lambda r: svc.client.get("/v1/hosts/box").json()["reachable"] is True,
                    timeout=10, what="host marked reachable")


def test_two_node_run_across_two_namespaces_cancels_on_both_and_trains_to_the_end(rig: Rig) -> None:
    svc = rig.service()
    net = rig.network()
    a, b = rig.namespace(net), rig.namespace(net)
    ws = {"a": rig.host(svc, "a", rig.sshd(netns=a)), "b": rig.host(svc, "b", rig.sshd(netns=b))}

    run = svc.submit(ssh_spec(["a", "b"], steps=2000, sleep=0.05, nproc=1))
    running = svc.wait(run["id"], at_step(3), timeout=60, what="two nodes training")
    assert any("world size 2" in line for line in svc.logs(run["id"], tail=50))
    assert [n["host"] for n in running["attempts"][0]["nodes"]] == ["a", "b"]
    for name in ws:
        assert run_processes(ws[name]), f"no process of the run on {name}"
    assert svc.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    cancelled = svc.wait_status(run["id"], "cancelled", "failed", timeout=60)
    assert cancelled["status"] == "cancelled", cancelled
    assert run_processes(ws["a"]) == [] and run_processes(ws["b"]) == []

    r = svc.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": ["--steps", "20"]}})
    assert r.status_code == 202, r.text
    done = svc.wait_status(run["id"], "succeeded", "failed", timeout=90)
    assert done["status"] == "succeeded", done
    assert steps_of(svc, run["id"], attempt=2) == list(range(1, 21))
    assert run_processes(ws["a"]) == [] and run_processes(ws["b"]) == []


def test_server_killed_mid_run_finds_the_ssh_run_again(rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    rig.host(svc, "box", sshd)

    run = svc.submit(ssh_spec("box", steps=80, sleep=0.1, nproc=1))
    svc.wait(run["id"], at_step(10), what="ten steps")
    svc.kill()
    time.sleep(3)  # the job keeps writing metrics while no server reads them
    svc.start()
    done = svc.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert steps_of(svc, run["id"]) == list(range(1, 81))


def test_a_workspace_that_leads_to_the_root_on_the_host_is_refused_at_registration_and_on_change(rig: Rig) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    root, etc = rig.tmp_path / "ws-root", rig.tmp_path / "ws-etc"
    root.symlink_to("/")
    etc.symlink_to("/etc")
    body = {"name": "box", **sshd.host_fields, "workspace": str(root), "python": sys.executable}
    refused = svc.client.post("/v1/hosts", json=body)
    assert refused.status_code == 422, refused.text
    assert [e["loc"] for e in refused.json()["detail"]] == [["body", "workspace"]] and "leads to / " in refused.text
    assert svc.client.get("/v1/hosts/box").status_code == 404, "nothing registered"
    workspace = rig.host(svc, "box", sshd)
    assert svc.client.get("/v1/hosts/box").json()["workspace_real"] == os.path.realpath(workspace)
    moved = svc.client.patch("/v1/hosts/box", json={"workspace": str(etc)})
    assert moved.status_code == 422 and "leads to /etc " in moved.text, moved.text
    shown = svc.client.get("/v1/hosts/box").json()
    assert (shown["workspace"], shown["workspace_real"]) == (str(workspace), os.path.realpath(workspace)), "undone"
    run = svc.submit(ssh_spec("box", steps=3, sleep=0.01))
    assert svc.wait_status(run["id"], "succeeded", "failed")["status"] == "succeeded"


# the host's python, answering the host agent badly while a fault file of the test says so: `once` (one stray line
# instead of the answer), `killed` (the agent's answer cut off, then a SIGKILL, as an out-of-memory kill does),
# `always` (the agent does its work but its answer is garbage, every call); anything else runs as the real python
FAULTY_PYTHON = """#!/bin/sh
faults={faults}
if [ "$1" = "-S" ]; then
    if mv "$faults/once" "$faults/once.taken" 2>/dev/null; then
        cat > /dev/null; echo "NOT JSON"; exit 0
    fi
    if mv "$faults/killed" "$faults/killed.taken" 2>/dev/null; then
        {python} "$@" > "$faults/answer"; head -c 20 "$faults/answer"; kill -9 $$
    fi
    if [ -e "$faults/always" ]; then
        {python} "$@" > /dev/null; echo "NOT JSON"; exit 0
    fi
fi
exec {python} "$@"
"""


def faulty_python(tmp_path: Path) -> tuple[Path, Path]:
    """A python for a host, and the directory of its fault files."""
    faults = tmp_path / "faults"
    faults.mkdir()
    python = tmp_path / "faulty-python"
    python.write_text(FAULTY_PYTHON.format(faults=faults, python=sys.executable))
    python.chmod(0o755)
    return python, faults


def test_one_unreadable_or_cut_off_agent_answer_leaves_the_run_running(rig: Rig, tmp_path: Path) -> None:
    svc = rig.service()
    sshd = rig.sshd()
    python, faults = faulty_python(tmp_path)
    rig.host(svc, "box", sshd, python=str(python))

    run = svc.submit(ssh_spec("box", steps=2000, sleep=0.05, nproc=1))
    svc.wait(run["id"], at_step(2), what="running")
    for fault in ("once", "killed"):
        (faults / fault).touch()
        deadline = time.monotonic() + 60
        while not (faults / f"{fault}.taken").exists():
            assert time.monotonic() < deadline, f"no agent call met the fault {fault}"
            time.sleep(0.1)
        step = svc.run(run["id"])["latest"].get("step") or 0
        after = svc.wait(run["id"], lambda r, step=step: r["status"] != "running"
                         or (r["latest"].get("step") or 0) > step + 5, what=f"steps after the fault {fault}")
        assert after["status"] == "running" and after["host_reachable"] is True, after
    assert svc.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    assert svc.wait_status(run["id"], "cancelled", "failed")["status"] == "cancelled"


def test_an_agent_that_keeps_answering_garbage_fails_the_run_saying_so_and_leaves_no_process(
        rig: Rig, tmp_path: Path) -> None:
    svc = rig.service(unreachable_deadline=3)
    sshd = rig.sshd()
    python, faults = faulty_python(tmp_path)
    workspace = rig.host(svc, "box", sshd, python=str(python))

    run = svc.submit(ssh_spec("box", steps=2000, sleep=0.05, nproc=1))
    running = svc.wait(run["id"], at_step(2), what="running")
    assert attempt_processes(running, 1)
    (faults / "always").touch()
    done = svc.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=60)
    assert done["status"] == "failed", done
    assert done["message"].startswith("host unreachable for more than 3s: ") and \
        "no readable answer from the host agent (exit 0): 'NOT JSON' (3 tries in a row)" in done["message"], \
        done["message"]
    deadline = time.monotonic() + 60
    while run_processes(workspace):  # stopped by the orphan reaper, whose cancel the host ran
        assert time.monotonic() < deadline, f"processes of the failed run still alive: {run_processes(workspace)}"
        time.sleep(0.2)
