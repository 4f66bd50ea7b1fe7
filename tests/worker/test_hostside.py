"""The host-side agent on this machine: launch, probe, cancel and clean without the service."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from worker.host_agent import HostAgent
from worker.host_errors import CommandFailed
from worker.hostside.clean import clean
from worker.hostside.files import LOG_FILE
from worker.hostside.procfs import pids_with_token
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest, ReadFrom

JOB = """
import json, os, time, subprocess, sys
# a child in a session of its own, as torchrun's workers are
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    for i in range(1, 1000):
        f.write(json.dumps({"step": i}) + "\\n"); f.flush(); time.sleep(0.02)
"""


def _agent(tmp_path: Path) -> HostAgent:
    return HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)


def test_cancel_reaches_processes_in_their_own_session(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    d = agent.layout.attempt_dir("run1", 1)
    launch = LaunchRequest(d, "tok123", [sys.executable, "-c", JOB], {})
    agent.launch(launch)
    assert agent.launch(launch).already, "launch is idempotent"
    deadline = time.time() + 20
    while len(pids_with_token("tok123")) < 3 and time.time() < deadline:
        time.sleep(0.1)
    assert len(pids_with_token("tok123")) >= 3, "wrapper, job and its detached child"
    probe = agent.probe(d, ReadFrom())
    assert probe.state == "running" and probe.metrics.endswith("\n")
    answer = agent.cancel(d, grace=2)
    assert answer.remaining == [] and pids_with_token("tok123") == []
    assert agent.probe(d, ReadFrom()).state == "exited"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


def test_a_cancel_while_the_wrapper_is_still_starting_stops_the_job_it_starts(tmp_path: Path) -> None:
    """The launch answers once the wrapper is in its session, before its interpreter has started the job. A cancel
    in that window still stops the job on request at once, not by SIGKILL when the grace period runs out. The
    wrapper is held in that window, whatever the machine's load: its log is a FIFO, whose opening (after the
    wrapper's look for a stop, before it starts the job) waits for this test to read it."""
    agent = _agent(tmp_path)
    job = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(600)\n"
    d = agent.layout.attempt_dir("early", 1)
    Path(d).mkdir(parents=True)
    os.mkfifo(Path(d) / LOG_FILE)
    wrapper = agent.launch(LaunchRequest(d, "tok-early", [sys.executable, "-c", job], {})).pid
    assert not _children(wrapper), "the wrapper waits on its log before starting the job"

    def release() -> None:  # after the cancel's signals went out: the wrapper opens its log and starts the job
        time.sleep(0.5)
        with open(Path(d) / LOG_FILE, "rb") as log:
            log.read()

    reader = threading.Thread(target=release, daemon=True)
    reader.start()
    answer = agent.cancel(d, grace=5)
    reader.join(30)
    # 143: the job was told (SIGTERM); one never told is SIGKILLed with its wrapper when the grace runs out (137)
    assert answer.remaining == [] and answer.exit_code == 143, answer
    assert pids_with_token("tok-early") == []


def test_exit_code_and_partial_lines(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    d = agent.layout.attempt_dir("run2", 1)
    script = "import os,sys; open(os.environ['LONGRUN_METRICS_FILE'],'w').write('{\"step\": 1}\\n{\"st'); " \
             "print('no newline at the end', end=''); sys.exit(7)"
    agent.launch(LaunchRequest(d, "tok456", [sys.executable, "-c", script], {}))
    deadline = time.time() + 20
    while (p := agent.probe(d, ReadFrom())).state == "running" and time.time() < deadline:
        time.sleep(0.1)
    assert p.state == "exited" and p.exit_code == 7
    # once the job is over, its unfinished last lines are final: handed out (the worker says when the metric line
    # is not one: tests/worker/test_attempt_reads.py)
    assert p.metrics == '{"step": 1}\n{"st', "the job's last metric line is, without its newline"
    assert p.log.endswith("no newline at the end"), "and its last log line"


def test_clean_only_inside_the_workspace(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    ws = Path(agent.layout.workspace)
    (ws / "out" / "sub").mkdir(parents=True)
    (ws / "out" / "sub" / "f").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    os.symlink(outside, ws / "link")
    for bad in [str(outside), str(ws / ".." / "outside"), str(ws / "link"), str(ws), "relative/path",
                str(ws / ".longrun")]:
        try:
            agent.clean(bad)
        except CommandFailed as exc:
            assert "refusing to clean" in str(exc)
        else:
            raise AssertionError(f"clean of {bad} was not refused")
    assert (outside / "keep").read_text() == "keep"
    assert agent.clean(str(ws / "out")).removed == 1
    assert list((ws / "out").iterdir()) == []


def test_clean_refuses_a_workspace_whose_real_path_is_the_root(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_text("precious")
    os.symlink("/", tmp_path / "to-root")
    for workspace in ["/", "//", "/./", "/tmp/..", str(tmp_path / "to-root")]:
        answer = clean({"workspace": workspace, "records": workspace + "/.longrun", "path": str(victim)})
        assert "it is the root directory" in answer.get("error", ""), workspace
    assert (victim / "data").read_text() == "precious"


def test_clean_never_follows_a_parent_swapped_for_a_symlink_while_it_runs(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "out" / "sub").mkdir(parents=True)
    (ws / "out" / "sub" / "f").write_text("x")
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep").write_text("keep")
    real_open, real_listdir = os.open, os.listdir

    def swap() -> None:
        # what another user of the host does between clean's check and its delete
        if not (ws / "out").is_symlink():
            os.rename(ws / "out", ws / "out.moved")
            os.symlink(outside, ws / "out")

    monkeypatch.setattr(os, "open", lambda *a, **k: (swap(), real_open(*a, **k))[1])
    monkeypatch.setattr(os, "listdir", lambda *a, **k: (swap(), real_listdir(*a, **k))[1])
    answer = clean({"workspace": str(ws), "records": str(ws / ".longrun"), "path": str(ws / "out" / "sub")})
    monkeypatch.undo()
    assert (outside / "sub" / "keep").read_text() == "keep"
    assert "refusing to clean" in answer["error"] and "never followed" in answer["error"]


def test_clean_keeps_the_draft_aside_then_empties_the_directory_by_descriptors(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    ws = Path(agent.layout.workspace)
    out = ws / "out"
    (out / "deep" / "deeper").mkdir(parents=True)
    (out / "deep" / "deeper" / "f").write_text("x")
    (out / "model.safetensors").write_text("weights")
    (out / "config.json").write_text("{}")
    os.symlink(tmp_path, out / "link-out")
    answer = agent.clean(str(out), keep_into=str(ws / ".longrun" / "r1" / "draft-before-attempt-2"))
    assert sorted(answer.kept) == ["config.json", "model.safetensors"] and answer.removed == 2
    assert list(out.iterdir()) == [] and tmp_path.exists(), "a symlink inside is removed, never followed"
    assert (ws / ".longrun" / "r1" / "draft-before-attempt-2" / "model.safetensors").read_text() == "weights"


# a launcher as torchrun behaves on SIGTERM: passes it to its worker, waits for it, then finishes at length
LAUNCHER = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable] + sys.argv[1:], start_new_session=True)
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(worker.send_signal(signal.SIGTERM)))
while worker.poll() is None:
    time.sleep(0.05)
if stopping:
    time.sleep(30)
"""

WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(print("worker stopping", flush=True)))
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def _slow_launcher_job(tmp_path: Path, module: str) -> tuple[HostAgent, str, str]:
    """A job under a launcher that finishes slowly after SIGTERM; (agent, attempt dir, the attempt's token: one
    of its own, since tests in other processes look for their tokens meanwhile)."""
    token = f"tok-{module}-{os.getpid()}"
    *packages, name = module.split(".")
    package = tmp_path / "launchers"
    for part in packages:  # regular packages, so that they shadow the installed torch
        package = package / part
        package.mkdir(parents=True)
        (package / "__init__.py").touch()
    package.mkdir(parents=True, exist_ok=True)
    (package / f"{name}.py").write_text(LAUNCHER)
    (tmp_path / "worker.py").write_text(WORKER)
    started = tmp_path / "started"
    agent = _agent(tmp_path)
    d = agent.layout.attempt_dir("run9", 1)
    agent.launch(LaunchRequest(d, token, [sys.executable, "-m", module, str(tmp_path / "worker.py"),
                                             str(started)], {"PYTHONPATH": str(tmp_path / "launchers")}))
    deadline = time.time() + 20
    while not started.exists():
        assert time.time() < deadline, "the worker did not start"
        time.sleep(0.05)
    return agent, d, token


@pytest.mark.slow  # real processes through a stop
def test_a_stop_does_not_wait_for_torchrun_to_finalize_once_its_workers_are_gone(tmp_path: Path) -> None:
    agent, d, token = _slow_launcher_job(tmp_path, "torch.distributed.run")
    answer = agent.cancel(d, grace=20)
    assert answer.remaining == [] and pids_with_token(token) == []
    # the launcher finalizes for 30 s after its workers are gone: waited for, the grace (20 s) would run out and
    # SIGKILL it (137)
    assert answer.exit_code == 143, "stopped on request (SIGTERM) without waiting for torchrun's teardown"


@pytest.mark.slow  # real processes through a stop
def test_a_real_torchrun_stopped_on_request_reads_as_sigterm_not_sigkill(tmp_path: Path) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    started = tmp_path / "started"
    agent = _agent(tmp_path)
    d, token = agent.layout.attempt_dir("run8", 1), f"tok-torchrun-{os.getpid()}"
    agent.launch(LaunchRequest(d, token, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node=2", str(tmp_path / "worker.py"), str(started)], {}))
    deadline = time.time() + 60
    while not started.exists():
        assert time.time() < deadline, "torchrun's workers did not start"
        time.sleep(0.05)
    answer = agent.cancel(d, grace=20)
    assert answer.remaining == [] and pids_with_token(token) == []
    assert answer.exit_code == 143
    probe = agent.probe(d, ReadFrom())
    assert (probe.state, probe.exit_code) == ("exited", 143), "the wrapper's SIGKILL seen after does not replace it"
    assert "worker stopping" in probe.log


@pytest.mark.slow  # real processes through a stop
def test_any_other_program_still_finishing_after_sigterm_gets_its_grace(tmp_path: Path) -> None:
    agent, d, token = _slow_launcher_job(tmp_path, "mylauncher")
    asked = time.monotonic()
    answer = agent.cancel(d, grace=2)
    assert time.monotonic() - asked >= 2, "killed before its grace was up"
    assert answer.remaining == [] and pids_with_token(token) == []
