"""GPU awareness through the service. This machine has no GPU: nvidia-smi is the captured H200 output
(tests/fakegpu), and the processes it reports as GPU holders are real processes these tests start."""

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import Service, serve_with_fake_gpus, toy_spec, use_fake_gpus

pytestmark = pytest.mark.slow  # a real server


@pytest.fixture
def gpu_service(tmp_path: Path) -> Iterator[tuple[Service, Path]]:
    yield from serve_with_fake_gpus(tmp_path, gpu_sample_interval=0.5, gpu_wait_deadline=60)


@pytest.fixture
def stranger() -> Iterator[int]:
    """Someone else's process, to be reported as holding GPUs."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_host_gpus_show_utilisation_memory_and_holders(gpu_service: tuple[Service, Path], stranger: int) -> None:
    svc, state = gpu_service
    state.write_text(json.dumps({"holders": {"1": stranger}, "util": 100}))
    snap = svc.client.get("/v1/hosts/local/gpus", params={"max_age": 0}).json()
    assert snap["available"] is True and [g["name"] for g in snap["gpus"]] == ["NVIDIA H200"] * 2
    idle, busy = snap["gpus"]
    assert idle["utilization_pct"] == 0 and idle["processes"] == []
    assert busy["utilization_pct"] == 100 and busy["memory_used_mib"] == 20085
    assert busy["memory_total_mib"] == 143771
    assert busy["processes"][0]["pid"] == stranger and busy["processes"][0]["user"] == "root"


def test_run_waits_while_others_hold_its_gpus_then_starts(gpu_service: tuple[Service, Path], stranger: int) -> None:
    svc, state = gpu_service
    state.write_text(json.dumps({"holders": {"0": stranger, "1": stranger}, "util": 100}))
    run = svc.submit(toy_spec(steps=20, sleep=0.05, nproc=2))
    waiting = svc.wait(run["id"], lambda r: "waiting for GPUs" in (r["message"] or ""), what="waiting for GPUs")
    assert waiting["status"] == "launching"
    assert f"GPU 0 is held by pid {stranger} (python3, user root" in waiting["message"]
    state.write_text(json.dumps({"holders": {}, "util": 0}))
    done = svc.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert "gpu_util_0" in done["latest"] and "gpu_mem_1" in done["latest"]
    assert svc.series(run["id"], "gpu_util_0"), "GPU utilisation is stored as a metric of the run"


def test_a_one_gpu_run_is_given_a_free_gpu(gpu_service: tuple[Service, Path], stranger: int) -> None:
    svc, state = gpu_service
    state.write_text(json.dumps({"holders": {"0": stranger}, "util": 100}))
    run = svc.submit(toy_spec(steps=5, sleep=0.01, nproc=1))
    done = svc.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert done["attempts"][0]["nodes"][0]["gpus"] == [1]
    assert any("CUDA_VISIBLE_DEVICES=1" in line for line in svc.logs(run["id"], tail=50))


def test_a_run_fails_after_the_gpu_wait_deadline(tmp_path: Path, stranger: int) -> None:
    state = tmp_path / "gpus.json"
    state.write_text(json.dumps({"holders": {"0": stranger, "1": stranger}, "util": 100}))
    svc = Service(tmp_path / "home", gpu_wait_deadline=2)
    use_fake_gpus(svc, state)
    svc.home.mkdir()
    svc.start()
    try:
        run = svc.submit(toy_spec(steps=5, nproc=2))
        failed = svc.wait_status(run["id"], "failed", "succeeded", timeout=60)
        assert failed["status"] == "failed" and "waiting for GPUs" in failed["message"]
        assert failed["attempts"][0]["started_at"] is None, "nothing was launched"
    finally:
        svc.stop()


def test_a_host_without_gpus_says_so(service: Service) -> None:
    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in os.environ["PATH"].split(":")):
        pytest.fail("this test expects a machine without nvidia-smi")
    snap = service.client.get("/v1/hosts/local/gpus", params={"max_age": 0}).json()
    assert snap["available"] is False and "no usable GPU" in snap["message"]
