"""Hosts are fixed and removed, runs removed (PATCH, DELETE): in-process, the API without the worker."""

from sqlalchemy import func, select

from server.lifecycle import RunStatus as S
from server.models import Event, LogChunk, MetricPoint, Run, utcnow
from tests.inprocess import App

BOX = {"name": "box", "address": "10.0.0.5", "username": "me", "workspace": "/srv/lr", "host_key": "ssh-ed25519 AAAA"}


def test_a_host_is_updated_field_by_field_and_its_workspace_kept_while_a_run_uses_it(api: App) -> None:
    assert api.client.post("/v1/hosts", json=BOX).status_code == 201
    r = api.client.patch("/v1/hosts/box", json={"address": "10.0.0.6", "port": 2222, "python": "/opt/py/bin/python"})
    assert r.status_code == 200, r.text
    host = r.json()
    assert (host["address"], host["port"], host["python"], host["username"]) == ("10.0.0.6", 2222, "/opt/py/bin/python", "me")
    with api.session() as s:
        from server.models import Host
        assert s.scalar(select(Host.host_key).where(Host.name == "box")) == "ssh-ed25519 AAAA"
    # null clears what may be cleared (known_hosts then), and refuses what may not
    assert api.client.patch("/v1/hosts/box", json={"host_key": None, "username": None}).status_code == 200
    assert api.client.get("/v1/hosts/box").json()["username"] is None
    bad = api.client.patch("/v1/hosts/box", json={"address": None})
    assert bad.status_code == 422 and "address cannot be cleared" in bad.text
    assert api.client.patch("/v1/hosts/box", json={"workspace": "relative"}).status_code == 422
    assert api.client.patch("/v1/hosts/box", json={"colour": "red"}).status_code == 422
    assert api.client.patch("/v1/hosts/nope", json={"port": 22}).status_code == 404

    run = api.submit(host="box", name="on-box")
    busy = api.client.patch("/v1/hosts/box", json={"workspace": "/srv/other"})
    assert busy.status_code == 409 and f"on-box [{run['id']}] (queued)" in busy.json()["detail"]
    # a new key while the run waits on the host is what fixes it
    assert api.client.patch("/v1/hosts/box", json={"host_key": "ssh-ed25519 BBBB"}).status_code == 200
    assert api.client.get("/v1/hosts/box").json()["workspace"] == "/srv/lr"


def test_a_host_is_removed_only_once_no_run_that_has_not_ended_uses_it(api: App) -> None:
    assert api.client.post("/v1/hosts", json=BOX).status_code == 201
    run = api.submit(host="box", name="on-box")
    refused = api.client.delete("/v1/hosts/box")
    assert refused.status_code == 409 and "on-box" in refused.json()["detail"] and "cancel" in refused.json()["detail"]
    api.move(run["id"], S.CANCELLING, S.CANCELLED)
    assert api.client.delete("/v1/hosts/box").status_code == 204
    assert api.client.get("/v1/hosts/box").status_code == 404
    assert api.client.delete("/v1/hosts/box").status_code == 404
    # the name is free again
    assert api.client.post("/v1/hosts", json=BOX).status_code == 201


def test_an_ended_run_is_deleted_with_its_metrics_logs_and_events_and_a_live_one_is_refused(api: App) -> None:
    run, other = api.submit(name="gone"), api.submit(name="kept")
    with api.session() as s:
        for rid in (run["id"], other["id"]):
            s.add(MetricPoint(run_id=rid, attempt=1, line=1, name="loss", step=1, value=1.0, time=utcnow()))
            s.add(LogChunk(run_id=rid, attempt=1, node=0, offset=0, end=4, text="one\n"))
    live = api.client.delete(f"/v1/runs/{run['id']}")
    assert live.status_code == 409 and live.json()["status"] == "queued" and "cancel it first" in live.json()["detail"]
    api.move(run["id"], S.CANCELLING, S.CANCELLED)
    assert api.client.delete(f"/v1/runs/{run['id']}").status_code == 204
    assert api.client.get(f"/v1/runs/{run['id']}").status_code == 404
    assert [r["id"] for r in api.client.get("/v1/runs").json()["items"]] == [other["id"]]
    with api.session() as s:
        for table in (MetricPoint, LogChunk, Event):
            left = dict(s.execute(select(table.run_id, func.count()).group_by(table.run_id)).all())
            assert run["id"] not in left and left[other["id"]] >= 1, table
        assert s.get(Run, run["id"]) is None
