"""The host-side rows of the fault matrix (docs/reliability.md): a real `longrun serve`, real torchrun on the
`local` host, and a fault done to the host or the job. Each row checks its invariants: the run ends in the
right state, the message says what happened, no process of the attempt is left, no metric lost or doubled."""

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service import STUB_ENV, Service, alive, attempt_processes, kill_leftovers, toy_spec
from worker.hostside import containment

pytestmark = pytest.mark.slow  # each row starts a real `longrun serve` and torchrun
HERE = Path(__file__).resolve().parent


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def checkpointing_spec(tmp_path: Path, steps: int, **extra: Any) -> dict[str, Any]:
    return {"name": "ckpt", "host": "local", "nproc_per_node": 1, "entrypoint": str(HERE / "job_checkpointing.py"),
            "args": ["--steps", str(steps), "--sleep", "0.1", "--checkpoint", str(tmp_path / "ckpt.json")],
            "env": STUB_ENV, **extra}


def steps_of(service: Service, run_id: str, attempt: int) -> list[int]:
    return [p["step"] for p in service.series(run_id, "loss", attempt=attempt)]


def test_wrapper_killed_stops_the_job_before_the_attempt_fails(service: Service) -> None:
    run = service.submit(toy_spec(steps=2000, sleep=0.05, real_torchrun=True))
    running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                           what="running")
    wrapper = running["attempts"][0]["nodes"][0]["pid"]
    job = [p for p in attempt_processes(running, 1) if p != wrapper]
    assert len(job) >= 3, "torchrun's agent and its two workers run beside the wrapper"
    os.kill(wrapper, signal.SIGKILL)
    done = service.wait_status(run["id"], "failed", "succeeded", "cancelled")
    assert [p for p in job if alive(p)] == [], "torchrun and its workers were stopped with the wrapper gone"
    assert done["status"] == "failed"
    assert "lost its wrapper on local: it died without recording the job's exit code" in done["message"]
    steps = steps_of(service, run["id"], 1)
    assert steps == list(range(1, len(steps) + 1)), "every metric line written before the stop, once"


def test_trainer_sigkill_is_retried_and_resumes_from_its_checkpoint(service: Service, tmp_path: Path) -> None:
    run = service.submit(checkpointing_spec(tmp_path, steps=40, max_retries=1))
    running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 8,
                           what="eight steps")
    [trainer] = [p for p in attempt_processes(running, 1) if "job_checkpointing.py" in cmdline(p)
                 and "torch.distributed.run" not in cmdline(p)]
    os.kill(trainer, signal.SIGKILL)
    done = service.wait_status(run["id"], "succeeded", "failed", "cancelled", timeout=180)
    assert done["status"] == "succeeded", done["message"]
    first, second = done["attempts"]
    assert first["status"] == "failed" and first["exit_code"] not in (0, None)
    assert attempt_processes(done, 1) == [] and attempt_processes(done, 2) == []
    before, after = steps_of(service, run["id"], 1), steps_of(service, run["id"], 2)
    assert before == list(range(1, len(before) + 1)) and len(before) >= 8
    assert after == list(range(after[0], 41)) and after[0] in (len(before), len(before) + 1), \
        "attempt 2 resumed after the checkpoint of the last step attempt 1 recorded"
    assert any("resuming after step" in line for line in service.logs(run["id"], attempt=2))


def test_host_reboot_every_process_killed_at_once_retries_from_the_checkpoint(service: Service,
                                                                              tmp_path: Path) -> None:
    run = service.submit(checkpointing_spec(tmp_path, steps=30, max_retries=1))
    running = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                           what="five steps")
    pids = attempt_processes(running, 1)
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # frozen first, so that none sees another die
        for pid in pids:
            os.kill(pid, sig)
    done = service.wait_status(run["id"], "succeeded", "failed", "cancelled", timeout=180)
    assert done["status"] == "succeeded", done["message"]
    first = done["attempts"][0]
    assert first["status"] == "failed" and first["exit_code"] is None
    assert "lost its wrapper on local" in first["message"] and "the host restarted" in first["message"]
    assert attempt_processes(done, 1) == []
    after = steps_of(service, run["id"], 2)
    assert after[-1] == 30 and after == list(range(after[0], 31)) and after[0] > 1


def test_a_helper_forked_outside_the_jobs_environment_and_session_does_not_survive_cancel(
        service: Service, tmp_path: Path) -> None:
    if "cgroup" not in containment.layers() and "systemd-scope" not in containment.layers():
        pytest.skip("only a cgroup holds a helper started with `env -i setsid`; this host offers none")
    helper_file = tmp_path / "helper.pid"
    run = service.submit({"name": "forks", "host": "local", "nproc_per_node": 1,
                          "entrypoint": str(HERE / "job_forks_helper.py"), "args": [str(helper_file)],
                          "env": STUB_ENV})
    service.wait(run["id"], lambda r: r["status"] == "running" and "loss" in r["latest"], what="running")
    helper = int(helper_file.read_text())
    assert alive(helper) and b"LONGRUN_ATTEMPT_TOKEN" not in Path(f"/proc/{helper}/environ").read_bytes()
    assert service.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    done = service.wait_status(run["id"], "cancelled", "failed")
    assert done["status"] == "cancelled" and done["message"] == "cancelled; no process of the run remains"
    assert not alive(helper), "the helper left with the rest of the attempt"
    assert attempt_processes(done, 1) == []


@pytest.fixture
def small_disk_service(tmp_path: Path) -> Iterator[Service]:
    """A service whose local workspace is a 2 MiB tmpfs."""
    svc = Service(tmp_path / "home")
    svc.workspace.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(svc.workspace)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        svc.start()
        yield svc
    finally:
        svc.stop()
        kill_leftovers(svc.workspace)
        subprocess.run(["umount", "-l", str(svc.workspace)], check=False)


def test_disk_full_on_the_host_fails_the_run_saying_so(small_disk_service: Service) -> None:
    service = small_disk_service
    run = service.submit({"name": "fills", "host": "local", "nproc_per_node": 1,
                          "entrypoint": str(HERE / "job_fills_disk.py"), "args": [],
                          "env": STUB_ENV})
    done = service.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=120)
    assert done["status"] == "failed"
    assert "exited with code" in done["message"] and "is full" in done["message"], done["message"]
    assert done["attempts"][0]["exit_code"] not in (0, None), "the exit code found room in its reserve"
    assert attempt_processes(done, 1) == []
    steps = steps_of(service, run["id"], 1)
    assert steps[:5] == [1, 2, 3, 4, 5] and steps == list(range(1, len(steps) + 1))
    # what the disk took, and the workspace answers again once it has room
    (service.workspace / ".longrun" / run["id"] / "1" / "ballast").unlink()
    again = service.submit(toy_spec(steps=5, sleep=0.01, nproc=1))
    assert service.wait_status(again["id"], "succeeded", "failed")["status"] == "succeeded"



def test_a_full_workspace_fails_the_launch_in_one_short_sentence(small_disk_service: Service) -> None:
    service = small_disk_service
    filler = service.workspace / "filler"
    with open(filler, "wb") as f:  # the workspace full before the run starts
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    try:
        run = service.submit(toy_spec(steps=5))
        done = service.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=120)
    finally:
        filler.unlink()
    assert done["status"] == "failed"
    message = done["message"]
    assert "Traceback" not in message and len(message) < 600, message
    assert "is full" in message and str(service.workspace) in message, message
    assert "Traceback" in (service.home / "server.log").read_text(), "the whole of it is in the server's log"
