"""Submit, watch, restart and cancel real torchrun jobs on the `local` host through the REST API."""

import json
import threading
import time
from pathlib import Path

import pytest

from tests import shared_service as shared
from tests.service import Service, attempt_processes, attempts_overlap, toy_spec

shared_servers, shared_service = shared.shared_servers, shared.shared_service  # fixtures

# each test starts torchrun jobs on a real `longrun serve`: the module's shared one (tests/shared_service.py) where the
# test only submits runs and reads its own back, else one of its own (`service`: it restarts it, or reads every run)
pytestmark = pytest.mark.slow


@pytest.mark.both_stores
def test_submitted_run_reports_metrics_progress_eta_and_logs(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=60, sleep=0.08))
    assert run["status"] == "queued" and run["attempt"] == 1
    running = shared_service.wait(run["id"], lambda r: r["status"] == "running" and (r["progress"] or 0) > 0.2,
                                  what="running with metrics")
    assert 0 < running["progress"] < 1
    assert running["eta_seconds"] is not None and 0 <= running["eta_seconds"] < 30
    assert "loss" in running["latest"]
    done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert done["progress"] == 1.0 and done["attempts"][0]["exit_code"] == 0
    steps = [p["step"] for p in shared_service.series(run["id"], "loss")]
    assert steps == list(range(1, 61))
    assert any("world size 2" in line for line in shared_service.logs(run["id"], tail=100))
    assert done["attempts"][0]["log_path"].endswith(f"/.longrun/{run['id']}/1/output.log")


def test_idempotency_key_returns_the_same_run(service: Service) -> None:
    spec = toy_spec(steps=5)
    first = service.submit(spec, headers={"Idempotency-Key": "abc-123"})
    again = service.submit(spec, expect=200, headers={"Idempotency-Key": "abc-123"})
    assert again["id"] == first["id"]
    other = service.client.post("/v1/runs", json=toy_spec(steps=6), headers={"Idempotency-Key": "abc-123"})
    assert other.status_code == 409
    assert len(service.client.get("/v1/runs").json()["items"]) == 1


def test_restart_stops_every_process_before_the_new_attempt_starts(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=400, sleep=0.05))
    shared_service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 5,
                        what="first metrics")
    before = shared_service.run(run["id"])
    assert attempt_processes(before, 1), "attempt 1 should have live processes"

    overrides = {"overrides": {"args": ["--steps", "30", "--sleep", "0.05", "--label", "second"]}}
    dry = shared_service.client.post(f"/v1/runs/{run['id']}/restart", params={"dry_run": "true"}, json=overrides)
    assert dry.status_code == 200, dry.text
    assert dry.json()["predicted_duration_seconds"] > 0 and dry.json()["basis"]
    assert shared_service.run(run["id"])["attempt"] == 1, "a dry run changes nothing"

    with attempts_overlap(shared_service, run["id"]) as overlap:
        r = shared_service.client.post(f"/v1/runs/{run['id']}/restart", json=overrides)
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "restarting" and r.json()["attempt"] == 2
        done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert overlap == [], "attempt 2 ran while attempt 1 still had processes"
    first, second = done["attempts"]
    assert first["status"] == "cancelled" and second["status"] == "succeeded"
    assert first["ended_at"] <= second["started_at"]
    assert first["log_path"] != second["log_path"]
    assert any('"--label", "second"' in line for line in shared_service.logs(run["id"], attempt=2, tail=50))
    assert not any('"second"' in line for line in shared_service.logs(run["id"], attempt=1, tail=50))
    steps2 = [p["step"] for p in shared_service.series(run["id"], "loss", attempt=2)]
    assert steps2 == list(range(1, 31)), "each metric line of attempt 2 stored exactly once"


@pytest.mark.both_stores
def test_cancel_leaves_no_process_torchrun_workers_included(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=1000, sleep=0.05, real_torchrun=True))
    running = shared_service.wait(run["id"], lambda r: r["status"] == "running" and "loss" in r["latest"],
                                  what="running")
    pids = attempt_processes(running, 1)
    assert len(pids) >= 4, f"wrapper, torchrun agent and two workers expected, got {pids}"
    r = shared_service.client.post(f"/v1/runs/{run['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelling"
    done = shared_service.wait_status(run["id"], "cancelled", "failed")
    assert done["status"] == "cancelled", done
    assert attempt_processes(done, 1) == []
    assert done["attempts"][0]["status"] == "cancelled"
    again = shared_service.client.post(f"/v1/runs/{run['id']}/cancel")
    assert again.status_code == 409 and again.json()["status"] == "cancelled"


def test_server_killed_mid_run_finds_the_run_again_and_loses_no_metric(service: Service) -> None:
    run = service.submit(toy_spec(steps=80, sleep=0.1))
    service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 10, what="ten steps")
    service.kill()
    time.sleep(3)  # the job keeps writing metrics while nobody reads them
    service.start()
    done = service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert [p["step"] for p in service.series(run["id"], "loss")] == list(range(1, 81))


def test_failed_attempt_is_retried_then_the_run_fails(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=50, sleep=0.01, nproc=1, args=["--fail-at", "5"], max_retries=1))
    done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "failed"
    assert [a["status"] for a in done["attempts"]] == ["failed", "failed"]
    assert done["attempts"][1]["exit_code"] not in (0, None)
    assert "exited with code" in done["message"]


def test_shell_metacharacters_reach_the_program_literally(shared_service: Service, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    nasty = ["; rm -rf ~", f"$(touch {marker})", f"`touch {marker}`", "a\nb", "' \" \\", f"&& touch {marker}"]
    run = shared_service.submit(toy_spec(steps=3, sleep=0.01, nproc=1, args=["--label", *nasty],
                                         env={"LABEL": f"$(touch {marker})"}))
    done = shared_service.wait_status(run["id"], "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert not marker.exists()
    argv_lines = [line for line in shared_service.logs(run["id"], tail=200) if line.startswith("ARGV ")]
    assert json.loads(argv_lines[0][5:])[-len(nasty):] == nasty


@pytest.mark.both_stores
def test_concurrent_cancel_and_restart_one_wins(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=1000, sleep=0.05))
    shared_service.wait_status(run["id"], "running")
    results: list[int] = []
    barrier = threading.Barrier(2)

    def call(path: str, body: dict | None) -> None:
        barrier.wait()
        results.append(shared_service.client.post(f"/v1/runs/{run['id']}/{path}", json=body).status_code)

    threads = [threading.Thread(target=call, args=("cancel", None)),
               threading.Thread(target=call, args=("restart", {"overrides": {}}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [202, 409]
    final = shared_service.wait_status(run["id"], "cancelled", "running")
    assert final["status"] in ("cancelled", "running")
    shared_service.client.post(f"/v1/runs/{run['id']}/cancel")
    shared_service.wait_status(run["id"], "cancelled")
