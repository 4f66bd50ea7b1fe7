"""Every route and every error code of the REST contract, in-process: the API without the worker."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from server.lifecycle import RunStatus as S
from server.models import Attempt, Host, LogChunk, MetricPoint, Run, utcnow
from tests.inprocess import App

EVALUATION = {"by_depth": [{"depth": 1, "mean_accepted": 1.8}, {"depth": 2, "mean_accepted": 2.3},
                           {"depth": 3, "mean_accepted": 2.5}],
              "position_acceptance": [0.8, 0.5, 0.2], "conditional_acceptance": [0.8, 0.625, 0.4], "samples": 4}
SNAPSHOT = {"available": True, "message": None,
            "gpus": [{"index": 0, "utilization_pct": 7, "memory_used_mib": 10, "memory_total_mib": 80000,
                      "processes": []}]}


def locs(r: httpx.Response) -> list[list]:
    assert r.status_code == 422, r.text
    return [e["loc"] for e in r.json()["detail"]]


def test_healthz_and_the_openapi_document_list_every_route_with_typed_answers(api: App) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    doc = api.client.get("/openapi.json").json()
    assert set(doc["paths"]) == {
        "/healthz", "/v1/hosts", "/v1/hosts/{name}", "/v1/hosts/{name}/gpus", "/v1/hosts/{name}/interconnect",
        "/v1/hosts/{name}/verifier",
        "/v1/runs", "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/cancel", "/v1/runs/{run_id}/restart", "/v1/runs/{run_id}/metrics",
        "/v1/runs/{run_id}/logs", "/v1/runs/{run_id}/traceback", "/v1/runs/{run_id}/events", "/v1/runs/{run_id}/evaluation",
        "/v1/runs/{run_id}/advice", "/v1/runs/{run_id}/proposal", "/v1/runs/{run_id}/proposal/probe", "/metrics"}

    def answer(path: str) -> str:
        return doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]

    assert answer("/v1/runs/{run_id}/evaluation").endswith("/EvaluationPublic")
    assert answer("/v1/runs/{run_id}/advice").endswith("/RunAdvicePublic")
    assert answer("/v1/runs/{run_id}/proposal").endswith("/ProposalPublic")
    advice = doc["components"]["schemas"]["RunAdvicePublic"]["properties"]
    assert {"attempt", "recommended_depth", "by_depth", "retrain", "cost_model"} <= set(advice)
    assert {"by_depth", "position_acceptance", "by_attempt"} <= set(doc["components"]["schemas"]["EvaluationPublic"]["properties"])


def test_with_a_token_set_every_route_but_healthz_is_a_401_without_it(tmp_path: Path, database_url: str) -> None:
    from server.api.deps import AuthThrottle

    guarded = App(tmp_path / "home", database_url, token="s3cret")
    # every route refused for want of the token, not for the failures before it (the throttle has its own test)
    guarded.app.state.auth_throttle = AuthThrottle(limit=1000)
    try:
        bare = TestClient(guarded.app, base_url="http://127.0.0.1")
        paths = guarded.client.get("/openapi.json").json()["paths"]
        routes = [(method.upper(), path.replace("{run_id}", "x").replace("{name}", "local"))
                  for path, methods in paths.items() if path != "/healthz" for method in methods]
        assert len(routes) == 25  # PATCH and DELETE of a host, DELETE of a run, a rank's traceback, the verifier probe,
        # the proposal's probe
        for method, path in routes:
            r = bare.request(method, path)
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"] == "Bearer" and "LONGRUN_API_TOKEN" in r.json()["detail"]
        assert bare.get("/v1/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert bare.get("/healthz").status_code == 200
        assert guarded.client.get("/v1/runs").status_code == 200
    finally:
        guarded.close()


def test_hosts_register_list_get_and_refuse_a_taken_name(api: App) -> None:
    body = {"name": "box", "address": "10.0.0.5", "username": "me", "workspace": "/srv/lr"}
    r = api.client.post("/v1/hosts", json=body)
    assert r.status_code == 201 and r.json()["reachable"] is None and r.json()["port"] == 22
    again = api.client.post("/v1/hosts", json=body)
    assert again.status_code == 409 and "exists already" in again.json()["detail"]
    assert [h["name"] for h in api.client.get("/v1/hosts").json()] == ["box", "local"]
    assert api.client.get("/v1/hosts/box").json()["workspace"] == "/srv/lr"
    missing = api.client.get("/v1/hosts/nope")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("no host named 'nope': register it with `longrun hosts add nope ")
    assert ["body", "workspace"] in locs(api.client.post("/v1/hosts", json={**body, "name": "b2", "workspace": "srv"}))
    assert ["body", "port"] in locs(api.client.post("/v1/hosts", json={**body, "name": "b3", "port": 0}))
    assert ["body", "name"] in locs(api.client.post("/v1/hosts", json={**body, "name": "bad name"}))


def test_host_gpus_answers_a_fresh_snapshot_at_once_and_503_while_there_is_none(api: App) -> None:
    assert api.client.get("/v1/hosts/nope/gpus").status_code == 404
    started = time.monotonic()
    none = api.client.get("/v1/hosts/local/gpus", params={"wait": 0.5})
    assert none.status_code == 503 and "no GPU snapshot of local yet" in none.json()["detail"]
    assert time.monotonic() - started >= 0.5, "it waited for the worker's answer"
    with api.session() as s:
        host = s.query(Host).filter_by(name="local").one()
        host.gpu_snapshot, host.gpu_snapshot_at, host.gpu_wanted_at = SNAPSHOT, utcnow(), None
    r = api.client.get("/v1/hosts/local/gpus")
    assert r.status_code == 200
    assert r.json()["host"] == "local" and r.json()["gpus"][0]["memory_total_mib"] == 80000
    with api.session() as s:
        assert s.query(Host).filter_by(name="local").one().gpu_wanted_at is None, "fresh: the worker is not asked"
    assert locs(api.client.get("/v1/hosts/local/gpus", params={"wait": 61})) == [["query", "wait"]]


def answer_like_the_worker(api: App, delay: float) -> threading.Thread:
    """What the worker's GPU responder does: see the request, store a snapshot, clear the request."""
    def respond() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with api.session() as s:
                host = s.query(Host).filter_by(name="local").one()
                if host.gpu_wanted_at is not None:
                    time.sleep(delay)
                    host.gpu_snapshot, host.gpu_snapshot_at, host.gpu_wanted_at = SNAPSHOT, utcnow(), None
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=respond)
    thread.start()
    return thread


def test_host_gpus_waits_for_the_workers_answer(api: App) -> None:
    worker = answer_like_the_worker(api, delay=0.5)
    r = api.client.get("/v1/hosts/local/gpus", params={"max_age": 0, "wait": 20})
    worker.join()
    assert r.status_code == 200 and r.json()["sampled_at"] is not None


def test_waiting_gpu_requests_hold_no_thread_so_other_requests_are_answered(api: App) -> None:
    # more waiters than the server's thread pool has threads (40), each waiting up to 60 s for the worker's answer,
    # which comes only once the listing was answered: a handler that held its thread while it waited would hold
    # them all, and the listing would be answered only after the waiters gave up, not before any of them
    def worker_answers() -> None:
        with api.session() as s:
            host = s.query(Host).filter_by(name="local").one()
            if host.gpu_wanted_at is not None:
                host.gpu_snapshot, host.gpu_snapshot_at, host.gpu_wanted_at = SNAPSHOT, utcnow(), None

    def asked() -> bool:
        with api.session() as s:
            return s.query(Host).filter_by(name="local").one().gpu_wanted_at is not None

    async def scenario() -> tuple[list[str], list[int], int]:
        answered: list[str] = []  # who was answered, in order

        async def get(who: str, path: str, **params: float) -> httpx.Response:
            r = await client.get(path, params=params)
            answered.append(who)
            return r

        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as client:
            waiters = [asyncio.create_task(get("waiter", "/v1/hosts/local/gpus", max_age=0, wait=60))
                       for _ in range(60)]
            await asyncio.sleep(1.0)
            while not await asyncio.to_thread(asked):  # the waiters are in
                await asyncio.sleep(0.05)
            listing = await get("listing", "/v1/runs")
            while not all(w.done() for w in waiters):  # then the worker answers (again for a waiter that asks late)
                await asyncio.to_thread(worker_answers)
                await asyncio.sleep(0.05)
            return answered, [w.result().status_code for w in waiters], listing.status_code

    # on a thread of its own: a test before it in this process may leave an event loop running on this one
    # (Playwright's sync API does), where asyncio.run refuses to start
    with ThreadPoolExecutor(1) as pool:
        answered, codes, listing = pool.submit(asyncio.run, scenario()).result()
    assert listing == 200 and answered[0] == "listing", "GET /v1/runs waited behind the GPU waiters"
    assert codes == [200] * 60


def test_submit_answers_201_then_200_for_the_same_idempotency_key_and_409_for_another_body(api: App) -> None:
    spec = {"name": "a", "host": "local", "entrypoint": "/opt/train.py", "nproc_per_node": 2}
    first = api.client.post("/v1/runs", json=spec, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    run = first.json()
    assert run["status"] == "queued" and run["attempt"] == 1 and run["host_reachable"] is True
    assert run["attempts"][0]["spec"]["nproc_per_node"] == 2 and run["progress"] is None
    again = api.client.post("/v1/runs", json=spec, headers={"Idempotency-Key": "k1"})
    assert again.status_code == 200 and again.json()["id"] == run["id"]
    other = api.client.post("/v1/runs", json={**spec, "name": "b"}, headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409 and "different request" in other.json()["detail"]
    assert len(api.client.get("/v1/runs").json()["items"]) == 1


def test_bad_run_specs_are_422s_naming_the_field_and_write_nothing(api: App) -> None:
    spec = {"name": "a", "host": "local", "entrypoint": "/opt/train.py"}
    unknown_host = api.client.post("/v1/runs", json={**spec, "host": "nowhere"})
    assert locs(unknown_host) == [["body", "host"]] and "POST /v1/hosts" in unknown_host.text
    twice = {k: v for k, v in spec.items() if k != "host"} | {"hosts": ["local", "local"]}
    assert locs(api.client.post("/v1/runs", json=twice)) == [["body", "hosts"]]
    assert locs(api.client.post("/v1/runs", json={**spec, "hosts": ["local", "gone"], "host": None})) == [
        ["body", "hosts", 1]]
    assert ["body", "nproc_per_node"] in locs(api.client.post("/v1/runs", json={**spec, "nproc_per_node": 0}))
    assert ["body", "env"] in locs(api.client.post("/v1/runs", json={**spec, "env": {"LONGRUN_X": "1"}}))
    assert ["body", "max_retries"] in locs(api.client.post("/v1/runs", json={**spec, "max_retries": -1}))
    assert api.client.get("/v1/runs").json()["items"] == []


def test_a_run_is_404_when_unknown_on_every_route(api: App) -> None:
    for method, path in [("GET", "/v1/runs/nope"), ("DELETE", "/v1/runs/nope"), ("POST", "/v1/runs/nope/cancel"),
                         ("POST", "/v1/runs/nope/restart"), ("GET", "/v1/runs/nope/metrics"),
                         ("GET", "/v1/runs/nope/logs"), ("GET", "/v1/runs/nope/traceback?rank=1"), ("GET", "/v1/runs/nope/events"),
                         ("GET", "/v1/runs/nope/evaluation"), ("GET", "/v1/runs/nope/advice")]:
        r = api.client.request(method, path)
        assert r.status_code == 404 and r.json() == {
            "detail": "no run with id 'nope' (nor one with that id prefix or name)"}, (method, path)


def test_runs_are_listed_newest_first_in_pages_and_by_status(api: App) -> None:
    ids = [api.submit(name=f"r{i}")["id"] for i in range(5)]
    api.move(ids[0], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    page1 = api.client.get("/v1/runs", params={"limit": 2}).json()
    page2 = api.client.get("/v1/runs", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
    page3 = api.client.get("/v1/runs", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
    assert [r["id"] for r in page1["items"] + page2["items"] + page3["items"]] == ids[::-1]
    assert page3["next_cursor"] is None
    done = api.client.get("/v1/runs", params={"status": "succeeded"}).json()["items"]
    assert [r["id"] for r in done] == [ids[0]] and done[0]["progress"] == 1.0 and done[0]["eta_seconds"] == 0.0
    assert locs(api.client.get("/v1/runs", params={"cursor": "nope"})) == [["body", "cursor"]]
    assert locs(api.client.get("/v1/runs", params={"status": "sleeping"})) == [["query", "status"]]
    assert locs(api.client.get("/v1/runs", params={"limit": 0})) == [["query", "limit"]]


def test_listing_runs_costs_the_same_queries_for_two_runs_or_twenty(api: App) -> None:
    with api.session() as s:  # an earlier measured attempt on this host: queued runs take their ETA from it
        s.add(Run(id="old", name="old", status="succeeded", spec={"host": "local", "entrypoint": "/opt/train.py",
                                                                 "nproc_per_node": 1}, hosts=["local"], latest={}))
        s.add(Attempt(run_id="old", number=1, spec={"host": "local", "entrypoint": "/opt/train.py",
                                                    "nproc_per_node": 1}, token="t", nodes=[], status="succeeded",
                      sec_per_step=0.5, total_steps=100, metrics_lines=0))

    statements: list[str] = []
    event.listen(api.db.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))

    def listing_queries(n: int) -> int:
        while len(api.client.get("/v1/runs", params={"limit": 500}).json()["items"]) < n + 1:
            api.submit(name=f"q{len(statements)}")
        statements.clear()
        items = api.client.get("/v1/runs", params={"limit": 500}).json()["items"]
        assert all(r["eta_seconds"] == pytest.approx(50.0) for r in items if r["status"] == "queued")
        return len(statements)

    assert listing_queries(2) == listing_queries(20)


def test_cancel_is_202_then_409_naming_the_state(api: App) -> None:
    run = api.submit()
    r = api.client.post(f"/v1/runs/{run['id']}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelling"
    again = api.client.post(f"/v1/runs/{run['id']}/cancel")
    assert again.status_code == 409
    assert again.json() == {"detail": f"run {run['id']} is cancelling: only a queued, launching or running run "
                                      "can be cancelled", "status": "cancelling"}


def test_restart_dry_run_predicts_and_changes_nothing_then_restart_opens_attempt_two(api: App) -> None:
    run = api.submit(args=["--steps", "10"], output_dir=str(api.workspace / "out"))
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    dry = api.client.post(f"/v1/runs/{run['id']}/restart", params={"dry_run": True},
                          json={"overrides": {"args": ["--steps", "20"]}})
    assert dry.status_code == 200
    assert dry.json()["dry_run"] is True and dry.json()["new_spec"]["args"] == ["--steps", "20"]
    assert dry.json()["predicted_duration_seconds"] is None and "no step has been measured" in dry.json()["basis"]
    assert api.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1
    r = api.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": ["--steps", "20"]},
                                                                "clean": True})
    assert r.status_code == 202
    assert r.json()["status"] == "restarting" and r.json()["attempt"] == 2
    assert r.json()["attempts"][1]["spec"]["args"] == ["--steps", "20"]
    busy = api.client.post(f"/v1/runs/{run['id']}/restart")
    assert busy.status_code == 409 and busy.json()["status"] == "restarting"
    busy_dry = api.client.post(f"/v1/runs/{run['id']}/restart", params={"dry_run": True})
    assert busy_dry.status_code == 409


def test_bad_restarts_are_422s_naming_the_override_and_change_nothing(api: App, tmp_path: Path) -> None:
    run = api.submit(output_dir=str(tmp_path / "outside"))
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    path = f"/v1/runs/{run['id']}/restart"
    unknown = api.client.post(path, json={"overrides": {"colour": "red"}})
    assert locs(unknown) == [["body", "overrides", "colour"]] and "allowed: args" in unknown.text
    assert locs(api.client.post(path, json={"overrides": {"ttt_steps": 5}})) == [["body", "overrides", "ttt_steps"]]
    assert locs(api.client.post(path, json={"overrides": {"nproc_per_node": 0}})) == [
        ["body", "overrides", "nproc_per_node"]]
    assert locs(api.client.post(path, json={"init_from_last": True})) == [["body", "init_from_last"]]
    outside = api.client.post(path, json={"clean": True})
    assert locs(outside) == [["body", "clean"]] and "outside the workspace" in outside.text
    assert locs(api.client.post(path, json={"cleen": True})) == [["body", "cleen"]]
    after = api.client.get(f"/v1/runs/{run['id']}").json()
    assert after["status"] == "failed" and after["attempt"] == 1


def test_trainer_overrides_name_the_trainer_field(api: App) -> None:
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o"}
    r = api.client.post("/v1/runs", json={"name": "t", "host": "local", "trainer": trainer})
    assert r.status_code == 201
    api.move(r.json()["id"], S.CANCELLING, S.CANCELLED)
    bad = api.client.post(f"/v1/runs/{r.json()['id']}/restart", params={"dry_run": True},
                          json={"overrides": {"ttt_steps": 0}})
    assert locs(bad) == [["body", "overrides", "ttt_steps"]]
    good = api.client.post(f"/v1/runs/{r.json()['id']}/restart", params={"dry_run": True},
                           json={"overrides": {"ttt_steps": 5}})
    assert good.status_code == 200 and good.json()["new_spec"]["trainer"]["ttt_steps"] == 5


def add_metrics(api: App, run_id: str) -> None:
    with api.session() as s:
        for step in range(1, 6):
            for name, value in (("loss", 1.0 / step), ("acc_0", step / 10)):
                s.add(MetricPoint(run_id=run_id, attempt=1, line=step, name=name, step=step, value=value,
                                  time=utcnow()))
        s.add(LogChunk(run_id=run_id, attempt=1, node=0, offset=0, end=18, text="one\ntwo\nthree\nfour\n"))


def test_metrics_series_filter_by_name_attempt_and_step(api: App) -> None:
    run = api.submit()
    add_metrics(api, run["id"])
    series = api.client.get(f"/v1/runs/{run['id']}/metrics").json()["series"]
    assert set(series) == {"loss", "acc_0"} and [p["step"] for p in series["loss"]] == [1, 2, 3, 4, 5]
    assert set(series["loss"][0]) == {"attempt", "step", "value", "time"}
    some = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"names": "loss", "since_step": 3}).json()
    assert [p["value"] for p in some["series"]["loss"]] == [0.25, 0.2] and "acc_0" not in some["series"]
    assert api.client.get(f"/v1/runs/{run['id']}/metrics", params={"attempt": 2}).json() == {"series": {}, "next_cursor": None}
    assert locs(api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 0})) == [["query", "limit"]]


def test_logs_tail_follow_and_unknown_attempt(api: App) -> None:
    run = api.submit()
    add_metrics(api, run["id"])
    page = api.client.get(f"/v1/runs/{run['id']}/logs", params={"tail": 2}).json()
    assert page["lines"] == ["three", "four"] and page["attempt"] == 1 and page["next_offset"] == 18
    rest = api.client.get(f"/v1/runs/{run['id']}/logs", params={"since_offset": 18}).json()
    assert rest["lines"] == [] and rest["next_offset"] == 18
    none = api.client.get(f"/v1/runs/{run['id']}/logs", params={"attempt": 3})
    assert none.status_code == 404 and none.json()["detail"] == f"run {run['id']} has no attempt 3"
    assert locs(api.client.get(f"/v1/runs/{run['id']}/logs", params={"tail": -1})) == [["query", "tail"]]


def test_a_failed_ranks_traceback_is_found_in_the_log_of_the_node_it_ran_on(api: App) -> None:
    run = api.submit()
    add_metrics(api, run["id"])
    url = f"/v1/runs/{run['id']}/traceback"
    none = api.client.get(url, params={"rank": 1})
    assert none.status_code == 404 and "no failure summary of torchrun in its log" in none.json()["detail"]
    summary = ("Failures:\n  <NO_OTHER_FAILURES>\n------\nRoot Cause (first observed failure):\n[0]:\n"
               "  rank      : 3 (local_rank: 1)\n  exitcode  : 1 (pid: 9)\n"
               "  traceback : Traceback (most recent call last):\n    File \"t.py\", line 1\n  OSError: gone\n"
               "======\n")
    with api.session() as s:
        s.add(LogChunk(run_id=run["id"], attempt=1, node=1, offset=0, end=len(summary), text=summary))
    assert api.client.get(url, params={"rank": 3}).json() == {
        "attempt": 1, "node": 1, "rank": 3, "root_cause": True,
        "traceback": 'Traceback (most recent call last):\n  File "t.py", line 1\nOSError: gone'}
    other = api.client.get(url, params={"rank": 1})
    assert other.status_code == 404 and other.json()["detail"].endswith("failed: rank 3")
    assert locs(api.client.get(url)) == [["query", "rank"]]


def test_events_replay_the_stored_status_changes_and_end_with_the_run(api: App) -> None:
    run = api.submit()
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    with api.client.stream("GET", f"/v1/runs/{run['id']}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [d["to"] for d in data] == ["queued", "launching", "running", "succeeded"]
    with api.client.stream("GET", f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": "2"}) as r:
        resumed = [json.loads(line[6:])["to"] for line in r.iter_lines() if line.startswith("data: ")]
    assert resumed == ["running", "succeeded"]


def evaluated_run(api: App, evaluation: dict, ttt_steps: int = 1) -> str:
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o",
               "ttt_steps": ttt_steps}
    r = api.client.post("/v1/runs", json={"name": "t", "host": "local", "trainer": trainer},
                        params={"name_suffix": "true"})
    with api.session() as s:
        attempt = s.query(Attempt).filter_by(run_id=r.json()["id"]).one()
        attempt.evaluation = evaluation
    return r.json()["id"]


def test_evaluation_is_404_until_reported_then_typed_per_attempt(api: App) -> None:
    plain = api.submit()
    missing = api.client.get(f"/v1/runs/{plain['id']}/evaluation")
    assert missing.status_code == 404 and "has no evaluation yet" in missing.json()["detail"]
    run_id = evaluated_run(api, EVALUATION)
    report = api.client.get(f"/v1/runs/{run_id}/evaluation").json()
    assert report["attempt"] == 1 and report["ttt_steps"] == 1 and report["samples"] == 4
    assert report["position_acceptance"] == [0.8, 0.5, 0.2]
    assert report["by_depth"][0] == {"depth": 1, "mean_accepted": 1.8, "measured_accepted": None,
                                     "verifier_passes": None}
    assert [r["attempt"] for r in report["by_attempt"]] == [1]


def test_advice_for_an_evaluated_run_and_its_errors(api: App) -> None:
    run_id = evaluated_run(api, EVALUATION)
    advice = api.client.get(f"/v1/runs/{run_id}/advice", params={"interconnect": "pcie", "tp": 8}).json()
    assert advice["attempt"] == 1 and advice["interconnect"] == "pcie" and advice["tp"] == 8
    assert [row["depth"] for row in advice["by_depth"]] == [1, 2, 3]
    assert advice["recommended_depth"] in (0, 1, 2, 3) and advice["retrain"]["trained_ttt"] == 1
    assert advice["cost_model"]["allreduce_us"][0][0] == 1024
    plain = api.submit()
    assert api.client.get(f"/v1/runs/{plain['id']}/advice").status_code == 404
    assert api.client.get(f"/v1/runs/{run_id}/advice", params={"attempt": 2}).status_code == 404
    assert locs(api.client.get(f"/v1/runs/{run_id}/advice", params={"interconnect": "ib"})) == [
        ["query", "interconnect"]]
    assert locs(api.client.get(f"/v1/runs/{run_id}/advice", params={"tp": 0})) == [["query", "tp"]]
    rising = evaluated_run(api, {"position_acceptance": [0.5, 0.7]})
    refused = api.client.get(f"/v1/runs/{rising}/advice")
    assert refused.status_code == 409 and "must not increase" in refused.json()["detail"]


def test_advice_prices_the_draft_the_way_the_engine_given_runs_it(api: App) -> None:
    run_id = evaluated_run(api, EVALUATION)
    url = f"/v1/runs/{run_id}/advice"
    base = {"interconnect": "pcie", "tp": 8}
    plain = api.client.get(url, params=base).json()
    assert plain["drafting"] is None and all(row["terms"] is None for row in plain["by_depth"])
    sglang = api.client.get(url, params={**base, "engine": "sglang"}).json()
    vllm = api.client.get(url, params={**base, "engine": "vllm"}).json()
    assert sglang["drafting"]["engine"] == "sglang" and sglang["drafting"]["sharded"]
    # vLLM V1 builds the draft with the target's config: sharded at its tp, as SGLang's
    assert vllm["drafting"]["engine"] == "vllm" and vllm["drafting"]["sharded"]
    for advice in (sglang, vllm):
        for row in advice["by_depth"]:
            t = row["terms"]
            assert t["round_ms"] == pytest.approx(t["verifier_ms"] + t["verifier_allreduce_ms"]
                                                  + t["draft_compute_ms"] + t["draft_allreduce_ms"])
            assert row["round_ms"] == pytest.approx(t["round_ms"])
    # a sharded draft pays its collectives per forward (3 all-reduces and the logits all-gather)
    assert [row["terms"]["draft_allreduces"] for row in sglang["by_depth"]] == [4, 8, 12]
    assert [row["terms"]["draft_allreduces"] for row in vllm["by_depth"]] == [4, 8, 12]
    # a draft_tp of 1 changes nothing on V1 (vllm#17499): the rounds cost what SGLang's do
    vllm_tp = api.client.get(url, params={**base, "engine": "vllm", "draft_tp": 1}).json()
    # priced as SGLang shards it, less the EAGLE-3 fc SGLang replicates (read whole once a round)
    assert [r["round_ms"] for r in vllm_tp["by_depth"]] == pytest.approx([r["round_ms"] for r in sglang["by_depth"]],
                                                                         rel=0.01)
    # measured: the rounds as timed, only the depths timed
    timed = api.client.get(url, params={**base, "engine": "measured", "round_ms": ["0=20", "1=21.5", "3=24"]}).json()
    assert [(r["depth"], r["round_ms"]) for r in timed["by_depth"]] == [(1, 21.5), (3, 24.0)]
    assert timed["no_speculation"]["round_ms"] == 20.0
    assert timed["by_depth"][1]["tokens_per_second"] == pytest.approx(1000 * (1 + 0.8 + 0.5 + 0.2) / 24)
    # a bad value is a 422 naming the parameter
    assert locs(api.client.get(url, params={"engine": "tensorrt"})) == [["query", "engine"]]
    assert locs(api.client.get(url, params={"engine": "measured"})) == [["query", "round_ms"]]
    assert locs(api.client.get(url, params={"engine": "sglang", "round_ms": "1=3"})) == [["query", "round_ms"]]
    assert locs(api.client.get(url, params={"engine": "measured", "round_ms": "one=3"})) == [["query", "round_ms"]]
    assert locs(api.client.get(url, params={"engine": "measured", "round_ms": "1=0"})) == [["query", "round_ms"]]
    assert locs(api.client.get(url, params={"engine": "sglang", "draft_tp": 1})) == [["query", "draft_tp"]]
    odd = api.client.get(url, params={**base, "engine": "vllm", "draft_tp": 3})
    assert locs(odd) == [["query", "draft_tp"]] and "1 or the target's tp (8)" in odd.json()["detail"][0]["msg"]
    assert locs(api.client.get(url, params={"topk": 2})) == [["query", "topk"]]
    assert locs(api.client.get(url, params={"engine": "sglang", "topk": 0})) == [["query", "topk"]]


def test_a_report_of_another_shape_is_a_409_saying_where(api: App) -> None:
    odd = evaluated_run(api, {"position_acceptance": ["high", "low"]})
    for path in ("evaluation", "advice"):
        r = api.client.get(f"/v1/runs/{odd}/{path}")
        assert r.status_code == 409 and "position_acceptance.0" in r.json()["detail"], path
