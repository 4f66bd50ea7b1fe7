"""The host agent's Slurm module (worker/hostside/slurm.py) against a real Slurm cluster (tests/slurm.py), verb by verb: a submit whose answer
was lost is found again, not made twice; the token is in the job's environment and nowhere else; cancel ends the
job and verifies it through Slurm and /proc, and says so again when asked twice; a held job answers pending with
Slurm's reason."""

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm import SlurmCluster
from worker.host_agent import HostAgent
from worker.hostside.procfs import pids_with_token
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest, ReadFrom, SlurmBatch

pytestmark = pytest.mark.slow  # a real Slurm cluster

SLEEPER = "#!/bin/bash\necho started on $SLURMD_NODENAME\nexec sleep 300\n"


@pytest.fixture
def agent(tmp_path: Path, slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostAgent]:
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    yield HostAgent(LocalTransport(), str(tmp_path / "shared"), sys.executable)
    slurm_cluster.cancel_all()


@pytest.fixture
def token() -> str:
    """A token of this test's own: pytest's processes run these tests side by side, and one test's job must not be
    counted as another's leftover (a `sleep 3` batch job's two processes were once taken for a cancelled job's)."""
    return f"tok-slurm-{uuid.uuid4().hex}"


def _cmdlines() -> list[bytes]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append(f.read())
        except OSError:
            pass
    return found


def test_a_lost_submit_is_found_again_and_cancel_verifies_the_job_is_gone(
        agent: HostAgent, slurm_cluster: SlurmCluster, token: str) -> None:
    d = agent.layout.attempt_dir("r1", 1)
    request = LaunchRequest(d, token, ["unused"], {"MY_SETTING": "x y"}, slurm=SlurmBatch(SLEEPER, "longrun-r1-1"))
    first = agent.launch(request)
    job = str(first.pid)
    assert first.already is False and first.containment == "slurm" and first.queue.job_id == job
    os.remove(os.path.join(d, "slurm_job"))  # sbatch answered, but the host never recorded it
    again = agent.launch(request)
    assert again.pid == first.pid and again.already is True
    assert list(slurm_cluster.active_jobs()) == [job], "one job, not two"

    deadline = time.monotonic() + 30
    while not pids_with_token(token):
        assert time.monotonic() < deadline, f"the job's processes never carried the token: {slurm_cluster.jobs()}"
        time.sleep(0.1)
    assert all(token.encode() not in line for line in _cmdlines()), "the token shows in no command line"
    assert token not in Path(d, "batch.sh").read_text()
    running = agent.probe(d, ReadFrom())
    assert running.state == "running" and running.queue.state == "RUNNING"
    assert "started on" in running.log

    stopped = agent.cancel(d, grace=5, read_from=ReadFrom())
    assert stopped.remaining == [] and stopped.signalled == [first.pid]
    assert pids_with_token(token) == [] and slurm_cluster.jobs()[job] == "CANCELLED"
    assert stopped.probe.state == "exited" and stopped.probe.queue.state == "CANCELLED"
    twice = agent.cancel(d, grace=5)
    assert twice.remaining == [] and twice.signalled == []


def test_a_held_job_answers_pending_with_slurms_reason_until_cancelled(
        agent: HostAgent, slurm_cluster: SlurmCluster, token: str) -> None:
    d = agent.layout.attempt_dir("r2", 1)
    held = agent.launch(LaunchRequest(d, token, [], {}, slurm=SlurmBatch("#!/bin/bash\n#SBATCH --hold\nsleep 300\n",
                                                                         "longrun-r2-1")))
    assert held.state == "pending" and held.queue.reason == "JobHeldUser"
    probe = agent.probe(d, ReadFrom())
    assert probe.state == "pending" and probe.queue.state == "PENDING" and probe.queue.reason == "JobHeldUser"
    assert agent.cancel(d, grace=5).remaining == []
    assert slurm_cluster.jobs()[str(held.pid)] == "CANCELLED"
    assert agent.probe(d, ReadFrom()).state == "exited"


def test_a_batch_jobs_start_and_end_are_slurms_so_its_duration_is_its_own(
        agent: HostAgent, slurm_cluster: SlurmCluster, token: str) -> None:
    d = agent.layout.attempt_dir("r3", 1)
    agent.launch(LaunchRequest(d, token, [], {}, slurm=SlurmBatch("#!/bin/bash\nsleep 3\n", "longrun-r3-1")))
    deadline = time.monotonic() + 60
    while (probe := agent.probe(d, ReadFrom())).state != "exited":
        assert time.monotonic() < deadline, slurm_cluster.jobs()
        assert probe.state != "running" or probe.times.started is not None, "a running job has its start"
        time.sleep(0.5)
    times = probe.times
    assert times.started is not None and times.ended is not None and 2 <= times.ended - times.started <= 5, times
    assert times.ended <= times.now + 1
