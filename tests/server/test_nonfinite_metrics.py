"""A job's NaN and ±Infinity values and its steps that are no steps, through a real server and worker: nothing
vanishes. A non-finite value is the run's latest (a string marker: JSON has no NaN) and no point; each kind of
skip is counted on the attempt and said in an event; a diverged loss is in the run's message and `longrun
status`; a line whose step is no step (-5, 2^31, 2^63, 10^30, "7", 8.5, true) is not stored as step null."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service import ROOT, STUB_ENV, Service

pytestmark = pytest.mark.both_stores

# the metrics file as a job writes it: Python's json writes NaN and Infinity bare, and 1e309 reads as inf
LINES = [
    '{"step": 1, "total_steps": 100, "loss": 2.0, "acc_0": 0.25}',
    '{"step": 2, "loss": 1.5, "acc_0": 0.5}',
    '{"step": 3, "loss_0": NaN, "acc_0": 0.5}',
    '{"step": 4, "loss": NaN, "grad_norm": Infinity}',
    '{"step": 5, "lr": -Infinity, "tokens_per_s": 1e309}',
    '{"step": -5, "acc_0": 0.9}',
    f'{{"step": {2**31}, "acc_0": 0.9}}',
    f'{{"step": {2**63}, "acc_0": 0.9}}',
    f'{{"step": {10**30}, "acc_0": 0.9}}',
    '{"step": "7", "acc_0": 0.9}',
    '{"step": 8.5, "acc_0": 0.9}',
    '{"step": true, "acc_0": 0.9}',
    '{"step": 9.0, "acc_0": 0.75}',  # a float with no fraction is that step
]
JOB = """
import os, sys, time
if os.environ.get("RANK", "0") == "0":
    with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
        f.write(sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
"""


def strict(text: str) -> object:
    """JSON as the standard has it: a NaN or Infinity token in an answer is an error."""
    def refuse(token: str) -> None:
        raise AssertionError(f"the answer holds {token}, which is no JSON")
    return json.loads(text, parse_constant=refuse)


def stream(service: Service, run_id: str) -> list[tuple[str, dict]]:
    """(kind, data) of the run's events, as its stream replays them all once the run is over; strict JSON."""
    text = service.client.get(f"/v1/runs/{run_id}/events").text.replace("\r\n", "\n")
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], strict(fields["data"])))
    return out


def test_non_finite_values_and_bad_steps_are_shown_counted_and_said(service: Service, tmp_path: Path) -> None:
    job, stop = tmp_path / "job.py", tmp_path / "stop"
    job.write_text(JOB)
    try:
        check(service, job, stop)
    finally:
        stop.touch()  # the job ends whatever was found


def check(service: Service, job: Path, stop: Path) -> None:
    run = service.submit({"name": "diverges", "host": "local", "nproc_per_node": 1, "entrypoint": str(job),
                          "args": ["\n".join(LINES) + "\n", str(stop)], "env": STUB_ENV})
    service.wait(run["id"], lambda r: r["latest"].get("step") == 9, what="every line read")
    shown = strict(service.client.get(f"/v1/runs/{run['id']}").text)
    latest = shown["latest"]
    assert (latest["loss"], latest["loss_0"], latest["grad_norm"], latest["lr"], latest["tokens_per_s"]) == (
        "NaN", "NaN", "Infinity", "-Infinity", "Infinity")
    assert latest["acc_0"] == 0.75 and latest["total_steps"] == 100
    assert "loss_0 is NaN at step 3: the training has diverged" in shown["message"]

    points = strict(service.client.get(f"/v1/runs/{run['id']}/metrics").text)["series"]
    assert [(p["step"], p["value"]) for p in points["loss"]] == [(1, 2.0), (2, 1.5)], "no NaN point"
    assert [(p["step"], p["value"]) for p in points["acc_0"]] == [(1, 0.25), (2, 0.5), (3, 0.5), (9, 0.75)], (
        "a line whose step is no step is not stored, least of all as step null")
    assert "grad_norm" not in points and "lr" not in points

    status = subprocess.run([sys.executable, "-m", "longrun.cli", "status", run["id"]], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "LONGRUN_URL": service.url, "COLUMNS": "200"})
    assert status.returncode == 0, status.stderr
    assert "loss_0 NAN" in status.stdout and "the training has diverged" in status.stdout
    attempt = shown["attempts"][0]
    assert attempt["message"].startswith("attempt 1: loss_0 is NaN at step 3")
    assert "(12 metric line(s) or value(s) skipped)" in attempt["message"], "5 non-finite values, 7 steps"
    assert attempt["metrics_skipped"] == 12

    stop.touch()
    assert service.wait_status(run["id"], "succeeded")["latest"]["loss_0"] == "NaN"
    events = stream(service, run["id"])
    skipped = {data["reason"]: data["message"] for kind, data in events if kind == "metrics_skipped"}
    assert set(skipped) == {"not_finite", "bad_step"}
    assert "loss_0 was NaN at step 3" in skipped["not_finite"]
    assert "line 5's step -5 is negative" in skipped["bad_step"]
    loud = [(data["name"], data["value"], data["step"]) for kind, data in events if kind == "loss_not_finite"]
    assert loud == [("loss_0", "NaN", 3)]
