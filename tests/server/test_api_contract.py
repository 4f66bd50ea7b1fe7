"""Input validation, auth, pagination, events and clean safety, as a client sees them."""

import json
import os
from pathlib import Path

import httpx
import pytest

from tests import shared_service as shared
from tests.service import TOY, Service, toy_spec

shared_servers, shared_service = shared.shared_servers, shared.shared_service  # fixtures

# each test talks to a real `longrun serve`: the module's shared one (tests/shared_service.py) where it only submits
# runs and reads its own back, else one of its own (it reads every run or host, or its server needs a token)
pytestmark = pytest.mark.slow


def _loc(response: httpx.Response) -> list[list]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["detail"]]


def test_bad_input_is_a_422_naming_the_field_and_writes_nothing(service: Service) -> None:
    c = service.client
    assert ["body", "host"] in _loc(c.post("/v1/runs", json=toy_spec(host="nowhere")))
    assert ["body", "nproc_per_node"] in _loc(c.post("/v1/runs", json=toy_spec(nproc=0)))
    assert ["body", "nproc_per_node"] in _loc(c.post("/v1/runs", json=toy_spec(nproc=-2)))
    assert ["body", "entrypoint"] in _loc(c.post("/v1/runs", json={**toy_spec(), "entrypoint": "train.py"}))
    assert ["body", "cwd"] in _loc(c.post("/v1/runs", json={**toy_spec(), "cwd": "/data/../etc"}))
    assert ["body", "env"] in _loc(c.post("/v1/runs", json={**toy_spec(), "env": {"BAD-NAME": "1"}}))
    assert ["body", "colour"] in _loc(c.post("/v1/runs", json={**toy_spec(), "colour": "red"}))
    trainer = {"verifier_path": "models/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o"}
    spec = {"name": "t", "host": "local", "trainer": trainer}
    assert ["body", "trainer", "verifier_path"] in _loc(c.post("/v1/runs", json=spec))
    malformed = c.post("/v1/runs", content=b'{"name": "x", ', headers={"Content-Type": "application/json"})
    assert malformed.status_code == 422 and malformed.json()["detail"][0]["type"] == "json_invalid"
    assert ["body", "workspace"] in _loc(c.post("/v1/hosts", json={"name": "h", "address": "10.0.0.1",
                                                                   "workspace": "relative/ws"}))
    assert c.get("/v1/runs").json()["items"] == []
    assert [h["name"] for h in c.get("/v1/hosts").json()] == ["local"]


def test_unknown_or_invalid_override_is_a_422_and_changes_nothing(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=3, sleep=0.01, nproc=1))
    shared_service.wait_status(run["id"], "succeeded")
    c = shared_service.client
    assert ["body", "overrides", "ttt_stepz"] in _loc(
        c.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"ttt_stepz": 5}}))
    assert ["body", "overrides", "ttt_steps"] in _loc(
        c.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"ttt_steps": 5}}))
    assert ["body", "overrides", "nproc_per_node"] in _loc(
        c.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"nproc_per_node": 0}}))
    after = shared_service.run(run["id"])
    assert after["status"] == "succeeded" and after["attempt"] == 1


def test_token_is_required_everywhere_but_healthz(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", token="s3cret")
    svc.home.mkdir()
    svc.start()
    try:
        bare = httpx.Client(base_url=svc.url)
        assert bare.get("/healthz").status_code == 200
        for method, path in [("GET", "/v1/runs"), ("GET", "/v1/hosts"), ("POST", "/v1/runs"),
                             ("GET", "/v1/runs/x/metrics"), ("POST", "/v1/runs/x/cancel")]:
            assert bare.request(method, path).status_code == 401, path
        wrong = httpx.Client(base_url=svc.url, headers={"Authorization": "Bearer nope"})
        assert wrong.get("/v1/runs").status_code == 401
        assert svc.client.get("/v1/runs").status_code == 200
    finally:
        svc.stop()


def test_runs_are_listed_newest_first_in_pages(service: Service) -> None:
    ids = [service.submit(toy_spec(steps=1, sleep=0, nproc=1, name=f"r{i}"))["id"] for i in range(5)]
    page1 = service.client.get("/v1/runs", params={"limit": 2}).json()
    page2 = service.client.get("/v1/runs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = service.client.get("/v1/runs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    seen = [r["id"] for r in page1["items"] + page2["items"] + page3["items"]]
    assert seen == ids[::-1] and page3["next_cursor"] is None
    for run_id in ids:
        service.wait_status(run_id, "succeeded")
    done = service.client.get("/v1/runs", params={"status": "succeeded"}).json()["items"]
    assert len(done) == 5


def test_events_stream_status_changes_and_metrics(shared_service: Service) -> None:
    run = shared_service.submit(toy_spec(steps=10, sleep=0.05, nproc=1))
    kinds, statuses = set(), []
    with shared_service.client.stream("GET", f"/v1/runs/{run['id']}/events", timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                kinds.add(event)
                data = json.loads(line[6:])
                if event == "status":
                    statuses.append(data["to"])
    assert {"status", "metrics"} <= kinds
    assert statuses == ["queued", "launching", "running", "succeeded"]


def test_clean_outside_the_workspace_is_refused_and_deletes_nothing(shared_service: Service, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("data")
    mine = shared_service.workspace / tmp_path.name  # the workspace is the module's: this test's paths in it
    inside = mine / "out"
    inside.mkdir(parents=True)
    (inside / "old.ckpt").write_text("x")
    link = mine / "escape"
    os.symlink(outside, link)

    run = shared_service.submit(toy_spec(steps=2, sleep=0, nproc=1, output_dir=str(inside)))
    shared_service.wait_status(run["id"], "succeeded")
    c = shared_service.client
    r = c.post(f"/v1/runs/{run['id']}/restart", json={"clean": True})
    assert r.status_code == 202, r.text
    assert shared_service.wait_status(run["id"], "succeeded", "failed")["status"] == "succeeded"
    assert not (inside / "old.ckpt").exists(), "clean inside the workspace empties the output dir"

    spec = toy_spec(steps=2, sleep=0, nproc=1, output_dir=str(outside))
    other = shared_service.submit(spec)
    shared_service.wait_status(other["id"], "succeeded")
    r = c.post(f"/v1/runs/{other['id']}/restart", json={"clean": True})
    assert ["body", "clean"] in _loc(r) and "outside the workspace" in r.text

    # a path inside the workspace that is a symlink out: only the host can tell; it refuses there
    escape = shared_service.submit(toy_spec(steps=2, sleep=0, nproc=1, output_dir=str(link)))
    shared_service.wait_status(escape["id"], "succeeded")
    r = c.post(f"/v1/runs/{escape['id']}/restart", json={"clean": True})
    assert r.status_code == 202, r.text
    failed = shared_service.wait_status(escape["id"], "failed", "succeeded")
    assert failed["status"] == "failed" and "outside the host workspace" in failed["message"]
    assert (outside / "keep.txt").read_text() == "data"


def test_openapi_documents_the_contract(shared_service: Service) -> None:
    paths = shared_service.client.get("/openapi.json").json()["paths"]
    for path in ["/v1/hosts", "/v1/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/cancel",
                 "/v1/runs/{run_id}/restart", "/v1/runs/{run_id}/metrics", "/v1/runs/{run_id}/logs",
                 "/v1/runs/{run_id}/events", "/healthz"]:
        assert path in paths, path
    assert TOY.endswith("toy_train.py")
