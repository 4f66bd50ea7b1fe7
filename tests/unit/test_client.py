"""The Python client against the API in this process (no worker): answers, typed errors, watching."""

import socket

import pytest

from longrun import Client, Conflict, InvalidRequest, NotFound, ServerUnreachable, Unauthorized, Unavailable
from server.lifecycle import RunStatus as S
from server.models import Attempt, MetricPoint, utcnow
from tests.inprocess import App

SPEC = {"name": "toy", "host": "local", "entrypoint": "/opt/train.py", "args": ["--steps", "10"]}
TRAINER = {"name": "t", "host": "local", "trainer": {"verifier_path": "/m/v", "data_dir": "/d",
                                                     "vocab_mapping_dir": "/v", "output_dir": "/o", "ttt_steps": 3}}


@pytest.fixture
def client(api: App) -> Client:
    return Client(api.client.base_url, http=api.client)


def test_submit_get_list_cancel(client: Client) -> None:
    run = client.submit(SPEC)
    assert client.get(run["id"])["status"] == "queued"
    keyed = {**SPEC, "name": "keyed"}
    assert client.submit(keyed, idempotency_key="k")["id"] == client.submit(keyed, idempotency_key="k")["id"]
    page = client.list(limit=1)
    assert len(page["items"]) == 1 and page["next_cursor"] is not None
    assert len(client.list(cursor=page["next_cursor"])["items"]) == 1
    assert [r["id"] for r in client.list(status="cancelling")["items"]] == []
    assert client.cancel(run["id"])["status"] == "cancelling"
    assert [r["id"] for r in client.list(status="cancelling")["items"]] == [run["id"]]
    # a name is unique among live runs: refused naming the live one, or suffixed when asked
    with pytest.raises(Conflict, match="a run named 'keyed' is live: ") as taken:
        client.submit(keyed)
    assert taken.value.status == "queued"
    assert client.submit(keyed, name_suffix=True)["name"] == "keyed-2"


def test_restart_takes_overrides_as_keywords(api: App, client: Client) -> None:
    run = client.submit(TRAINER)
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    dry = client.restart(run["id"], ttt_steps=5, dry_run=True)
    assert dry["dry_run"] is True and dry["new_spec"]["trainer"]["ttt_steps"] == 5
    assert client.get(run["id"])["attempt"] == 1
    restarted = client.restart(run["id"], {"epochs": 2}, ttt_steps=5)
    assert restarted["attempt"] == 2 and restarted["spec"]["trainer"]["epochs"] == 2
    assert restarted["spec"]["trainer"]["ttt_steps"] == 5


def test_refusals_are_typed_and_carry_the_servers_message(api: App, client: Client) -> None:
    with pytest.raises(NotFound, match="no run with id 'nope'") as missing:
        client.get("nope")
    assert missing.value.status_code == 404
    with pytest.raises(InvalidRequest) as invalid:
        client.submit({**SPEC, "nproc_per_node": 0})
    assert invalid.value.errors[0]["loc"] == ["body", "nproc_per_node"]
    assert str(invalid.value).startswith("422 nproc_per_node: ")
    run = client.submit(SPEC)
    client.cancel(run["id"])
    with pytest.raises(Conflict, match="only a queued, launching or running run") as conflict:
        client.cancel(run["id"])
    assert conflict.value.status == "cancelling"
    with pytest.raises(InvalidRequest, match="overrides.colour: unknown override"):
        client.restart(run["id"], colour="red")
    with pytest.raises(Unavailable, match="no GPU snapshot of local yet"):
        client.host_gpus("local", wait=0)
    with pytest.raises(Unauthorized, match="LONGRUN_API_TOKEN"):
        api.settings.api_token = "s3cret"
        client.hosts()


def test_a_server_that_is_not_there_is_named_with_what_to_do() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}") as nobody, pytest.raises(ServerUnreachable, match="longrun serve"):
        nobody.get("x")


def test_watch_yields_snapshots_until_the_run_ends(api: App) -> None:
    with api.serving() as url:  # a real server: the watch follows its event stream as it is written
        client = Client(url)
        run = client.submit(SPEC)
        seen = []
        for snapshot in client.watch(run["id"], interval=0.05):
            seen.append(snapshot["status"])
            if seen == ["queued"]:  # the run moves on only once the watcher has seen where it was
                api.move(run["id"], S.LAUNCHING, S.RUNNING)
            elif snapshot["status"] == "running":
                api.move(run["id"], S.SUCCEEDED)
    assert seen == ["queued", "running", "succeeded"]


def test_events_stream_the_status_changes(api: App, client: Client) -> None:
    run = client.submit(SPEC)
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    events = list(client.events(run["id"]))
    assert [e.data["to"] for e in events] == ["queued", "launching", "running", "failed"]
    assert all(e.kind == "status" for e in events) and events[0].id < events[-1].id
    assert [e.data["to"] for e in client.events(run["id"], last_event_id=events[1].id)] == ["running", "failed"]
    with pytest.raises(NotFound):
        list(client.events("nope"))


def test_metrics_logs_evaluation_advice_and_hosts(api: App, client: Client) -> None:
    run = client.submit(TRAINER)
    with api.session() as s:
        for step in (1, 2, 3):
            s.add(MetricPoint(run_id=run["id"], attempt=1, line=step, name="loss", step=step, value=1 / step,
                              time=utcnow()))
        s.query(Attempt).filter_by(run_id=run["id"]).one().evaluation = {
            "by_depth": [{"depth": 1, "mean_accepted": 1.7}], "position_acceptance": [0.7, 0.5, 0.3, 0.2]}
    assert [p["step"] for p in client.metrics(run["id"], names=["loss"], since_step=1)["loss"]] == [2, 3]
    assert client.logs(run["id"], tail=5) == {"attempt": 1, "log_path": None, "lines": [], "next_offset": 0,
                                              "more": False, "dropped_bytes": 0}
    assert client.evaluation(run["id"])["by_depth"][0]["mean_accepted"] == 1.7
    advice = client.advice(run["id"], interconnect="pcie", tp=4)
    assert advice["tp"] == 4 and advice["retrain"]["trained_ttt"] == 3
    added = client.add_host("box", "10.0.0.9", "/srv/lr", username="me", key_path=None)
    assert added["username"] == "me"
    assert [h["name"] for h in client.hosts()] == ["box", "local"] and client.host("box")["port"] == 22
    assert client.health()
