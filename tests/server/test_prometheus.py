"""`/metrics` on a real server: valid Prometheus exposition (parsed by prometheus-client) behind the token,
read from the database at scrape time, that follows a run as it progresses and ends."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service import STUB_ENV, Service, attempt_processes, serve_with_fake_gpus, toy_spec

pytestmark = pytest.mark.slow  # a real server running torchrun

TOKEN = "prom-s3cret"
# A stand-in job, stdlib only as examples/toy_train.py is: rank 0 writes a metric line a step, about 10 steps a second,
# until the file its second argument names exists; then each rank runs its remaining steps at once and exits 0. The test
# lets the run end once it has seen what it asserts of a running run, however long that took on this machine (a job of
# a fixed length has to outlast a loaded machine's slowest reads, and is then waited for to its end: 30 s at 300 steps).
STEPPER = """
import json, os, sys, time
from pathlib import Path

steps, finish = int(sys.argv[1]), Path(sys.argv[2])
out = open(os.environ["LONGRUN_METRICS_FILE"], "a") if int(os.environ.get("RANK", "0")) == 0 else None
for n in range(1, steps + 1):
    if not finish.exists():
        time.sleep(0.1)
    if out:
        out.write(json.dumps({"step": n, "total_steps": steps, "time": time.time(), "loss": 1.0 / n}) + "\\n")
        out.flush()
"""


@pytest.fixture
def gpu_service(tmp_path: Path) -> Iterator[tuple[Service, Path]]:
    """A server whose `nvidia-smi` is tests/fakegpu (two H200s), with a token."""
    yield from serve_with_fake_gpus(tmp_path, token=TOKEN, gpu_sample_interval=0.3)


def scrape(svc: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as (name, sorted labels) -> value, through prometheus-client's own parser."""
    r = svc.client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def run_sample(samples: dict, name: str, run_id: str) -> float | None:
    return next((v for (n, labels), v in samples.items() if n == name and ("run_id", run_id) in labels), None)


def test_metrics_follow_a_run_from_running_to_succeeded(gpu_service: tuple[Service, Path], tmp_path: Path) -> None:
    svc, gpus = gpu_service
    assert httpx.get(f"{svc.url}/metrics").status_code == 401
    before = scrape(svc)
    assert before[("longrun_runs", (("state", "running"),))] == 0
    assert before[("longrun_metric_points_ingested_total", ())] == 0

    job, finish = tmp_path / "stepper.py", tmp_path / "finish"
    job.write_text(STEPPER)
    run = svc.submit({"name": "toy", "host": "local", "nproc_per_node": 2, "entrypoint": str(job),
                      "args": ["300", str(finish)], "env": STUB_ENV})
    running = svc.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 10,
                       what="ten steps")
    # the fake nvidia-smi reports the run's first process as holding GPU 0 at 37%
    gpus.write_text(json.dumps({"holders": {"0": attempt_processes(running, 1)[0]}, "util": 37}))
    svc.wait(run["id"], lambda r: r["latest"].get("gpu_util_0") == 37, what="a GPU sample")
    early = scrape(svc)
    step_then = svc.run(run["id"])["latest"]["step"]
    assert early[("longrun_runs", (("state", "running"),))] == 1
    assert early[("longrun_attempts_started_total", ())] == 1
    assert early[("longrun_host_reachable", (("host", "local"),))] == 1
    assert run_sample(early, "longrun_run_steps_per_second", run["id"]) > 1
    assert 0 < run_sample(early, "longrun_run_progress_ratio", run["id"]) < 1
    assert run_sample(early, "longrun_run_eta_seconds", run["id"]) > 0
    gpu = [v for (n, labels), v in early.items() if n == "longrun_run_gpu_utilization_percent"
           and dict(labels) == {"run_id": run["id"], "run_name": "toy", "node": "0", "gpu": "0"}]
    assert gpu == [37]

    svc.wait(run["id"], lambda r: r["latest"]["step"] >= step_then + 20, what="twenty more steps")
    later = scrape(svc)
    assert run_sample(later, "longrun_run_progress_ratio", run["id"]) > run_sample(early, "longrun_run_progress_ratio", run["id"])
    assert later[("longrun_metric_points_ingested_total", ())] > early[("longrun_metric_points_ingested_total", ())]

    finish.touch()  # the job's remaining steps at once, and its end
    assert svc.wait_status(run["id"], "succeeded", "failed")["status"] == "succeeded"
    done = scrape(svc)
    assert done[("longrun_runs", (("state", "running"),))] == 0
    assert done[("longrun_runs", (("state", "succeeded"),))] == 1
    assert run_sample(done, "longrun_run_progress_ratio", run["id"]) is None, "only running runs are listed"
    assert done[("longrun_retries_total", ())] == 0


def test_retries_are_counted(service: Service) -> None:
    run = service.submit(toy_spec(steps=50, sleep=0.01, nproc=1, args=["--fail-at", "3"], max_retries=2))
    assert service.wait_status(run["id"], "succeeded", "failed")["status"] == "failed"
    text = service.client.get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert samples["longrun_retries_total"] == 2
    assert samples["longrun_attempts_started_total"] == 3
