"""Inputs that answered 500: a lone surrogate in a string field (FastAPI's own 422 echoed it and failed to encode
it), a workspace whose real path the server may not read. Each is a 422 naming the field."""

import json

import pytest

from tests.inprocess import App

RUN = {"name": "toy", "host": "local", "entrypoint": "/opt/train.py"}
HOST = {"name": "box", "address": "10.0.0.9", "workspace": "/srv/ws"}


def send(api: App, method: str, path: str, body: object):
    # json.dumps writes a lone surrogate as the escape "\ud800", which is valid JSON
    return api.client.request(method, path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(("method", "path", "body", "loc"), [
    ("POST", "/v1/runs", {**RUN, "name": "\ud800"}, ["body", "name"]),
    ("POST", "/v1/runs", {**RUN, "entrypoint": "/opt/\udfff.py"}, ["body", "entrypoint"]),
    ("POST", "/v1/runs", {**RUN, "args": ["--x", "\ud800"]}, ["body", "args"]),
    ("POST", "/v1/runs", {**RUN, "env": {"A": "\ud800"}}, ["body", "env"]),
    ("POST", "/v1/runs", {**RUN, "\ud800": 1}, ["body"]),
    ("POST", "/v1/runs", {**RUN, "host": "\ud800"}, ["body", "host"]),
    ("POST", "/v1/runs", {"name": "t", "host": "local", "trainer": {"verifier_path": "/\ud800"}},
     ["body", "trainer", "verifier_path"]),
    ("POST", "/v1/runs/{run}/restart?dry_run=true", {"overrides": {"name": "\ud800"}}, ["body", "overrides"]),
    ("POST", "/v1/hosts", {**HOST, "workspace": "/srv/\ud800"}, ["body", "workspace"]),
    ("PATCH", "/v1/hosts/local", {"python": "\ud800"}, ["body", "python"]),
])
def test_a_lone_surrogate_in_a_string_field_is_a_422_naming_it(api: App, method: str, path: str, body: object,
                                                               loc: list) -> None:
    r = send(api, method, path.format(run=api.submit()["id"] if "{run}" in path else ""), body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]  # the answer is UTF-8 JSON
    assert loc in [e["loc"][:len(loc)] for e in detail], detail
    assert "\\ud800" not in r.text.replace("such as \\\\ud800", ""), "the undecodable input is not echoed"


def test_a_valid_value_beside_it_is_still_echoed_as_fastapi_does(api: App) -> None:
    r = send(api, "POST", "/v1/runs", {**RUN, "nproc_per_node": "many"})
    assert r.status_code == 422 and r.json()["detail"][0]["input"] == "many"


def test_a_workspace_the_server_may_not_resolve_is_a_422_naming_it(api: App, monkeypatch) -> None:
    def refused(path: str, *args, **kwargs) -> str:  # a directory of another user's, under one the server may not read
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr("server.hosts.os.path.realpath", refused)
    body = {"name": "locked", "address": "local", "workspace": "/srv/locked/ws"}
    r = send(api, "POST", "/v1/hosts", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "workspace"]
    assert "Permission denied" in r.json()["detail"][0]["msg"]
    r = send(api, "PATCH", "/v1/hosts/local", {"workspace": "/srv/locked/ws"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "workspace"], r.text
    # /proc/1/root, which root may read: under a kernel file system, refused as given
    r = send(api, "PATCH", "/v1/hosts/local", {"workspace": "/proc/1/root"})
    assert r.status_code == 422 and "kernel file system" in r.text, r.text


@pytest.mark.parametrize(("url", "loc"), [("/v1/hosts/a%00b", ["path"]), ("/v1/runs/ab%00cd/logs", ["path"]),
                                          ("/v1/runs?cursor=%00", ["query", "cursor"])])
def test_a_nul_in_a_path_or_query_parameter_is_a_422_naming_it(api: App, url: str, loc: list) -> None:
    r = api.client.get(url)  # PostgreSQL refuses a NUL in a text value: a 500 from the lookup
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, r.text


def test_a_log_offset_beyond_what_the_database_holds_is_a_4xx(api: App) -> None:
    run = api.submit()
    r = api.client.get(f"/v1/runs/{run['id']}/logs", params={"since_offset": 2**31})
    assert r.status_code in (200, 422), r.text  # PostgreSQL's integer column: 500 before
