"""The `longrun` command as a user types it, against a real server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service import ROOT, Service, toy_spec


def longrun(service: Service, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "LONGRUN_URL": service.url}
    proc = subprocess.run([sys.executable, "-m", "longrun.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


@pytest.mark.slow
def test_submit_watch_restart_logs_and_status(service: Service, tmp_path: Path) -> None:
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps(toy_spec(steps=20, sleep=0.05, nproc=1)))
    run = json.loads(longrun(service, "submit", str(spec_file)).stdout)
    watched = longrun(service, "watch", run["id"], "--interval", "0.3", "--every", "0.5").stdout
    assert "succeeded (attempt 1)" in watched and "step 20/20" in watched and "ETA" in watched
    dry = json.loads(longrun(service, "restart", run["id"], "--set", 'args=["--steps","10"]', "--dry-run").stdout)
    assert dry["dry_run"] is True and dry["new_spec"]["args"] == ["--steps", "10"]
    restarted = json.loads(longrun(service, "restart", run["id"], "--set", 'args=["--steps","10"]').stdout)
    assert restarted["attempt"] == 2
    longrun(service, "watch", run["id"], "--interval", "0.3")
    assert "step 10/10" in longrun(service, "logs", run["id"], "--tail", "5").stdout
    status = longrun(service, "status", run["id"]).stdout
    assert "attempt 1: cancelled" in status or "attempt 1: succeeded" in status
    assert "attempt 2: succeeded" in status
    assert run["id"] in longrun(service, "status").stdout
    assert "local" in longrun(service, "hosts").stdout


@pytest.mark.slow
def test_errors_say_what_was_wrong(service: Service, tmp_path: Path) -> None:
    spec_file = tmp_path / "bad.json"
    spec_file.write_text(json.dumps(toy_spec(nproc=0)))
    bad = longrun(service, "submit", str(spec_file), check=False)
    assert bad.returncode != 0 and "422" in bad.stderr and "nproc_per_node" in bad.stderr
    missing = longrun(service, "status", "nope", check=False)
    assert missing.returncode != 0 and "no run with id" in missing.stderr


def test_advise_from_an_evaluation_file(tmp_path: Path) -> None:
    report = {"by_depth": [{"depth": d, "mean_accepted": 1 + sum([0.8, 0.6, 0.45, 0.3][:d])} for d in range(1, 5)],
              "position_acceptance": [0.8, 0.6, 0.45, 0.3]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "-m", "longrun.cli", "advise", "--evaluation", str(path), "--interconnect",
                          "both", "--tp", "8"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    advice = json.loads(out.stdout)
    assert advice["pcie"]["recommended_depth"] >= advice["nvlink"]["recommended_depth"] >= 1
