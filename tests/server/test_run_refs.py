"""A run is named by its id, a unique prefix of it or its unique name on every route; an ambiguous one is a 409
listing the candidates: in-process, the API without the worker."""

from server.lifecycle import RunStatus as S
from tests.inprocess import App


def test_a_run_is_named_by_a_unique_id_prefix_or_name_and_an_ambiguous_one_lists_the_candidates(api: App) -> None:
    first, second = api.submit(name="ttt3"), api.submit(name="twin")
    third = api.submit(name="twin")
    by_name = api.client.get("/v1/runs/ttt3")
    assert by_name.status_code == 200 and by_name.json()["id"] == first["id"]
    assert api.client.get(f"/v1/runs/{first['id'][:8]}").json()["id"] == first["id"]
    assert api.client.get(f"/v1/runs/{first['id'][:8]}/metrics").status_code == 200
    ambiguous = api.client.post("/v1/runs/twin/cancel")
    assert ambiguous.status_code == 409
    detail = ambiguous.json()["detail"]
    assert "'twin' names 2 runs" in detail and second["id"] in detail and third["id"] in detail
    assert [r["status"] for r in api.client.get("/v1/runs").json()["items"]] == ["queued"] * 3
    # cancelled by name; the events stream and the logs find it the same way
    cancelled = api.client.post("/v1/runs/ttt3/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["id"] == first["id"]
    assert cancelled.json()["status"] == "cancelling"
    api.move(first["id"], S.CANCELLED)
    with api.client.stream("GET", "/v1/runs/ttt3/events") as stream:
        assert stream.status_code == 200 and "cancelled" in stream.read().decode()
    assert api.client.get("/v1/runs/ttt3/logs").status_code in (200, 404)
    # an id prefix too short to be meant is not one
    assert api.client.get(f"/v1/runs/{first['id'][:3]}").status_code == 404
