"""The seed's own case through a real `longrun serve`: an EAGLE-3 draft for Kimi-K2.5 (tests/fixtures/verifiers)
trained at TTT=3, deployed with SGLang at tp=8 on a PCIe-only box (tests/fixtures/pcie-model, stored through
probe-interconnect), whose sim acceptance falls past depth 3. The retrain rule's record does not trust a restart
from TTT=3, so the answer is the probe that settles it, priced before it runs; taken, it runs at the deeper TTT for
its steps, and at its validation the service decides and the run continues as decided.

The trainer is a stand-in (this box has no GPU): `python -m trainer.train` resolves to STANDIN in the run's cwd,
which writes the bundled trainer's metric lines to $LONGRUN_METRICS_FILE (trainer/metrics.py): a step line each
step, whose time grows with the TTT depth, and a validation line (sim_acc_k, sim_step_acc_k and the rounds behind
them) every 200 steps and at the last step."""

import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import ROOT, Service, kill_leftovers

pytestmark = pytest.mark.slow  # a real server running a job

STANDIN = """
import argparse, json, os, time

p = argparse.ArgumentParser()
p.add_argument("--ttt-steps", type=int, default=3)
p.add_argument("--max-steps", type=int, default=None)
args, _ = p.parse_known_args()
total = args.max_steps or 100000
out = open(os.environ["LONGRUN_METRICS_FILE"], "a")
ttt = args.ttt_steps
# inside the trained depth the draft holds; past it, a TTT=3 draft falls and a deeper one holds further
acc = [0.8, 0.75, 0.7] + [0.7 if k < ttt else 0.3 for k in range(3, 8)]
step_acc = [0.8, 0.6, 0.42] + [0.3 if k < ttt else 0.1 for k in range(3, 8)]
for step in range(1, total + 1):
    time.sleep(0.004 * (1 + ttt))
    out.write(json.dumps({"step": step, "total_steps": total, "time": time.time(), "loss": 2.0,
                          "ttt_steps": ttt}) + "\\n")
    if step % 200 == 0 or step == total:
        rounds = [20000] * len(acc)
        line = {"step": step, "total_steps": total, "val_loss": 1.0}
        for k, (a, u) in enumerate(zip(acc, step_acc), 1):
            line |= {f"sim_acc_{k}": a, f"sim_step_acc_{k}": u, f"sim_rounds_{k}": rounds[k - 1],
                     f"sim_scored_{k}": 20000}
        out.write(json.dumps(line) + "\\n")
    out.flush()
"""
KIMI = ROOT / "tests" / "fixtures" / "verifiers" / "kimi-k2.5"
PCIE_BOX = ROOT / "tests" / "fixtures" / "pcie-model" / "allreduce-pcie-tp8.json"


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    service = Service(tmp_path / "home")
    # the deploy box's probe answers with the PCIe model at tp=8, as `make demo` stores it
    service.env["LONGRUN_ALLREDUCE_SWEEP"] = shlex.join([
        "env", "NCCL_P2P_DISABLE=1", f"FAKE_ALLREDUCE_TABLE={PCIE_BOX}",
        str(ROOT / "tests" / "fakegpu" / "allreduce-sweep")])
    service.home.mkdir()
    service.start()
    yield service
    service.stop()
    kill_leftovers(service.workspace)


def test_the_seeds_case_gets_a_priced_probe_that_decides_and_the_run_continues(svc: Service, tmp_path: Path) -> None:
    c = svc.client
    assert c.post("/v1/hosts", json={"name": "pcie-box", "address": "local", "python": sys.executable,
                                     "workspace": str(tmp_path / "box")}).status_code == 201
    standin = tmp_path / "standin"
    (standin / "trainer").mkdir(parents=True)
    (standin / "trainer" / "__init__.py").write_text("")
    (standin / "trainer" / "train.py").write_text(STANDIN)
    deploy = {"host": "pcie-box", "tp": 8, "engine": "sglang", "verifier": str(KIMI)}
    for inputs in ("d", "v"):  # a submit looks for a trainer's inputs on its host (the stand-in reads none)
        (tmp_path / inputs).mkdir()
    spec = {"name": "kimi-eagle3", "host": "local", "cwd": str(standin),
            "trainer": {"verifier_path": str(KIMI), "data_dir": str(tmp_path / "d"),
                        "vocab_mapping_dir": str(tmp_path / "v"), "ttt_steps": 3,
                        "output_dir": str(svc.workspace / "out"), "max_steps": 6000}, "deploy": deploy}
    refused = c.post("/v1/runs", json=spec)
    assert refused.status_code == 422 and "probe-interconnect pcie-box --tp 8" in refused.text, "no table yet"

    assert c.post("/v1/hosts/pcie-box/interconnect", json={"tp": 8}).status_code == 202
    deadline = time.monotonic() + 60
    while (box := c.get("/v1/hosts/pcie-box/interconnect").json())["status"] == "pending":
        assert time.monotonic() < deadline, "the interconnect probe did not answer"
        time.sleep(0.2)
    assert box["status"] == "measured" and box["tp"] == 8, box
    run = svc.submit(spec)
    svc.wait(run["id"], lambda r: "sim_acc_1" in r["latest"], what="the first validation")
    got = c.get(f"/v1/runs/{run['id']}/proposal").json()
    assert got["action"] == "probe", got["summary"]
    offer = got["probe"]
    assert offer["trained_ttt"] == 3 and 3 < offer["ttt"] <= 7
    assert offer["steps"] == 300 and offer["predicted_seconds"] > 0 and offer["gpu_hours"] > 0
    assert got["summary"].startswith(f"probe TTT={offer['ttt']}: resume the checkpoint")
    assert "kimi-k2.5" in got["verifier"] and got["advice"]["tp"] == 8 and got["advice"]["interconnect"] == "pcie"
    assert "missed by" in got["rule_record"] and got["auto_restart"].startswith("off:")

    assert c.post(f"/v1/runs/{run['id']}/proposal/probe").status_code == 202
    decided = svc.wait(run["id"], lambda r: r["attempt"] == 3, timeout=180, what="the probe's decision")
    trainer = decided["attempts"][-1]["spec"]["trainer"]
    assert trainer["ttt_steps"] == offer["ttt"] and trainer["max_steps"] == 6000, "continues deeper, uncapped"
    answer = c.get(f"/v1/runs/{run['id']}/proposal").json()["probe"]
    assert answer["status"] == "decided" and answer["decision"].startswith(f"restart at TTT={offer['ttt']}")
