"""POST/GET /v1/hosts/{name}/interconnect and GET /v1/runs/{id}/advice?deploy_host=NAME, in-process: the API,
and the worker's InterconnectResponder probing the `local` host for real through hostside, with tests/fakegpu's
nvidia-smi and all-reduce sweep (the captured H200 outputs) as the host's."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.models import Host
from tests.inprocess import App
from tests.server.test_api_routes import EVALUATION, evaluated_run, locs
from worker.clock import Clock
from worker.host_contact import HostContact
from worker.interconnect import InterconnectResponder
from worker.transport_pool import TransportPool

ROOT = Path(__file__).resolve().parents[2]
FAKEGPU = ROOT / "tests" / "fakegpu"
FIXTURES = ROOT / "tests" / "fixtures" / "h200x2"
NVLINK = json.loads((FIXTURES / "allreduce-nvlink.json").read_text())["allreduce"]
P2P_DISABLED = json.loads((FIXTURES / "allreduce-p2p-disabled.json").read_text())["allreduce"]


@pytest.fixture
def fake_host_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This machine as a two-H200 host: nvidia-smi and the sweep are tests/fakegpu's; returns the state file."""
    state = tmp_path / "gpu-state.json"
    state.write_text("{}")
    monkeypatch.setenv("PATH", f"{FAKEGPU}:{os.environ['PATH']}")
    monkeypatch.setenv("LONGRUN_ALLREDUCE_SWEEP", str(FAKEGPU / "allreduce-sweep"))
    monkeypatch.setenv("FAKE_GPU_STATE", str(state))
    return state


@pytest.fixture
def responder(api: App) -> Iterator[InterconnectResponder]:
    transports = TransportPool()
    yield InterconnectResponder(api.db, HostContact(api.db, transports, 60, Clock()), Clock())
    transports.close_all()


def answer_probes(responder: InterconnectResponder) -> None:
    """What the worker's next tick does with the probes asked for."""
    hosts = responder.run_once()
    assert hosts, "no probe was asked for"
    for host in hosts:
        responder.answer(host)


def probe(api: App, responder: InterconnectResponder, **body: object) -> dict:
    r = api.client.post("/v1/hosts/local/interconnect", json=body)
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "pending"
    answer_probes(responder)
    return api.client.get("/v1/hosts/local/interconnect").json()


def test_a_probe_measures_the_hosts_all_reduce_times_and_keeps_them_with_the_host(
        api: App, responder: InterconnectResponder, fake_host_env: Path) -> None:
    before = api.client.get("/v1/hosts/local/interconnect").json()
    assert before["status"] == "not_measured" and before["allreduce"] == []
    pending = api.client.post("/v1/hosts/local/interconnect", json={"tp": 2}).json()
    assert pending["status"] == "pending" and pending["requested_tp"] == 2
    assert api.client.post("/v1/hosts/local/interconnect", json={"tp": 2}).status_code == 202  # same probe
    answer_probes(responder)
    table = api.client.get("/v1/hosts/local/interconnect").json()
    assert table["status"] == "measured" and table["message"] is None and table["requested_tp"] is None
    assert table["tp"] == 2 and table["interconnect"] == "nvlink" and table["gpus"] == ["NVIDIA H200"] * 2
    assert table["allreduce"] == NVLINK and table["measured_at"]
    assert table["topology"]["links"] == [{"a": 0, "b": 1, "path": "NV18"}]
    assert not responder.run_once(), "an answered probe is not run again"

    # every GPU when tp is left out; NCCL_P2P_DISABLE=1 on the host: through host memory, read as pcie
    os.environ["NCCL_P2P_DISABLE"] = "1"
    try:
        table = probe(api, responder)
    finally:
        del os.environ["NCCL_P2P_DISABLE"]
    assert table["tp"] == 2 and table["interconnect"] == "pcie" and table["allreduce"] == P2P_DISABLED
    assert table["nccl_env"] == {"NCCL_P2P_DISABLE": "1"}


def test_bad_probe_requests_are_422s_naming_the_field_and_an_unknown_host_a_404(api: App) -> None:
    assert locs(api.client.post("/v1/hosts/local/interconnect", json={"tp": 0})) == [["body", "tp"]]
    assert locs(api.client.post("/v1/hosts/local/interconnect", json={"tp": "two"})) == [["body", "tp"]]
    assert locs(api.client.post("/v1/hosts/local/interconnect", json={"tp": 65})) == [["body", "tp"]]
    assert locs(api.client.post("/v1/hosts/local/interconnect", json={"ranks": 2})) == [["body", "ranks"]]
    for method in ("GET", "POST"):
        missing = api.client.request(method, "/v1/hosts/nope/interconnect")
        assert missing.status_code == 404 and missing.json()["detail"].startswith("no host named 'nope': register it with `longrun hosts add nope ")
    with api.session() as s:
        assert s.query(Host).filter_by(name="local").one().interconnect_wanted_tp is None, "nothing written"


def test_a_host_with_fewer_gpus_than_tp_gets_a_clear_answer_never_a_table(
        api: App, responder: InterconnectResponder, fake_host_env: Path) -> None:
    measured = probe(api, responder, tp=2)
    # not known to have too few GPUs: the probe runs, and the sweep's own refusal is the answer
    failed = probe(api, responder, tp=4)
    assert failed["status"] == "failed"
    assert "this host has 2 GPU(s); measuring all-reduce at tp=4 needs 4" in failed["message"]
    assert failed["tp"] == 2 and failed["allreduce"] == measured["allreduce"], "the older table stays, marked"
    # known from its GPU snapshot: refused at once, nothing asked of the worker
    with api.session() as s:
        host = s.query(Host).filter_by(name="local").one()
        host.gpu_snapshot = {"available": True, "message": None, "gpus": [{"index": 0}, {"index": 1}]}
        host.gpu_snapshot_at = host.created_at
    refused = api.client.post("/v1/hosts/local/interconnect", json={"tp": 8})
    assert refused.status_code == 409 and "local has 2 GPU(s)" in refused.json()["detail"]
    assert "tp=8 needs 8" in refused.json()["detail"] and not responder.run_once()


def test_a_second_probe_at_another_tp_waits_for_the_first(api: App) -> None:
    assert api.client.post("/v1/hosts/local/interconnect", json={"tp": 2}).status_code == 202
    clash = api.client.post("/v1/hosts/local/interconnect", json={"tp": 1})
    assert clash.status_code == 409 and "at tp=2 is under way" in clash.json()["detail"]


def test_garbage_from_the_host_fails_the_probe_with_the_reason_and_garbage_topology_is_noted(
        api: App, responder: InterconnectResponder, fake_host_env: Path) -> None:
    fake_host_env.write_text(json.dumps({"sweep": "NCCL WARN \x1b[31mcuda failure\n{not json", "sweep_rc": 1}))
    failed = probe(api, responder, tp=2)
    assert failed["status"] == "failed" and "did not answer JSON (exit 1)" in failed["message"]
    fake_host_env.write_text(json.dumps({"topo": "\x00garbage\nGPU0 GPU1\nGPU0 X ???\n"}))
    measured = probe(api, responder, tp=2)
    assert measured["status"] == "measured" and measured["allreduce"] == NVLINK
    assert measured["interconnect"] is None and "not a known link type" in measured["topology"]["note"]


def test_advice_uses_the_deploy_hosts_measured_table_and_says_so(
        api: App, responder: InterconnectResponder, fake_host_env: Path) -> None:
    run_id = evaluated_run(api, {**EVALUATION, "position_acceptance": [0.8, 0.6, 0.45]})
    url = f"/v1/runs/{run_id}/advice"
    unmeasured = api.client.get(url, params={"deploy_host": "local"})
    assert unmeasured.status_code == 409 and "probe-interconnect local" in unmeasured.json()["detail"]
    probe(api, responder, tp=2)

    default = api.client.get(url, params={"tp": 2}).json()
    assert default["allreduce_source"] == "built-in default" and default["deploy_host"] is None
    deployed = api.client.get(url, params={"deploy_host": "local"}).json()
    assert deployed["allreduce_source"] == "deploy host" and deployed["deploy_host"] == "local"
    assert deployed["tp"] == 2 and deployed["interconnect"] == "nvlink"
    assert deployed["allreduce_basis"].startswith("measured on local by probe-interconnect")
    assert deployed["cost_model"]["allreduce_us"] == [[r["bytes"], r["us"]] for r in NVLINK]

    # measured through host memory: the host's table, not the built-in NVLink one, prices the rounds
    os.environ["NCCL_P2P_DISABLE"] = "1"
    try:
        probe(api, responder, tp=2)
    finally:
        del os.environ["NCCL_P2P_DISABLE"]
    slow = api.client.get(url, params={"deploy_host": "local"}).json()
    assert slow["interconnect"] == "pcie" and "NCCL_P2P_DISABLE" in slow["allreduce_basis"]
    assert slow["cost_model"]["allreduce_us"] == [[r["bytes"], r["us"]] for r in P2P_DISABLED]
    assert [r["round_ms"] for r in slow["by_depth"]] != [r["round_ms"] for r in deployed["by_depth"]]

    extrapolated = api.client.get(url, params={"deploy_host": "local", "tp": 8})
    assert extrapolated.status_code == 409
    assert "measured at tp=2" in extrapolated.json()["detail"] and "extrapolate" in extrapolated.json()["detail"]
    contradicted = api.client.get(url, params={"deploy_host": "local", "interconnect": "nvlink"})
    assert contradicted.status_code == 409 and "linked by pcie" in contradicted.json()["detail"]
    single = api.client.get(url, params={"deploy_host": "local", "tp": 1}).json()
    assert single["tp"] == 1 and single["allreduce_basis"] == "tp=1: no all-reduce"
    assert api.client.get(url, params={"deploy_host": "nope"}).status_code == 404
    assert locs(api.client.get(url, params={"deploy_host": "x" * 65})) == [["query", "deploy_host"]]


def test_the_stored_table_is_a_file_longrun_advise_reads(api: App, responder: InterconnectResponder,
                                                         fake_host_env: Path, tmp_path: Path) -> None:
    from server.advisor import load_allreduce_table

    saved = tmp_path / "local-interconnect.json"
    saved.write_text(json.dumps(probe(api, responder, tp=2)))
    assert load_allreduce_table(str(saved)) == tuple((r["bytes"], r["us"]) for r in NVLINK)
