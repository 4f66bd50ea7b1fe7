"""The bundled trainer as a Slurm batch job (tests/slurm.py's real cluster), driven through the REST API as on
any host: pending behind a job that holds the node, running at TTT=3 with live per-step metrics, restarted
clean at TTT=5 with attempt 1's job and processes gone first, its logs streamed, cancelled leaving nothing."""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import Service, attempt_processes, attempts_overlap
from tests.slurm import SlurmCluster, job_of, serving
from tests.trainer.test_service_trainer import _trainer_spec
from trainer.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow  # a real Slurm cluster, a real server and the trainer under torchrun under srun


@pytest.fixture
def service(tmp_path: Path, slurm_cluster: SlurmCluster) -> Iterator[Service]:
    """A server whose host `cluster` is the Slurm login node on this machine, its workspace tmp_path/shared."""
    with serving(slurm_cluster, tmp_path) as svc:
        yield svc


def test_trainer_on_slurm_pending_running_restarted_at_ttt5_cancelled_leaving_nothing(
        service: Service, slurm_cluster: SlurmCluster, tmp_path: Path, tiny_verifier: Path,
        prepared_data: Path, tiny_corpus: Path) -> None:
    cluster = slurm_cluster
    out = tmp_path / "shared" / "out"
    spec = {**_trainer_spec(tiny_verifier, prepared_data, out, tiny_corpus), "host": "cluster"}
    # long enough to be restarted and cancelled mid-run; no evaluation at the end
    spec["trainer"]["epochs"] = 500
    del spec["trainer"]["eval_corpus"]

    # a job that wants the whole node holds it: the run's job queues behind it
    blocker = cluster.command("sbatch", "--parsable", "--exclusive", "--time=3", "--wrap", "sleep 600").strip()
    cluster.wait_state(blocker, "RUNNING")
    run = service.submit(spec)
    # Slurm gives a new job its reason at its first scheduling pass; until then the message says PENDING
    pending = service.wait(run["id"], lambda r: any(why in (r["message"] or "") for why in ("Resources", "Priority")),
                           timeout=30, what="the trainer's job pending in Slurm with its reason")
    assert cluster.jobs()[job_of(pending, 1)] == "PENDING"
    assert pending["status"] == "launching" and pending["attempts"][0]["status"] == "pending"
    assert pending["message"].startswith(f"pending in Slurm as job {job_of(pending, 1)}: "), pending["message"]
    cluster.command("scancel", blocker)

    # past its first epoch's end, so that attempt 1 leaves a checkpoint that only the clean restart removes
    running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("epoch") or 0) > 1,
                           timeout=90, what="attempt 1 training past its first epoch")
    assert {"loss_0", "loss_1", "loss_2", "acc_0", "acc_1", "acc_2", "cond_acc_2"} <= set(running["latest"])
    assert "acc_3" not in running["latest"], "a TTT=3 draft reports exactly three positions"
    assert cluster.jobs()[job_of(running, 1)] == "RUNNING" and attempt_processes(running, 1)
    assert latest_checkpoint(out) is not None

    with attempts_overlap(service, run["id"]) as overlap:
        r = service.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"ttt_steps": 5}, "clean": True})
        assert r.status_code == 202, r.text
        second = service.wait(run["id"], lambda r: r["attempt"] == 2 and r["status"] == "running"
                              and "acc_4" in r["latest"], timeout=90, what="attempt 2 reporting acc_4")
    assert overlap == [], "attempt 2 ran while attempt 1 still had processes"
    first = second["attempts"][0]
    assert first["status"] == "cancelled" and first["ended_at"] <= second["attempts"][1]["started_at"]
    assert cluster.jobs()[job_of(second, 1)] == "CANCELLED", "Slurm records attempt 1's job cancelled, not failed"
    assert first["exit_code"] != 137, "attempt 1 had to be SIGKILLed"
    assert any("stopping at step" in line for line in service.logs(run["id"], attempt=1, tail=50))
    assert second["attempts"][1]["spec"]["trainer"]["ttt_steps"] == 5
    assert cluster.jobs()[job_of(second, 2)] == "RUNNING"
    # the trainer prints a progress line just after writing that step's metrics: a probe may see them apart
    service.wait(run["id"], lambda _: any("[train] step" in line for line in service.logs(run["id"], attempt=2)),
                 timeout=30, what="attempt 2's first progress line in its logs")
    log = service.logs(run["id"], attempt=2, tail=100)
    assert any("TTT steps 5" in line and "2 rank(s)" in line for line in log), log[-20:]
    assert not any("resuming from" in line for line in log), "the clean restart left attempt 1's checkpoints"
    progress = next(m for line in log if (m := re.search(r"\[train\] step (\d+)/\d+ .* acc (\S+)", line)))
    assert progress[1] == "1" and len(progress[2].split("/")) == 5, "attempt 2 starts afresh with five positions"

    assert service.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    done = service.wait_status(run["id"], "cancelled", "failed", timeout=60)
    assert done["status"] == "cancelled" and done["attempts"][1]["status"] == "cancelled", done
    assert cluster.jobs()[job_of(done, 2)] == "CANCELLED" and done["attempts"][1]["exit_code"] != 137
    assert attempt_processes(done, 1) == [] and attempt_processes(done, 2) == []
    assert cluster.active_jobs() == {}, "no Slurm job of the run is left"
    for number, positions in ((1, 3), (2, 5)):
        steps = [p["step"] for p in service.series(run["id"], "loss", attempt=number)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2, "each metric step stored once"
        assert service.series(run["id"], f"acc_{positions - 1}", attempt=number)
        assert not service.series(run["id"], f"acc_{positions}", attempt=number)
