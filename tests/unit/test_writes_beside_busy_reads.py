"""A write is answered while every thread of the API's pool is busy with reads: the API's writes run one after
another on a writer thread of their own, never in line for a pool thread behind queued reads (before: each write
took up to four hops to the pool, each waiting behind every queued read while the write line was held; at 100
clients on two cores the writes' p99 was 5 s, 60 s and 94 client timeouts on a slower box)."""

import threading

import httpx
import pytest

from server import queries
from server.config import API_THREADS
from server.lifecycle import RunStatus
from tests.inprocess import App

pytestmark = pytest.mark.sqlite_only


def test_a_cancel_is_answered_while_every_pool_thread_is_held_by_a_read(api: App,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = api.submit()
    api.move(run["id"], RunStatus.LAUNCHING, RunStatus.RUNNING)
    release, held = threading.Event(), threading.Semaphore(0)
    listing = queries.list_runs

    def stuck(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        held.release()
        release.wait(120)
        return listing(*args, **kwargs)

    monkeypatch.setattr(queries, "list_runs", stuck)
    with api.serving() as url:
        readers = [threading.Thread(target=lambda: httpx.get(f"{url}/v1/runs", timeout=300))
                   for _ in range(API_THREADS + 10)]
        try:
            for t in readers:
                t.start()
            for _ in range(API_THREADS):  # every thread of the pool holds a read
                assert held.acquire(timeout=120)
            cancel = httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=60)
            assert cancel.status_code == 202, cancel.text
            assert cancel.json()["status"] == "cancelling"
            repeat = httpx.post(f"{url}/v1/runs/{run['id'][:6]}/cancel", timeout=60)  # a prefix resolves too
            assert repeat.status_code == 409 and repeat.json()["status"] == "cancelling", repeat.text
        finally:
            release.set()
            for t in readers:
                t.join(120)
