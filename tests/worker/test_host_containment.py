"""Containment on this machine: every process an attempt starts is the attempt's, whatever it does to its
environment or session, and nothing of it outlives a cancel or the death of its wrapper.

These run the host agent (worker/hostside/) for real (LocalTransport); the layer they get is the best this host offers
(a cgroup v2 directory here, as root) unless LONGRUN_CONTAINMENT picks one.
"""

import json
import os
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from tests.service import ROOT, alive
from worker.gpu_placement import gpu_holders
from worker.host_agent import HostAgent
from worker.hostside import containment, procfs
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest, ReadFrom
from worker.transport_interface import CommandResult

SLEEP = "import time; time.sleep(600)"
# a job with three helpers: one in a session of its own (as torchrun's workers), one started with a fresh
# environment (an eval server that drops LONGRUN_ATTEMPT_TOKEN), one with both (env -i setsid)
JOB = f"""
import os, subprocess, sys, time
helpers = [
    subprocess.Popen([sys.executable, "-c", {SLEEP!r}], start_new_session=True),
    subprocess.Popen(["env", "-i", sys.executable, "-c", {SLEEP!r}]),
    subprocess.Popen(["env", "-i", "setsid", sys.executable, "-c", {SLEEP!r}]),
]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(str(p.pid) for p in helpers))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
OWN_SESSION, FRESH_ENV, ESCAPED = range(3)


def cgroup_v2_writable() -> bool:
    return "cgroup" in containment.layers()


def start_job(tmp_path: Path, token: str, env: dict[str, str] | None = None) -> tuple[HostAgent, str, list[int], int]:
    """Launch JOB; returns the agent, the attempt dir, the helpers' pids and the wrapper's pid."""
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("run1", 1)
    helpers = tmp_path / "helpers"
    answer = agent.launch(LaunchRequest(d, token, [sys.executable, "-c", JOB, str(helpers)], env or {}))
    deadline = time.time() + 30
    while not helpers.exists() and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(p) for p in helpers.read_text().split()]
    assert all(alive(p) for p in pids)
    return agent, d, pids, answer.pid


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not cgroup_v2_writable(), reason="this host offers no writable cgroup v2 hierarchy")
def test_in_a_cgroup_cancel_stops_helpers_that_left_the_session_and_dropped_the_token(tmp_path: Path) -> None:
    agent, d, helpers, wrapper = start_job(tmp_path, "tok-cgroup")
    try:
        box = json.loads((Path(d) / "containment").read_text())
        assert box["layer"] == "cgroup" and wrapper in procfs.cgroup_pids(box["cgroup"])
        assert helpers[ESCAPED] in procfs.cgroup_pids(box["cgroup"]), "env -i setsid does not leave a cgroup"
        answer = agent.cancel(d, grace=2)
        assert answer.remaining == [] and set(helpers) <= set(answer.signalled)
        assert [p for p in helpers + [wrapper] if alive(p)] == []
        assert not os.path.exists(box["cgroup"]), "the emptied cgroup is removed"
    finally:
        kill_all(helpers)


def test_in_a_session_cancel_stops_helpers_without_the_token(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback layer: what stays in the job's session is found by session id, token or not."""
    monkeypatch.setenv("LONGRUN_CONTAINMENT", "session")
    agent, d, helpers, wrapper = start_job(tmp_path, "tok-session")
    try:
        assert json.loads((Path(d) / "containment").read_text())["layer"] == "session"
        answer = agent.cancel(d, grace=2)
        assert answer.remaining == []
        assert not alive(helpers[FRESH_ENV]) and not alive(helpers[OWN_SESSION]) and not alive(wrapper)
    finally:
        kill_all(helpers)


def test_a_probe_that_finds_the_wrapper_killed_stops_the_job_it_left(tmp_path: Path) -> None:
    agent, d, helpers, wrapper = start_job(tmp_path, "tok-wrapper")
    try:
        os.kill(wrapper, signal.SIGKILL)
        while alive(wrapper):
            time.sleep(0.05)
        answer = agent.probe(d, ReadFrom())
        assert answer.state == "lost" and answer.remaining == []
        assert set(helpers[:2]) <= set(answer.stopped), "the job's processes were stopped by the probe"
        assert [p for p in helpers[:2] if alive(p)] == []
        again = agent.probe(d, ReadFrom())
        assert (again.state, again.stopped, again.exit_code) == ("lost", [], None)
    finally:
        kill_all(helpers)


def test_gpu_memory_held_by_a_helper_without_the_token_counts_as_the_attempts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, d, helpers, _ = start_job(tmp_path, "tok-gpu")
    try:
        state = tmp_path / "gpu-state.json"
        state.write_text(json.dumps({"holders": {"0": helpers[FRESH_ENV]}, "util": 90}))
        monkeypatch.setenv("FAKE_GPU_STATE", str(state))
        monkeypatch.setenv("PATH", f"{ROOT / 'tests' / 'fakegpu'}:{os.environ['PATH']}")
        view = agent.probe(d, ReadFrom(), gpu_tokens=["tok-gpu"]).gpus.view()
        assert view.token_of.get(helpers[FRESH_ENV]) == "tok-gpu"
        assert agent.cancel(d, grace=2).remaining == []
        assert not alive(helpers[FRESH_ENV])
    finally:
        kill_all(helpers)


class RecordingTransport(LocalTransport):
    def __init__(self) -> None:
        self.commands: list[str] = []

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        self.commands.append(command)
        return super().exec(command, stdin, timeout)


def test_the_launch_payload_travels_on_stdin_and_the_attempts_files_are_private(tmp_path: Path) -> None:
    transport = RecordingTransport()
    agent = HostAgent(transport, str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("run1", 1)
    script = "import os; print(os.environ['API_KEY'] == 'hunter2-secret'); open('made-by-job', 'w').close()"
    agent.launch(LaunchRequest(d, "tok-secret-123", [sys.executable, "-c", script], {"API_KEY": "hunter2-secret"}))
    assert transport.commands and not any("hunter2" in c or "tok-secret-123" in c for c in transport.commands)
    deadline = time.time() + 20
    while (p := agent.probe(d, ReadFrom())).state == "running" and time.time() < deadline:
        time.sleep(0.05)
    assert p.exit_code == 0 and p.log == "True\n", "the job still gets its env"
    for path in [Path(d), *Path(d).parents][:3]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for name in ("token", "job.json", "output.log", "pid"):
        assert stat.S_IMODE((Path(d) / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((Path(d) / "made-by-job").stat().st_mode) == 0o644, "the job keeps the caller's umask"
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                assert b"hunter2" not in Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                pass


def test_a_helper_the_job_left_behind_when_it_ended_is_stopped_by_the_probe_that_sees_the_end(
        tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("run1", 1)
    helper_file = tmp_path / "helper"
    script = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {SLEEP!r}], "
              f"start_new_session=True); open({str(helper_file)!r}, 'w').write(str(p.pid))")
    agent.launch(LaunchRequest(d, "tok-left", [sys.executable, "-c", script], {}))
    deadline = time.time() + 30
    while not (Path(d) / "exit_code").exists():
        assert time.time() < deadline, "the job did not end"
        time.sleep(0.05)
    helper = int(helper_file.read_text())
    try:
        assert alive(helper), "the job ended and left its helper running"
        answer = agent.probe(d, ReadFrom())
        assert (answer.state, answer.exit_code, answer.remaining) == ("exited", 0, [])
        assert helper in answer.stopped and not alive(helper)
    finally:
        kill_all([helper])


def test_the_end_of_one_node_stops_nothing_of_another_node_of_the_attempt_on_the_same_host(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    first, second = agent.layout.attempt_dir("run1", 1), agent.layout.attempt_dir("run1", 1, node=1)
    agent.launch(LaunchRequest(first, "tok-nodes", [sys.executable, "-c", "pass"], {}))
    other = agent.launch(LaunchRequest(second, "tok-nodes", [sys.executable, "-c", SLEEP], {})).pid
    deadline = time.time() + 30
    while (answer := agent.probe(first, ReadFrom())).state != "exited":
        assert time.time() < deadline, "node 0 did not end"
        time.sleep(0.05)
    try:
        assert answer.stopped == [] and alive(other), "node 1 shares the token, not the node"
        cgroup = json.loads((Path(first) / "containment").read_text())["cgroup"]
        assert cgroup is None or not os.path.exists(cgroup), "the ended node's cgroup is removed"
        assert agent.probe(second, ReadFrom()).state == "running"
    finally:
        assert agent.cancel(second, grace=2).remaining == []


GPU_HELPER = """
import os, subprocess, sys
held = sys.argv[1]
script = ("import sys, time, torch; x = torch.empty(256 << 20, dtype=torch.uint8, device='cuda'); "
          "torch.cuda.synchronize(); open(sys.argv[1], 'w').write('held'); time.sleep(600)")
subprocess.Popen(["env", "-i", sys.executable, "-c", script, held])
import time; time.sleep(600)
"""


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs a GPU and nvidia-smi")
def test_on_a_gpu_memory_held_by_a_helper_without_the_token_is_the_attempts_and_freed_by_cancel(
        tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("run1", 1)
    held = tmp_path / "held"
    agent.launch(LaunchRequest(d, "tok-real-gpu", [sys.executable, "-c", GPU_HELPER, str(held)], {}))
    deadline = time.time() + 120
    while not held.exists():
        assert time.time() < deadline, f"the helper never held GPU memory: {Path(d, 'output.log').read_text()}"
        time.sleep(0.2)
    view = agent.probe(d, ReadFrom(), gpu_tokens=["tok-real-gpu"]).gpus.view()
    ours = view.pids_of({"tok-real-gpu"})
    assert ours, f"nvidia-smi lists the helper's memory as the attempt's: {view.snapshot}"
    answer = agent.cancel(d, grace=5, gpu_tokens=["tok-real-gpu"])
    assert answer.remaining == [] and answer.gpus is not None
    assert gpu_holders(answer.gpus.view(), "tok-real-gpu", set(answer.signalled)) == []
