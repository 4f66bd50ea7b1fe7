"""Checked at submit, on the host: a trainer run whose input path is not there is a 422 naming the field (one call
to the host, answered by the worker), not a run that fails seconds later; a real `longrun serve` and its worker."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import shared_service as shared
from tests.service import ROOT, Service

shared_servers, shared_service = shared.shared_servers, shared.shared_service  # fixtures
pytestmark = pytest.mark.slow


def trainer_spec(tmp_path: Path, name: str, **paths: str) -> dict:
    for d in ("v", "d", "m"):
        (tmp_path / d).mkdir(exist_ok=True)
    trainer = {"verifier_path": str(tmp_path / "v"), "data_dir": str(tmp_path / "d"),
               "vocab_mapping_dir": str(tmp_path / "m"), "output_dir": str(tmp_path / "out"), **paths}
    return {"name": name, "host": "local", "nproc_per_node": 1, "trainer": trainer}


def test_a_missing_input_path_is_refused_at_submit_naming_the_field(shared_service: Service, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-verifier")
    refused = shared_service.client.post("/v1/runs", json=trainer_spec(tmp_path, "inputs-a", verifier_path=missing))
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "trainer", "verifier_path"]
    assert error["msg"].startswith(f"{missing} is not on host local (looked for there just now): fix the path")
    names = [r["name"] for r in shared_service.client.get("/v1/runs", params={"limit": 200}).json()["items"]]
    assert "inputs-a" not in names, "nothing was submitted"

    demo = str(tmp_path / ".demo" / "data" / "hidden_states")
    refused = shared_service.client.post("/v1/runs", json=trainer_spec(tmp_path, "inputs-b", data_dir=demo))
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "trainer", "data_dir"] and "`make demo-quick`" in error["msg"], error

    there = shared_service.submit(trainer_spec(tmp_path, "inputs-c"))  # every input there: the run is queued
    shared_service.client.post(f"/v1/runs/{there['id']}/cancel")
    shared_service.wait_status(there["id"], "cancelled", "failed")


def test_the_command_shows_the_refusal_and_what_makes_the_path(shared_service: Service, tmp_path: Path) -> None:
    spec = tmp_path / "run.yaml"
    spec.write_text("name: inputs-cli\nhost: local\nnproc_per_node: 1\ntrainer:\n  verifier_path: ../.demo/verifier\n"
                    f"  data_dir: {tmp_path}\n  vocab_mapping_dir: {tmp_path}\n  output_dir: out\n")
    shown = subprocess.run([sys.executable, "-m", "longrun.cli", "submit", str(spec)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "LONGRUN_URL": shared_service.url})
    assert shown.returncode == 5, shown.stderr
    err = " ".join(shown.stderr.split())
    assert "trainer.verifier_path" in err and f"{tmp_path.parent}/.demo/verifier is not on host local" in err, err
    assert "`make demo-quick` (or `make demo`) prepares .demo/verifier and .demo/data" in err
