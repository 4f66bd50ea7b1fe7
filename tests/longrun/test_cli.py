"""The `longrun` command as a user types it, against a real server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longrun import Client
from longrun.cli import main
from tests.inprocess import App
from tests.service import ROOT, Service, free_port, toy_spec


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


@pytest.fixture
def cli(api: App, monkeypatch: pytest.MonkeyPatch) -> App:
    """`longrun` commands in this process, talking to the in-process API (no worker)."""
    monkeypatch.setattr("longrun.cli.Client", lambda: Client(api.client.base_url, http=api.client))
    return api


def test_status_restart_and_hosts_print_what_the_api_answers(cli: App, tmp_path: Path, capsys) -> None:
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps({"name": "toy", "host": "local", "entrypoint": "/opt/train.py"}))
    assert main(["submit", str(spec_file), "--idempotency-key", "k"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert main(["status"]) == 0
    line = capsys.readouterr().out
    assert run["id"] in line and "queued" in line and "attempt 1" in line
    assert main(["status", run["id"]]) == 0
    assert "  attempt 1: pending exit=None" in capsys.readouterr().out
    assert main(["hosts"]) == 0
    hosts = capsys.readouterr().out
    assert hosts.startswith("local ") and "not contacted yet" in hosts
    assert main(["restart", run["id"], "--set", 'args=["--steps","3"]', "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["new_spec"]["args"] == ["--steps", "3"]
    assert main(["cancel", run["id"]]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelling"


def test_refusals_exit_1_with_the_servers_message(cli: App, capsys) -> None:
    with pytest.raises(SystemExit, match="longrun: 404 no run with id 'nope'"):
        main(["status", "nope"])
    with pytest.raises(SystemExit, match="longrun: 422 overrides.colour: unknown override"):
        run = cli.submit()
        main(["restart", run["id"], "--set", "colour=red"])
    with pytest.raises(SystemExit, match="--set takes KEY=VALUE"):
        main(["restart", "x", "--set", "colour"])


def test_a_server_that_is_not_there_says_how_to_start_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGRUN_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(SystemExit, match=r"longrun: cannot reach the server at http://127.0.0.1:\d+ \(start it with `longrun serve`"):
        main(["status"])
