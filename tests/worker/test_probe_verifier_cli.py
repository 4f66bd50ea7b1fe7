"""`longrun hosts probe-verifier` end to end: the command, a real `longrun serve` and its worker, hostside's
`verifier` verb on the `local` host running worker/verifier_probe.py as installed there, tests/fakegpu's nvidia-smi
(two H200s) on its PATH. This box's torch sees no GPU: the probe's refusal is the answer the command shows."""

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import ROOT, Service, serve_with_fake_gpus


def cuda_available() -> bool:
    import torch  # at a test's setup (the skipif below is a string, evaluated then), not at collection

    return torch.cuda.is_available()


pytestmark = [pytest.mark.slow,  # a real server
              pytest.mark.skipif("cuda_available()", reason="this box has a GPU: the probe would measure")]

KIMI = str(ROOT / "tests" / "fixtures" / "verifiers" / "kimi-k2.5")
SCRIPT = (ROOT / "worker" / "verifier_probe.py").read_text()


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    yield from (service for service, _state in serve_with_fake_gpus(tmp_path))


def longrun(svc: Service, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LONGRUN_URL": svc.url}
    return subprocess.run([sys.executable, "-m", "longrun.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_probe_verifier_runs_the_probe_on_the_host_and_says_it_found_no_gpu_there(svc: Service) -> None:
    done = longrun(svc, "hosts", "probe-verifier", "local", "--config", KIMI, "--tp", "8", "--ep", "8", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the verifier probe of local did not measure: the verifier probe could not measure: no GPU on " \
        in done.stderr
    answer = json.loads(done.stdout)
    assert answer["status"] == "failed" and answer["moe_ms"] == [] and "no GPU on" in answer["message"]
    # the script ran from the workspace's .longrun/bin, content-addressed as the interconnect sweep is
    name = f"verifier-probe-{hashlib.sha256(SCRIPT.encode()).hexdigest()[:12]}.py"
    assert (svc.workspace / ".longrun" / "bin" / name).read_text() == SCRIPT
    assert svc.client.get("/v1/hosts/local/verifier").json()["status"] == "failed"

    # an ep that is neither 1 nor the tp: refused before anything runs, naming the rule
    wrong = longrun(svc, "hosts", "probe-verifier", "local", "--config", KIMI, "--tp", "8", "--ep", "4")
    assert wrong.returncode != 0 and "ep is 1 (experts sliced by tp) or the tp (8), not 4" in wrong.stderr
