"""A run is named by its id, a unique prefix of it or its name on every route. A name is unique among live runs: a
second submit of a live name is a 409 naming the live run (or NAME-2 with ?name_suffix); among ended runs the newest
wins, its answer's Longrun-Note header naming the others. In-process, the API without the worker."""

from server.lifecycle import RunStatus as S
from server.models import Run
from tests.inprocess import App

RUN = {"host": "local", "entrypoint": "/opt/train.py"}


def post(api: App, name: str, **params: str):
    return api.client.post("/v1/runs", json={**RUN, "name": name}, params=params)


def test_a_run_is_named_by_a_unique_id_prefix_or_name(api: App) -> None:
    first = post(api, "ttt3").json()
    by_name = api.client.get("/v1/runs/ttt3")
    assert by_name.status_code == 200 and by_name.json()["id"] == first["id"] and "longrun-note" not in by_name.headers
    assert api.client.get(f"/v1/runs/{first['id'][:8]}").json()["id"] == first["id"]
    assert api.client.get(f"/v1/runs/{first['id'][:8]}/metrics").status_code == 200
    # cancelled by name; the events stream, the proposal and the logs find it the same way
    cancelled = api.client.post("/v1/runs/ttt3/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["id"] == first["id"]
    assert cancelled.json()["status"] == "cancelling"
    api.move(first["id"], S.CANCELLED)
    with api.client.stream("GET", "/v1/runs/ttt3/events") as stream:
        assert stream.status_code == 200 and "cancelled" in stream.read().decode()
    assert api.client.get("/v1/runs/ttt3/proposal").status_code == 200
    assert api.client.get("/v1/runs/ttt3/logs").status_code in (200, 404)
    # an id prefix too short to be meant is not one
    assert api.client.get(f"/v1/runs/{first['id'][:3]}").status_code == 404


def test_a_second_submit_of_a_live_name_is_refused_naming_the_live_run_or_suffixed_on_request(api: App) -> None:
    live = post(api, "twin").json()
    again = post(api, "twin")
    assert again.status_code == 409 and again.json()["status"] == "queued"
    detail = again.json()["detail"]
    assert f"a run named 'twin' is live: {live['id']}" in detail
    assert f"longrun watch {live['id']}" in detail and "--name-suffix" in detail
    assert [r["id"] for r in api.client.get("/v1/runs").json()["items"]] == [live["id"]]
    # opted in: the first free NAME-N, and each name still names one run
    second, third = post(api, "twin", name_suffix="true").json(), post(api, "twin", name_suffix="true").json()
    assert (second["name"], third["name"]) == ("twin-2", "twin-3")
    assert second["spec"]["name"] == "twin-2"
    assert api.client.get("/v1/runs/twin").json()["id"] == live["id"]
    assert api.client.get("/v1/runs/twin-2").json()["id"] == second["id"]
    # a name free again once its run has ended
    api.client.post(f"/v1/runs/{live['id']}/cancel")
    api.move(live["id"], S.CANCELLED)
    assert post(api, "twin").status_code == 201


def test_a_name_names_its_live_run_else_the_newest_ended_one_with_a_note(api: App) -> None:
    ended = []
    for _ in range(3):
        run = post(api, "sweep").json()
        api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
        ended.append(run)
    newest = api.client.get("/v1/runs/sweep")
    assert newest.status_code == 200 and newest.json()["id"] == ended[-1]["id"]
    note = newest.headers["longrun-note"]
    assert note.startswith(f"'sweep' names 3 ended runs: this is the newest, {ended[-1]['id']} (failed")
    assert ended[0]["id"] in note and ended[1]["id"] in note
    # every route under the run takes it so, the note included
    restarted = api.client.post("/v1/runs/sweep/restart", json={})
    assert restarted.status_code == 202 and restarted.json()["id"] == ended[-1]["id"]
    assert "newest" in restarted.headers["longrun-note"]
    # now it is live: the name names it, without a note
    live = api.client.get("/v1/runs/sweep")
    assert live.json()["id"] == ended[-1]["id"] and "longrun-note" not in live.headers
    deleted = api.client.delete(f"/v1/runs/{ended[0]['id']}")
    assert deleted.status_code == 204


def test_several_live_runs_of_one_name_from_before_the_rule_are_a_409_listing_them(api: App) -> None:
    first, second = post(api, "old").json(), post(api, "other").json()
    with api.session() as s:  # as stored before names were unique among live runs
        s.get(Run, second["id"]).name = "old"
    ambiguous = api.client.post("/v1/runs/old/cancel")
    assert ambiguous.status_code == 409
    detail = ambiguous.json()["detail"]
    assert "'old' names 2 runs" in detail and first["id"] in detail and second["id"] in detail
