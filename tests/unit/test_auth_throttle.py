"""Token guessing with LONGRUN_API_TOKEN set: an address that keeps failing is answered 429 with Retry-After
until its failures age out, but a right token from it is never refused; other addresses are not held up; the
failures are logged, a line at a time however many come."""

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.api.deps import AUTH_FAILURES, AUTH_WINDOW_SECONDS
from tests.inprocess import App

TOKEN = "s3cret-token"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def guarded(tmp_path: Path, database_url: str):
    app = App(tmp_path / "home", database_url, token=TOKEN)
    clock = Clock()
    app.app.state.auth_throttle.clock = clock
    yield app, clock
    app.close()


def client(app: App, address: str, token: str | None) -> TestClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(app.app, base_url="http://127.0.0.1", headers=headers, client=(address, 40000))


def test_an_address_that_keeps_failing_is_throttled_with_retry_after_then_let_in_again(guarded) -> None:
    app, clock = guarded
    guesser, right = client(app, "10.0.0.66", "guess"), client(app, "10.0.0.66", TOKEN)
    for _ in range(AUTH_FAILURES):
        assert guesser.get("/v1/runs").status_code == 401
        clock.now += 1
    refused = guesser.get("/v1/runs")
    assert refused.status_code == 429, refused.text
    wait = int(refused.headers["Retry-After"])
    assert AUTH_WINDOW_SECONDS - AUTH_FAILURES <= wait <= AUTH_WINDOW_SECONDS
    assert "too many failed authentications" in refused.json()["detail"]
    # a right token is never refused: whoever else shares the address is not locked out by the guesser
    assert right.get("/v1/runs").status_code == 200
    assert guesser.get("/openapi.json").status_code == 429
    assert client(app, "10.0.0.7", TOKEN).get("/v1/runs").status_code == 200, "another address goes on"
    assert client(app, "10.0.0.66", None).get("/healthz").status_code == 200, "health needs no token"
    clock.now = 1000 + AUTH_WINDOW_SECONDS + 0.5  # the first failure aged out (refusals added none), the rest not
    assert guesser.get("/v1/runs").status_code == 401
    assert guesser.get("/v1/runs").status_code == 429, "the next failure within the window throttles again"


def test_a_flood_of_wrong_tokens_is_logged_a_line_at_a_time(guarded, caplog) -> None:
    app, clock = guarded
    caplog.set_level(logging.WARNING, logger="longrun.api")
    guessers = [client(app, f"10.0.1.{i}", "guess") for i in range(4)]
    statuses = []
    for n in range(720):  # 720 wrong tokens at 24/s from 4 addresses: 30 s
        statuses.append(guessers[n % 4].get("/v1/hosts").status_code)
        clock.now += 1 / 24
    assert statuses.count(401) == 4 * AUTH_FAILURES and statuses.count(429) == 720 - 4 * AUTH_FAILURES
    lines = [r.getMessage() for r in caplog.records if r.name == "longrun.api"]
    assert 1 <= len(lines) <= 4, lines  # the first at once, then at most one every 10 s
    assert "10.0.1.0" in lines[0] and "failed authentication" in lines[0]
    clock.now += 11
    guessers[0].get("/v1/hosts")
    last = caplog.records[-1].getMessage()
    assert "request(s) refused while throttled" in last and "4 address(es) throttled" in last, last
