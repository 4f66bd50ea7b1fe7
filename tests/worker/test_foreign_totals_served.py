"""A served run of SpecForge's `specforge train -c run.yaml` gets its total steps from what its host read at launch
(the YAML and the feature files beside it), says how it was found in the run's answer, and its progress follows."""

import json
from pathlib import Path

from tests.service import Service
from tests.unit.test_foreign_totals import BASE, SPECFORGE_YAML

# a stand-in for SpecForge's command: it trains nothing, prints no total, writes one metric line a step
STAND_IN = """\
import json, os, sys, time
assert sys.argv[1:3] == ["train", "-c"], sys.argv
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    for step in range(1, 1000):
        f.write(json.dumps({"step": step, "loss": 1.0, "time": time.time()}) + "\\n"); f.flush()
        time.sleep(0.05)
"""


def test_a_specforge_run_gets_its_total_from_its_yaml_and_data_on_the_host(service: Service, tmp_path: Path) -> None:
    work = tmp_path / "job"
    states = work / "cache" / "hidden_states"
    states.mkdir(parents=True)
    for i in range(40):
        (states / f"data_{i}.ckpt").write_bytes(b"")
    (work / "run.yaml").write_text(SPECFORGE_YAML.format(**BASE))  # 3 epochs, batch 2, 1 rank: 60 steps
    (work / "specforge").write_text(STAND_IN)
    run = service.submit({"name": "specforge", "host": "local", "nproc_per_node": 1, "cwd": str(work),
                          "entrypoint": str(work / "specforge"), "args": ["train", "-c", "run.yaml"]})
    seen = service.wait(run["id"], lambda r: r["status"] == "running" and (r["latest"].get("step") or 0) >= 3,
                        timeout=120, what="the stand-in's first steps")
    assert seen["attempts"][-1]["total_steps"] == 60, json.dumps(seen)[:2000]
    assert seen["progress_note"].startswith("total 60 steps found: ") and "40 feature files" in seen["progress_note"]
    assert seen["progress"] is not None and 0 < seen["progress"] < 1
    service.client.post(f"/v1/runs/{run['id']}/cancel")
    service.wait_status(run["id"], "cancelled", timeout=60)
