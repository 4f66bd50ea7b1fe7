"""The token throttle of a real `longrun serve` (uvicorn in front, as users run it): a client's own
X-Forwarded-For neither spreads its failures over invented addresses nor pins them on another client, unless the
operator named the proxy that sends it (LONGRUN_FORWARDED_ALLOW_IPS); a right token is never throttled."""

from pathlib import Path

import httpx
import pytest

from server.api.deps import AUTH_FAILURES
from tests.service import Service

TOKEN = "a-long-right-token"


@pytest.fixture
def guarded(tmp_path: Path):
    svc = Service(tmp_path / "home", token=TOKEN)
    svc.home.mkdir()
    svc.start(worker=False)
    yield svc
    svc.stop()


def get(svc: Service, token: str, forwarded: str) -> int:
    return httpx.get(f"{svc.url}/v1/runs", headers={"Authorization": f"Bearer {token}",
                                                    "X-Forwarded-For": forwarded}, timeout=30).status_code


def test_wrong_tokens_with_invented_forwarded_addresses_are_throttled_as_the_peers(guarded: Service) -> None:
    codes = []
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        for i in range(2000):
            codes.append(client.get("/v1/runs", headers={"Authorization": "Bearer guess",
                                                         "X-Forwarded-For": f"10.{i >> 16}.{i >> 8 & 255}.{i & 255}"}
                                    ).status_code)
    assert codes[:AUTH_FAILURES] == [401] * AUTH_FAILURES
    assert codes[AUTH_FAILURES:] == [429] * (2000 - AUTH_FAILURES), "every guess past the limit is throttled"
    assert get(guarded, TOKEN, "10.0.0.1") == 200, "the right token goes on from the throttled address"


def test_failures_claiming_another_address_do_not_lock_out_its_right_token(guarded: Service) -> None:
    victim = "192.0.2.7"
    assert [get(guarded, "guess", victim) for _ in range(12)][-1] == 429
    assert get(guarded, TOKEN, victim) == 200
    assert get(guarded, TOKEN, "198.51.100.1") == 200


def test_a_named_proxys_forwarded_address_is_the_clients(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", token=TOKEN, forwarded_allow_ips="127.0.0.1")
    svc.home.mkdir()
    svc.start(worker=False)
    try:
        assert [get(svc, "guess", "192.0.2.7") for _ in range(AUTH_FAILURES + 1)][-1] == 429
        assert get(svc, "guess", "192.0.2.8") == 401, "behind the named proxy, each client has its own count"
        refused = httpx.get(f"{svc.url}/v1/runs", headers={"Authorization": "Bearer guess",
                                                            "X-Forwarded-For": "192.0.2.7"}, timeout=30)
        assert "from 192.0.2.7" in refused.json()["detail"]
        assert get(svc, TOKEN, "192.0.2.7") == 200
    finally:
        svc.stop()
