"""POST/GET /v1/hosts/{name}/verifier in-process: the API, and the worker's InterconnectResponder running hostside's
`verifier` verb on the `local` host for real (the script installed under the workspace's .longrun/bin and run
there). This box has no GPU, so the script sent is a stand-in answering the layer times one H200 measured
(tests/fixtures/verifier-probe); tests/worker/test_probe_verifier_cli.py runs the real one, which refuses."""

import json
from pathlib import Path

import pytest

from server.models import Host
from tests.inprocess import App
from tests.server.test_api_routes import locs
from tests.server.test_interconnect_api import answer_probes, fake_host_env, probe, responder  # noqa: F401
from tests.server.test_proposal import SHALLOW, feed, trainer_run, validate
from worker import interconnect
from worker.interconnect import InterconnectResponder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KIMI = str(FIXTURES / "verifiers" / "kimi-k2.5")
CAPTURED = FIXTURES / "verifier-probe" / "kimi-k2.5-tp8-ep8.json"
# the lm head's bf16 read at tp=2, modelled (163840 x 7168 at 3.5 TB/s)
HEAD_MS_TP2 = 163840 * 7168 * 2 / 2 / 3.5e12 * 1000

STAND_IN = f"""import argparse, json
parser = argparse.ArgumentParser()
for flag in ("--config", "--tp", "--ep"):
    parser.add_argument(flag)
args = parser.parse_args()
captured = json.load(open({str(CAPTURED)!r}))
print(json.dumps({{**captured, "path": args.config, "tp": int(args.tp), "ep": int(args.ep)}}))
"""


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> str:
    """The verifier probe the worker sends: the stand-in; returns the name it is installed under."""
    monkeypatch.setattr(interconnect, "VERIFIER_PROBE_SOURCE", STAND_IN)
    monkeypatch.setattr(interconnect, "VERIFIER_PROBE_NAME", "verifier-probe-standin.py")
    return "verifier-probe-standin.py"


@pytest.mark.usefixtures("fake_host_env")
def test_a_verifier_probe_is_kept_beside_the_table_and_the_proposal_prices_the_forward_as_measured(
        api: App, responder: InterconnectResponder, stand_in: str) -> None:  # noqa: F811
    probe(api, responder, tp=2)
    url = "/v1/hosts/local/verifier"
    assert api.client.get(url).json()["status"] == "not_measured"
    pending = api.client.post(url, json={"config": KIMI, "tp": 2, "ep": 2})
    assert pending.status_code == 202, pending.text
    assert pending.json()["status"] == "pending"
    assert pending.json()["requested"] == {"config": KIMI, "tp": 2, "ep": 2}
    answer_probes(responder)
    measured = api.client.get(url).json()
    captured = json.loads(CAPTURED.read_text())
    assert measured["status"] == "measured" and measured["message"] is None and measured["requested"] is None
    assert measured["path"] == KIMI and (measured["tp"], measured["ep"]) == (2, 2)
    assert measured["moe_ms"] == captured["moe_ms"] and measured["dense_ms"] == captured["dense_ms"]
    assert measured["gpu"] == captured["gpu"] and measured["dtype"] == "int4"
    assert (api.workspace / ".longrun" / "bin" / stand_in).read_text() == STAND_IN, "installed where named"
    assert not responder.run_once(), "an answered probe is not run again"

    # a new all-reduce table keeps the verifier's times beside it
    assert probe(api, responder, tp=2)["status"] == "measured"
    assert api.client.get(url).json()["moe_ms"] == captured["moe_ms"]

    # a run served there at tp=2 ep=2: the forward is the probe's, layer by layer; at ep=1 it is modelled, saying why
    runs = {}
    for ep in (2, 1):
        runs[ep] = run_id = trainer_run(api, deploy={"host": "local", "verifier": KIMI, "ep": ep})
        feed(api, run_id, 0, {"step": 100, "total_steps": 1000, "loss": 2.0}, step_seconds=3.0)
        validate(api, run_id, 1, 100, SHALLOW)
    timed = api.client.get(f"/v1/runs/{runs[2]}/proposal").json()
    assert timed["terms_basis"]["verifier_forward"].startswith("measured on local by probe-verifier")
    # depth 15 verifies 16 tokens: the 16th time of each layer, x its 1 dense and 60 MoE layers, + the head
    at_15 = next(row for row in timed["advice"]["by_depth"] if row["depth"] == 15)
    assert at_15["terms"]["verifier_ms"] == pytest.approx(
        captured["dense_ms"][15] + 60 * captured["moe_ms"][15] + HEAD_MS_TP2, rel=1e-3)
    modelled = api.client.get(f"/v1/runs/{runs[1]}/proposal").json()["terms_basis"]["verifier_forward"]
    assert modelled.startswith("modelled from kimi-k2.5") and "tp=2 ep=2 layer, not tp=2 ep=1" in modelled


def test_a_host_with_no_gpu_is_refused_at_once_and_bad_requests_are_422s_naming_the_field(
        api: App, responder: InterconnectResponder) -> None:  # noqa: F811
    url = "/v1/hosts/local/verifier"
    assert locs(api.client.post(url, json={"config": "model/config.json", "tp": 8})) == [["body", "config"]]
    assert locs(api.client.post(url, json={"config": KIMI, "tp": 0})) == [["body", "tp"]]
    assert locs(api.client.post(url, json={"config": KIMI})) == [["body", "tp"]]
    wrong_ep = api.client.post(url, json={"config": KIMI, "tp": 8, "ep": 4})
    assert wrong_ep.status_code == 422 and "ep is 1 (experts sliced by tp) or the tp (8), not 4" in wrong_ep.text
    for method in ("GET", "POST"):
        missing = api.client.request(method, "/v1/hosts/nope/verifier", json={"config": KIMI, "tp": 8})
        assert missing.status_code == 404 and missing.json()["detail"].startswith("no host named 'nope': register it with `longrun hosts add nope ")
    # the worker's snapshot as nvidia-smi missing leaves it: no GPU, so nothing is asked of the worker
    with api.session() as s:
        host = s.query(Host).filter_by(name="local").one()
        host.gpu_snapshot = {"available": False, "message": "nvidia-smi not found on this host", "gpus": []}
        host.gpu_snapshot_at = host.created_at
    refused = api.client.post(url, json={"config": KIMI, "tp": 8, "ep": 8})
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"].startswith("no GPU on local (nvidia-smi at ")
    assert "nvidia-smi not found on this host" in refused.json()["detail"]
    assert not responder.run_once() and api.client.get(url).json()["status"] == "not_measured"
