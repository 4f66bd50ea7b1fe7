"""The service side of the fault matrix (docs/reliability.md, "Service-side faults"): real servers, workers and
torchrun jobs; each row checks its invariant: no metric lost or doubled, no run wedged, the message says what
happened."""

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.service import STUB_ENV, Service, kill_leftovers, start_worker, stop_processes, toy_spec

pytestmark = pytest.mark.slow  # real servers, workers and torchrun

JOB = '''
import json, os, sys, time
mode, skew, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
out = open(os.environ["LONGRUN_METRICS_FILE"], "a")
poison = [
    '{"step": 1, "time": 1767268800000, "bad": 5}',
    '{"step": 18446744073709551616, "bad": 5}',
    '{"step": 2, "loss": NaN, "acc": 1e999, "gpu_util_0": 99, "attempt": 9}',
    '{"step": 3, "pad": "' + "x" * 70000 + '"}',
    '{"nested": {"a": [1, {"b": null}]}, "total_steps": -4}',
    "not json at all",
]
for step in range(1, steps + 1):
    time.sleep(0.1)
    if mode == "poison" and step % 10 == 1:
        out.write("\\n".join(poison) + "\\n")
    out.write(json.dumps({"step": step, "total_steps": steps, "time": time.time() + skew, "loss": 1.0 / step}) + "\\n")
    out.flush()
print("done", flush=True)
'''


def _job(tmp_path: Path, mode: str, skew: float = 0.0, steps: int = 60) -> dict[str, Any]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return {"name": mode, "host": "local", "nproc_per_node": 1, "entrypoint": str(script),
            "args": [mode, str(skew), str(steps)], "env": STUB_ENV}


@contextmanager
def _service(tmp_path: Path, worker: bool = True, database_url: str | None = None,
             **settings: Any) -> Iterator[Service]:
    """A started server (with its worker unless told) that stops, leaving no job behind, whatever the test did."""
    svc = Service(tmp_path / "home", database_url=database_url, **settings)
    svc.home.mkdir()
    try:
        yield svc.start(worker=worker)
    finally:
        svc.stop()
        kill_leftovers(svc.workspace)


@pytest.mark.both_stores
def test_server_kill_9_mid_run_loses_and_doubles_no_metric(tmp_path: Path, database_url: str) -> None:
    with _service(tmp_path, database_url=database_url) as svc:
        run = svc.submit(toy_spec(steps=60, sleep=0.1, nproc=1))
        svc.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 10, what="ten steps")
        svc.kill()
        time.sleep(2)  # the job keeps writing while nobody reads
        svc.start()
        done = svc.wait_status(run["id"], "succeeded", "failed")
        assert done["status"] == "succeeded" and done["attempt"] == 1, "the same attempt ran on; nothing relaunched"
        assert [p["step"] for p in svc.series(run["id"], "loss")] == list(range(1, 61))
        statuses = [e["to"] for e in svc.events(run["id"]) if "to" in e]
        assert statuses == ["queued", "launching", "running", "succeeded"]


def test_worker_kill_9_another_worker_takes_the_run_over_by_its_lease(tmp_path: Path, database_url: str) -> None:
    """On SQLite; on PostgreSQL, with two servers besides, in tests/faults/test_many_servers.py."""
    workers: list[subprocess.Popen] = []
    with _service(tmp_path, worker=False, database_url=database_url) as svc:
        try:
            workers.append(start_worker(svc, "worker0"))
            run = svc.submit(toy_spec(steps=80, sleep=0.1, nproc=1))
            svc.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 10, what="ten steps")
            workers[0].send_signal(signal.SIGKILL)
            workers[0].wait()
            workers.append(start_worker(svc, "worker1"))
            done = svc.wait_status(run["id"], "succeeded", "failed")
            assert done["status"] == "succeeded" and done["attempt"] == 1
            assert [p["step"] for p in svc.series(run["id"], "loss")] == list(range(1, 81))
        finally:
            stop_processes(workers)


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_a_job_clock_an_hour_off_leaves_eta_and_stall_detection_right(tmp_path: Path, skew: float) -> None:
    with _service(tmp_path, stall_floor=5, stall_factor=5) as svc:
        run = svc.submit(_job(tmp_path, "skew", skew, steps=100))
        mid = svc.wait(run["id"], lambda r: 20 <= (r["latest"].get("step") or 0) <= 60, what="steps 20 to 60")
        assert mid["eta_seconds"] is not None and 1.0 < mid["eta_seconds"] < 60, mid
        done = svc.wait_status(run["id"], "succeeded", "failed")
        assert done["status"] == "succeeded", done
        assert [p["step"] for p in svc.series(run["id"], "loss")] == list(range(1, 101))
        assert not [e for e in svc.events(run["id"]) if "stalled" in json.dumps(e)]
        started = done["attempts"][0]["started_at"]
        assert done["attempts"][0]["first_step_at"] >= started, "startup is measured on the server's clock"


def test_a_job_writing_poisoned_metric_lines_runs_to_the_end_with_its_good_lines(tmp_path: Path) -> None:
    with _service(tmp_path) as svc:
        run = svc.submit(_job(tmp_path, "poison", steps=30))
        done = svc.wait_status(run["id"], "succeeded", "failed", timeout=120)
        assert done["status"] == "succeeded", done
        assert [p["step"] for p in svc.series(run["id"], "loss")] == list(range(1, 31))
        assert done["latest"]["step"] == 30 and done["latest"]["total_steps"] == 30
        # a non-finite value is shown as such, never charted; a value on a step that is no step is skipped
        assert done["latest"]["acc"] == "Infinity", done["latest"]
        assert "attempt" not in done["latest"] and "gpu_util_0" not in done["latest"]
        assert [p["step"] for p in svc.series(run["id"], "acc")] == []
        assert [p["step"] for p in svc.series(run["id"], "bad")] == [1] * 3, "a value kept, a bad step's not"
        # five a round, three rounds: the step past 2^63, the line too long, the negative total, the line not JSON,
        # and one of the non-finite values (each said, none charted)
        assert done["attempts"][0]["metrics_skipped"] == 15
        assert done["attempts"][0]["message"].startswith("15 metric line(s) or value(s) skipped")
        assert svc.logs(run["id"])[-1] == "done"
