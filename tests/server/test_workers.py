"""`longrun serve --no-worker` with separate `longrun worker` processes sharing one database."""

import subprocess
import time
from pathlib import Path

import pytest

from tests.service import Service, kill_leftovers, start_worker, stop_processes, toy_spec

pytestmark = pytest.mark.slow  # a real server and two worker processes


def test_two_workers_share_runs_through_leases_and_store_each_metric_once(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home")
    svc.home.mkdir()
    workers: list[subprocess.Popen] = []
    try:
        svc.start(worker=False)
        ids = [svc.submit(toy_spec(steps=30, sleep=0.02, nproc=1, name=f"r{i}"))["id"] for i in range(3)]
        time.sleep(2)
        assert all(svc.run(i)["status"] == "queued" for i in ids), "without a worker nothing moves"
        workers += [start_worker(svc, f"worker{n}") for n in range(2)]
        for run_id in ids:
            done = svc.wait_status(run_id, "succeeded", "failed", timeout=120)
            assert done["status"] == "succeeded", done
            assert [p["step"] for p in svc.series(run_id, "loss")] == list(range(1, 31))
        logs = "".join((svc.home / f"worker{n}.log").read_text() for n in range(2))
        assert logs.count("started") >= 2
    finally:
        stop_processes(workers)
        svc.stop()
        kill_leftovers(svc.workspace)
