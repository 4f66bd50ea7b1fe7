"""Runs on a host of kind `slurm` against a real Slurm cluster (tests/slurm.py) through the REST API: each attempt
a batch job; pending with Slurm's reason and an ETA from its expected start, running, restarted, cancelled, and
requeued from its checkpoint when its time limit ends it."""

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service import (
    ROOT,
    STUB_ENV,
    Service,
    attempt_processes,
    attempts_overlap,
    kill_leftovers,
    toy_spec,
)
from tests.slurm import SlurmCluster, job_of, serving
from tests.sshd import SshServer

pytestmark = pytest.mark.slow  # a real Slurm cluster, a real server and torchrun under srun

CHECKPOINTING = str(ROOT / "tests" / "faults" / "job_checkpointing.py")


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    slurm_cluster.cancel_all()


@pytest.fixture
def service(tmp_path: Path, cluster: SlurmCluster) -> Iterator[Service]:
    """A server whose host `cluster` is the Slurm login node on this machine (address `local`)."""
    with serving(cluster, tmp_path) as svc:
        assert svc.client.get("/v1/hosts/cluster").json()["kind"] == "slurm"
        yield svc


def on_cluster(spec: dict[str, Any], **slurm: Any) -> dict[str, Any]:
    return {**spec, "host": "cluster", "slurm": slurm}


def test_slurm_run_goes_pending_running_restarted_cancelled_leaving_nothing(
        service: Service, cluster: SlurmCluster) -> None:
    refused = service.submit(on_cluster(toy_spec(steps=20, nproc=1), partition="nosuch"))
    failed = service.wait_status(refused["id"], "failed", "running", timeout=30)
    assert failed["status"] == "failed" and "sbatch refused the job" in failed["message"], failed["message"]
    assert "invalid partition" in failed["message"].lower()
    held = service.submit(on_cluster(toy_spec(steps=20, nproc=1), sbatch_options=["--hold"]))
    run = service.submit(on_cluster(toy_spec(steps=2000, sleep=0.05, nproc=1), time_limit="10"))
    on_hold = service.wait(held["id"], lambda r: "JobHeldUser" in (r["message"] or ""), timeout=30,
                           what="held by its user")
    assert on_hold["status"] == "launching" and on_hold["attempts"][0]["status"] == "pending"
    assert f"pending in Slurm as job {job_of(on_hold, 1)}" in on_hold["message"]
    running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                           timeout=60, what="attempt 1 running with metrics")
    assert running["attempts"][0]["status"] == "running"
    assert attempt_processes(running, 1), "attempt 1's processes carry its directory in their environment"
    assert cluster.jobs()[job_of(running, 1)] == "RUNNING"

    # a job that wants the whole node queues behind attempt 1, starts once it is gone, and holds the node for
    # its 3-minute limit: attempt 2 waits behind it
    blocker = cluster.command("sbatch", "--parsable", "--exclusive", "--time=3", "--wrap", "sleep 600").strip()
    second_args = ["--steps", "2000", "--sleep", "0.05", "--label", "second"]
    with attempts_overlap(service, run["id"]) as overlap:
        r = service.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": second_args}})
        assert r.status_code == 202, r.text
        pending = service.wait(run["id"], lambda r: r["attempt"] == 2 and "expected to start" in (r["message"] or ""),
                               timeout=30, what="attempt 2 pending with an expected start")
        assert cluster.jobs()[blocker] == "RUNNING" and cluster.jobs()[job_of(pending, 2)] == "PENDING"
        assert pending["status"] == "launching" and pending["attempts"][1]["status"] == "pending"
        assert "Resources" in pending["message"] or "Priority" in pending["message"], pending["message"]
        # the ETA counts from the expected start (the blocker's end, at most 3 minutes away) and adds the
        # duration predicted from attempt 1's measured steps
        wait = pending["eta_seconds"] - pending["attempts"][1]["predicted_duration_seconds"]
        assert 120 < wait <= 185, (pending["eta_seconds"], pending["attempts"][1]["predicted_duration_seconds"])
        cluster.command("scancel", blocker)
        second = service.wait(run["id"], lambda r: r["attempt"] == 2 and r["status"] == "running"
                              and (r["latest"].get("step") or 0) >= 5, timeout=60, what="attempt 2 running")
    assert overlap == [], "attempt 2 ran while attempt 1 still had processes"
    first = second["attempts"][0]
    assert first["status"] == "cancelled" and first["ended_at"] <= second["attempts"][1]["started_at"]
    assert cluster.jobs()[job_of(second, 1)] == "CANCELLED", "Slurm records the job cancelled, not failed"
    assert any('"--label", "second"' in line for line in service.logs(run["id"], attempt=2, tail=50))

    for r in (run, held):
        assert service.client.post(f"/v1/runs/{r['id']}/cancel").status_code == 202
    for r in (run, held):
        done = service.wait_status(r["id"], "cancelled", "failed", timeout=60)
        assert done["status"] == "cancelled" and done["attempts"][-1]["status"] == "cancelled", done
        assert cluster.jobs()[job_of(done, done["attempt"])] == "CANCELLED"
    done = service.run(run["id"])
    assert attempt_processes(done, 1) == [] and attempt_processes(done, 2) == []
    assert cluster.active_jobs() == {}, "no Slurm job of the runs is left"
    for number in (1, 2):
        steps = [p["step"] for p in service.series(run["id"], "loss", attempt=number)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, "each metric line stored once"


def test_attempt_ended_by_its_slurm_time_limit_is_requeued_from_its_checkpoint(
        service: Service, cluster: SlurmCluster, tmp_path: Path) -> None:
    checkpoint = tmp_path / "shared" / "ckpt.json"
    # Slurm counts time limits in minutes: the first attempt outlasts one, the resumed one finishes quickly
    spec = {"name": "timed", "host": "cluster", "nproc_per_node": 1, "entrypoint": CHECKPOINTING, "max_retries": 1,
            "args": ["--steps", "2000", "--sleep", "0.05", "--resumed-sleep", "0.002", "--checkpoint", str(checkpoint)],
            "slurm": {"time_limit": "1"}, "env": STUB_ENV}
    run = service.submit(spec)
    done = service.wait_status(run["id"], "succeeded", "failed", timeout=150)
    assert done["status"] == "succeeded", done
    first, second = done["attempts"]
    assert cluster.jobs()[job_of(done, 1)] == "TIMEOUT"
    assert first["status"] == "failed" and "time limit" in first["message"], first["message"]
    assert first["ended_at"] <= second["started_at"]
    steps1 = [p["step"] for p in service.series(run["id"], "loss", attempt=1)]
    steps2 = [p["step"] for p in service.series(run["id"], "loss", attempt=2)]
    assert steps1 == list(range(1, len(steps1) + 1)) and len(steps1) > 100
    # the checkpoint follows the metric line: a job killed between the two repeats that one step
    assert steps2[0] in (steps1[-1], steps1[-1] + 1) and steps2 == list(range(steps2[0], 2001))
    assert any(f"resuming after step {steps2[0] - 1}" in line for line in service.logs(run["id"], attempt=2))
    assert cluster.active_jobs() == {}


def test_a_slurm_login_node_over_ssh_runs_streams_and_cancels_its_job(
        tmp_path: Path, cluster: SlurmCluster, service: Service) -> None:
    # the login node's environment names the cluster, as its profile would
    with SshServer(extra_config=f"SetEnv SLURM_CONF={cluster.env['SLURM_CONF']}") as sshd:
        workspace = tmp_path / "shared-over-ssh"
        r = service.client.post("/v1/hosts", json={"name": "login", "kind": "slurm", **sshd.host_fields,
                                                    "workspace": str(workspace), "python": sys.executable})
        assert r.status_code == 201, r.text
        run = service.submit({**toy_spec(steps=2000, sleep=0.05), "host": "login"})
        running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                               timeout=60, what="running with metrics")
        assert cluster.jobs()[job_of(running, 1)] == "RUNNING" and attempt_processes(running, 1)
        assert any("world size 2" in line for line in service.logs(run["id"], tail=50))
        assert service.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
        done = service.wait_status(run["id"], "cancelled", "failed", timeout=60)
        assert done["status"] == "cancelled", done
        assert cluster.jobs()[job_of(done, 1)] == "CANCELLED" and attempt_processes(done, 1) == []
        steps = [p["step"] for p in service.series(run["id"], "loss")]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
        kill_leftovers(workspace)
