"""Several servers and workers on one PostgreSQL database (docs/reliability.md, "Several servers and workers"):
two `longrun serve --no-worker` and two `longrun worker` processes. Any server answers for any run, a client of
one server sees the events of runs submitted to the other, and kill -9 of the worker driving the runs and then of
the server streaming the events loses no run, no metric and no event."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from server.db import Database
from server.models import Run
from tests.service import Service, kill_leftovers, start_worker, stop_processes, toy_spec

if TYPE_CHECKING:  # psycopg, which tests.postgres imports, is the `postgres` fixture's to import
    from tests.postgres import PostgresCluster

pytestmark = pytest.mark.slow  # two servers, two workers and torchrun jobs

STEPS = 100


class EventReader(threading.Thread):
    """An SSE client of one run: when its server dies, it resumes at the next one with Last-Event-ID."""

    def __init__(self, urls: list[str], run_id: str):
        super().__init__(daemon=True)
        self.urls, self.run_id = list(urls), run_id
        # (id, kind, data, the server that sent it)
        self.events: list[tuple[int, str, dict[str, Any], str]] = []
        self.ended = False

    def run(self) -> None:
        for url in self.urls:
            headers = {"Last-Event-ID": str(self.events[-1][0])} if self.events else {}
            try:
                with httpx.stream("GET", f"{url}/v1/runs/{self.run_id}/events", headers=headers,
                                  timeout=httpx.Timeout(30.0)) as response:
                    response.raise_for_status()
                    self._read(url, response.iter_lines())
                self.ended = True  # the server ended the stream: the run is over and every event was sent
                return
            except httpx.TransportError:
                continue  # that server is gone: resume at the next

    def _read(self, url: str, lines: Any) -> None:
        event: dict[str, str] = {}
        for line in lines:
            if not line:
                if "id" in event:
                    self.events.append((int(event["id"]), event["event"], json.loads(event["data"]), url))
                event = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(": ")
                event[field] = value


def _lease_owner_pid(database_url: str, run_id: str) -> int:
    """The pid of the worker that holds the run (worker ids are <host>-<pid>-<random>)."""
    db = Database(database_url)
    try:
        with db.reading() as s:
            owner = s.get(Run, run_id).lease_owner
    finally:
        db.dispose()
    assert owner, f"run {run_id} is held by no worker"
    return int(owner.rsplit("-", 2)[1])


def _step(svc: Service, run_id: str) -> int:
    return svc.run(run_id)["latest"].get("step") or 0


def test_two_servers_and_two_workers_lose_nothing_when_a_worker_and_a_server_are_killed(
        tmp_path: Path, postgres: PostgresCluster) -> None:
    database_url = postgres.create_database(migrated=False)  # each process migrates as it starts: one at a time
    home = tmp_path / "home"
    home.mkdir()
    first, second = (Service(home, database_url=database_url) for _ in range(2))
    workers: list[subprocess.Popen] = []
    try:
        workers = [start_worker(first, f"worker{n}") for n in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda svc: svc.start(worker=False), (first, second)))
        runs = [first.submit(toy_spec(steps=STEPS, sleep=0.1, nproc=1, name="via-first")),
                second.submit(toy_spec(steps=STEPS, sleep=0.1, nproc=1, name="via-second"))]
        watched = runs[0]["id"]
        reader = EventReader([second.url, first.url], watched)  # a client of the server that did not take it
        reader.start()
        for svc in (first, second):
            assert {r["id"] for r in svc.client.get("/v1/runs").json()["items"]} == {r["id"] for r in runs}
            for run in runs:
                assert svc.run(run["id"])["name"] == run["name"], "any server answers for any run"

        second.wait(watched, lambda r: (r["latest"].get("step") or 0) >= 10, what="ten steps")
        driver = _lease_owner_pid(database_url, watched)
        victim = next(w for w in workers if w.pid == driver)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        at_kill = _step(second, watched)
        second.wait(watched, lambda r: (r["latest"].get("step") or 0) >= at_kill + 10,
                    what="ten more steps, driven by the other worker")
        assert _lease_owner_pid(database_url, watched) != driver

        second.kill()  # the server the reader streams from
        for run in runs:
            done = first.wait_status(run["id"], "succeeded", "failed", timeout=180)
            assert done["status"] == "succeeded" and done["attempt"] == 1, done
            assert [p["step"] for p in first.series(run["id"], "loss")] == list(range(1, STEPS + 1)), \
                "every metric stored once"
            statuses = [e["to"] for e in first.events(run["id"]) if "to" in e]
            assert statuses == ["queued", "launching", "running", "succeeded"]

        reader.join(60)
        assert reader.ended, "the reader's stream ended with the run"
        ids = [e[0] for e in reader.events]
        assert ids == sorted(set(ids)), "no event twice, none out of order"
        stored = first.client.get(f"/v1/runs/{watched}/events").text
        stored_ids = [int(line[4:]) for line in stored.splitlines() if line.startswith("id: ")]
        assert set(stored_ids) <= set(ids), "every stored event reached the reader"
        assert [e[2]["to"] for e in reader.events if e[1] == "status"] == ["queued", "launching", "running", "succeeded"]
        servers = [e[3] for e in reader.events]
        assert servers[0] == second.url and servers[-1] == first.url, "it resumed at the other server"
        assert {e[1] for e in reader.events if e[3] == second.url} >= {"status", "metrics"}
    finally:
        stop_processes(workers)
        for svc in (first, second):
            svc.stop()
        kill_leftovers(first.workspace)
        postgres.drop_database(database_url)
