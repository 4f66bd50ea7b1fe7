"""`longrun hosts probe-interconnect` end to end: the command, a real `longrun serve` and its worker, a real
OpenSSH server as the host, hostside's interconnect verb there; the host's nvidia-smi and all-reduce sweep are
tests/fakegpu's stand-ins (the captured H200 outputs), set in the host's environment by sshd."""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.db import Database
from server.models import Attempt
from tests.service import ROOT, Service, kill_leftovers
from tests.sshd import SshServer

pytestmark = pytest.mark.slow  # a real server and sshd

FAKEGPU = ROOT / "tests" / "fakegpu"
FIXTURES = ROOT / "tests" / "fixtures" / "h200x2"
NVLINK = json.loads((FIXTURES / "allreduce-nvlink.json").read_text())["allreduce"]
P2P_DISABLED = json.loads((FIXTURES / "allreduce-p2p-disabled.json").read_text())["allreduce"]


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    service = Service(tmp_path / "home", ssh_connect_timeout=5, ssh_command_timeout=30)
    service.home.mkdir()
    service.start()
    yield service
    service.stop()
    kill_leftovers(service.workspace)


def two_h200_host(svc: Service, tmp_path: Path, name: str, **env: str) -> tuple[SshServer, Path]:
    """An sshd whose sessions see the fakegpu stand-ins, registered as host `name`; returns it and the file
    the stand-ins read their state from."""
    state = tmp_path / f"{name}-gpu-state.json"
    state.write_text("{}")
    sshd = SshServer(env={"PATH": f"{FAKEGPU}:/usr/local/bin:/usr/bin:/bin", "FAKE_GPU_STATE": str(state),
                          "LONGRUN_ALLREDUCE_SWEEP": str(FAKEGPU / "allreduce-sweep"), **env})
    sshd.__enter__()
    workspace = tmp_path / f"ws-{name}"
    workspace.mkdir()
    r = svc.client.post("/v1/hosts", json={"name": name, **sshd.host_fields, "workspace": str(workspace),
                                           "python": sys.executable})
    assert r.status_code == 201, r.text
    return sshd, state


def longrun(svc: Service, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LONGRUN_URL": svc.url}
    return subprocess.run([sys.executable, "-m", "longrun.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_probe_interconnect_over_ssh_measures_stores_and_feeds_the_advice(svc: Service, tmp_path: Path) -> None:
    sshd, state = two_h200_host(svc, tmp_path, "box")
    pcie_sshd, _ = two_h200_host(svc, tmp_path, "nolink", NCCL_P2P_DISABLE="1")
    try:
        done = longrun(svc, "hosts", "probe-interconnect", "box", "--tp", "2", "--json")
        assert done.returncode == 0, done.stderr
        table = json.loads(done.stdout)
        assert table["status"] == "measured" and table["tp"] == 2 and table["interconnect"] == "nvlink"
        assert table["allreduce"] == NVLINK and table["gpus"] == ["NVIDIA H200"] * 2
        assert svc.client.get("/v1/hosts/box/interconnect").json()["allreduce"] == NVLINK

        # more GPUs than the host has: the command fails saying so, and the measured table stays as it was
        too_many = longrun(svc, "hosts", "probe-interconnect", "box", "--tp", "4")
        assert too_many.returncode == 1
        assert "did not measure" in too_many.stderr and "this host has 2 GPU(s)" in too_many.stderr
        assert svc.client.get("/v1/hosts/box/interconnect").json()["allreduce"] == NVLINK

        # garbage from the host's sweep: a failed probe with the reason, the server unharmed
        state.write_text(json.dumps({"sweep": "\x1b[1mSegmentation fault\x00\n{{{", "sweep_rc": 139}))
        garbage = longrun(svc, "hosts", "probe-interconnect", "box", "--tp", "2")
        assert garbage.returncode == 1 and "did not answer JSON (exit 139)" in garbage.stderr
        assert svc.client.get("/healthz").status_code == 200

        # the host without GPU peer links (NCCL_P2P_DISABLE=1 in its environment), every GPU
        nolink = longrun(svc, "hosts", "probe-interconnect", "nolink", "--json")
        assert nolink.returncode == 0, nolink.stderr
        assert json.loads(nolink.stdout)["allreduce"] == P2P_DISABLED

        run_id = evaluated_run(svc)
        by_host = {name: svc.client.get(f"/v1/runs/{run_id}/advice", params={"deploy_host": name}).json()
                   for name in ("box", "nolink")}
        assert by_host["box"]["allreduce_source"] == "deploy host" and by_host["box"]["interconnect"] == "nvlink"
        assert by_host["nolink"]["interconnect"] == "pcie"
        assert by_host["nolink"]["cost_model"]["allreduce_us"] == [[r["bytes"], r["us"]] for r in P2P_DISABLED]
        default = svc.client.get(f"/v1/runs/{run_id}/advice", params={"tp": 2}).json()
        assert default["allreduce_source"] == "built-in default" and default["deploy_host"] is None
    finally:
        sshd.__exit__(None, None, None)
        pcie_sshd.__exit__(None, None, None)


def evaluated_run(svc: Service) -> str:
    """A trainer run with an evaluation report, written where the worker writes one."""
    inputs = svc.home / "inputs"  # there: a submit looks for a trainer's inputs on its host
    for d in ("v", "d", "m"):
        (inputs / d).mkdir(parents=True, exist_ok=True)
    trainer = {"verifier_path": str(inputs / "v"), "data_dir": str(inputs / "d"), "vocab_mapping_dir": str(inputs / "m"),
               "output_dir": "/o", "ttt_steps": 2}
    r = svc.client.post("/v1/runs", json={"name": "t", "host": "local", "trainer": trainer})
    assert r.status_code == 201, r.text
    db = Database(f"sqlite:///{svc.home / 'longrun.db'}")
    try:
        with db.writing() as s:
            attempt = s.query(Attempt).filter_by(run_id=r.json()["id"]).one()
            attempt.evaluation = {"position_acceptance": [0.8, 0.6, 0.45, 0.3],
                                  "by_depth": [{"depth": d, "mean_accepted": m}
                                               for d, m in ((1, 1.8), (2, 2.4), (3, 2.85), (4, 3.15))]}
    finally:
        db.dispose()
    return r.json()["id"]
