"""100 clients at once against a real `longrun serve` on SQLite while a run writes metrics (docs/reliability.md,
"100 concurrent clients"): every answer is a 2xx or a 4xx the request asked for, never a 5xx, and neither an
answer nor the server's log says "database is locked".

A correctness test, not a timing: a bounded number of requests (CLIENTS x ROUNDS), each client mixing what
watchers, the page and the CLI send: reads of the run, its list, metrics and logs, a restart dry run, and
writes that take the write lock (a repeated submit under one Idempotency-Key, a cancel of a run already over).
"""

import threading
import time
from collections import Counter

import httpx
import pytest

from tests.service import Service, kill_leftovers, toy_spec

pytestmark = pytest.mark.sqlite_only

CLIENTS = 100
ROUNDS = 2  # 1,200 requests, a hundred at a time


def _requests(client: httpx.Client, index: int, running: str, ended: str, key: str) -> list[httpx.Response]:
    """One client's round: four reads, a dry run, and a write."""
    answers = [
        client.get(f"/v1/runs/{running}"),
        client.get("/v1/runs", params={"limit": 20}),
        client.get(f"/v1/runs/{running}/metrics", params={"names": "loss", "limit": 500}),
        client.get(f"/v1/runs/{running}/logs", params={"tail": 5}),
        client.post(f"/v1/runs/{ended}/restart", params={"dry_run": "true"}, json={"overrides": {}}),
    ]
    if index % 2:
        answers.append(client.post("/v1/runs", json=toy_spec(steps=1, sleep=0, nproc=1, name="load"),
                                   headers={"Idempotency-Key": key}))
    else:
        answers.append(client.post(f"/v1/runs/{ended}/cancel"))
    return answers


def test_a_hundred_clients_with_ingest_running_get_no_5xx_and_no_database_is_locked(service: Service) -> None:
    # the run whose metrics are ingested while the clients hammer the server, and one that ends first
    running = service.submit(toy_spec(steps=100_000, sleep=0.01, nproc=1))["id"]
    key = "load-test-submit"
    ended = service.submit(toy_spec(steps=1, sleep=0, nproc=1, name="load"), headers={"Idempotency-Key": key})["id"]
    service.wait_status(ended, "succeeded", timeout=120)
    service.wait(running, lambda r: (r["latest"].get("step") or 0) > 10, timeout=120, what="steps stored")
    step_before = service.run(running)["latest"]["step"]
    started = time.monotonic()

    statuses: Counter[int] = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client_thread(index: int) -> None:
        with httpx.Client(base_url=service.url, timeout=120) as client:  # a correctness test, not a timing
            start.wait()
            for _ in range(ROUNDS):
                try:
                    answers = _requests(client, index, running, ended, key)
                except httpx.HTTPError as exc:
                    with lock:
                        failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    for r in answers:
                        statuses[r.status_code] += 1
                        if r.status_code >= 500 or "database is locked" in r.text:
                            failures.append(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = service.run(running)
    finally:
        service.client.post(f"/v1/runs/{running}/cancel")
        kill_leftovers(service.workspace)

    total = sum(statuses.values())
    print(f"{total} requests from {CLIENTS} clients in {time.monotonic() - started:.1f}s: {dict(statuses)}")
    assert total == CLIENTS * ROUNDS * 6, (statuses, failures[:5])
    assert not failures, f"{len(failures)} of {total} failed, e.g. {failures[:5]}; statuses {dict(statuses)}"
    # every answer is one the request asked for: 200/202 for reads, dry runs and repeats, 409 for the cancel
    assert set(statuses) <= {200, 409}, statuses
    log = (service.home / "server.log").read_text()
    assert "database is locked" not in log
    assert "Traceback" not in log, log[-3000:]
    # ingest went on meanwhile
    assert after["latest"]["step"] > step_before
