"""Cross-site request forgery and the page's security headers (docs/reliability.md, "a page of another site"):
a page elsewhere cannot cancel or restart a run through the user's browser, whatever it sends, while the
CLI's client and the page itself go on working; every answer carries the security headers."""

import pytest

from longrun.client import Client
from server.lifecycle import RunStatus as S
from tests.inprocess import App

EVIL = "http://evil.example"


def _status(api: App, run_id: str) -> str:
    return api.client.get(f"/v1/runs/{run_id}").json()["status"]


@pytest.mark.parametrize("headers", [
    {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},  # a no-cors fetch from a modern browser
    {"Origin": "http://127.0.0.1:3000", "Sec-Fetch-Site": "same-site"},  # another port of this machine
    {"Origin": EVIL},  # a browser that does not send Sec-Fetch-*
    {"Origin": "null"},  # a sandboxed frame or a file
])
def test_a_page_of_another_origin_cannot_cancel_a_run(api: App, headers: dict[str, str]) -> None:
    run = api.submit()
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    r = api.client.post(f"/v1/runs/{run['id']}/cancel", headers=headers)
    assert r.status_code == 403, r.text
    assert "another" in r.json()["detail"]
    assert _status(api, run["id"]) == "running"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_a_form_or_text_body_cannot_restart_a_run(api: App, content_type: str) -> None:
    """What a form posts (the empty form that restarted a run), sent without Origin as an old browser might."""
    run = api.submit()
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    r = api.client.post(f"/v1/runs/{run['id']}/restart", content=b"", headers={"Content-Type": content_type})
    assert r.status_code == 415, r.text
    after = api.client.get(f"/v1/runs/{run['id']}").json()
    assert (after["status"], after["attempt"]) == ("running", 1)
    submitted = api.client.post("/v1/runs", content=b"name=x&host=local", headers={"Content-Type": content_type})
    assert submitted.status_code == 415
    assert api.client.get("/v1/runs").json()["items"] == [after]


def test_the_page_and_the_cli_client_still_act(api: App) -> None:
    first, second = api.submit(), api.submit()
    for run in (first, second):
        api.move(run["id"], S.LAUNCHING, S.RUNNING)
    # the page: a fetch of its own origin, a cancel without a body and a restart with a JSON one
    page = {"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
    assert api.client.post(f"/v1/runs/{first['id']}/cancel", headers=page).status_code == 202
    dry = api.client.post(f"/v1/runs/{second['id']}/restart", params={"dry_run": "true"}, json={}, headers=page)
    assert dry.status_code == 200, dry.text
    # a browser that sends Origin but no Sec-Fetch-*: its own origin is fine
    restart = api.client.post(f"/v1/runs/{second['id']}/restart", json={}, headers={"Origin": "http://127.0.0.1"})
    assert restart.status_code == 202, restart.text
    # the CLI's client sends neither header, and its cancel no body
    third = api.submit()
    with Client(api.client.base_url, http=api.client) as client:
        assert client.cancel(third["id"])["status"] == "cancelling"
    assert _status(api, first["id"]) == "cancelling"


@pytest.mark.parametrize("path", ["/", "/web/app.js", "/v1/runs", "/v1/runs/nope", "/healthz"])
def test_every_answer_carries_the_security_headers(api: App, path: str) -> None:
    r = api.client.get(path)
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_a_refused_host_header_carries_them_too(api: App) -> None:
    r = api.client.get("/", headers={"Host": "evil.example"})
    assert r.status_code == 400
    assert r.headers["x-frame-options"] == "DENY"
