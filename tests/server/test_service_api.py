"""The API against hostile input: workspaces that spell `/`, secrets in `env`, limits, and exposure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.lifecycle import RunStatus as S
from server.lifecycle import start_attempt
from server.models import Host, Run, utcnow
from tests.inprocess import App
from tests.service import ROOT, free_port
from worker.ingest import store_metrics


def locs(response) -> list[list]:  # type: ignore[no-untyped-def]
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["detail"]]


@pytest.mark.parametrize("workspace", ["/", "//", "///", "/./", "/.", "//.//", "/./.", "/.//./"])
def test_a_workspace_that_spells_the_root_is_refused(api: App, workspace: str) -> None:
    r = api.client.post("/v1/hosts", json={"name": "box", "address": "10.0.0.5", "workspace": workspace})
    assert locs(r) == [["body"]] and "workspace must not be /" in r.text
    assert api.client.get("/v1/hosts/box").status_code == 404


def test_a_workspace_is_stored_normalised(api: App) -> None:
    r = api.client.post("/v1/hosts", json={"name": "box", "address": "10.0.0.5", "workspace": "//srv/./lr//"})
    assert r.status_code == 201 and r.json()["workspace"] == "/srv/lr"


def test_clean_compares_normalised_paths_and_refuses_a_stored_root_workspace(api: App) -> None:
    inside = api.workspace / "out"
    run = api.submit(output_dir=f"{api.workspace}/./out/")
    assert run["spec"]["output_dir"] == str(inside)
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    assert api.client.post(f"/v1/runs/{run['id']}/restart", json={"clean": True}).status_code == 202
    # a host row written before `//` was refused: nothing may be cleaned under it
    with api.db.writing() as s:
        s.add(Host(name="old", address="10.0.0.6", port=22, workspace="//", python="python3"))
    old = api.submit(host="old", output_dir="/etc/ssl")
    api.move(old["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    refused = api.client.post(f"/v1/runs/{old['id']}/restart", json={"clean": True})
    assert locs(refused) == [["body", "clean"]] and "outside the workspace // of host old" in refused.text
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    for sneaky in (f"{api.workspace}x/out", str(api.workspace), f"{api.workspace}/../etc"):
        r = api.client.post(f"/v1/runs/{run['id']}/restart", json={"clean": True, "overrides": {"output_dir": sneaky}})
        assert r.status_code == 422, sneaky


def test_env_values_are_never_echoed(api: App) -> None:
    secret = "hf_s3cr3t_value"
    run = api.submit(env={"HF_TOKEN": secret, "MODE": "fast"})
    everything = [api.client.post("/v1/runs", json={"name": "toy", "host": "local", "entrypoint": "/opt/train.py",
                                                      "env": {"HF_TOKEN": secret}}).text]
    assert run["spec"]["env"] == {"HF_TOKEN": "***", "MODE": "***"}
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    dry = api.client.post(f"/v1/runs/{run['id']}/restart", params={"dry_run": True},
                          json={"overrides": {"env": {"HF_TOKEN": secret + "2"}}})
    assert dry.json()["new_spec"]["env"] == {"HF_TOKEN": "***"}
    restarted = api.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"env": {"HF_TOKEN": secret}}})
    assert restarted.status_code == 202
    api.move(run["id"], S.FAILED)
    everything += [dry.text, restarted.text, api.client.get("/v1/runs").text,
                   api.client.get(f"/v1/runs/{run['id']}").text,
                   api.client.get(f"/v1/runs/{run['id']}/events").text]
    for body in everything:
        assert secret not in body
    assert '"overrides": {"env": {"HF_TOKEN": "***"}}' in everything[-1]
    with api.db.reading() as s:
        stored = s.get(Run, run["id"])
        assert stored.spec["env"] == {"HF_TOKEN": secret}, "the launch still gets the real value"
        assert json.dumps(stored.attempts[0].spec["env"]) == json.dumps({"HF_TOKEN": secret, "MODE": "fast"})


def test_restart_keeps_env_values_it_was_not_given(api: App) -> None:
    run = api.submit(env={"HF_TOKEN": "abc"})
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    api.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": ["--more"]}})
    with api.db.reading() as s:
        assert s.get(Run, run["id"]).spec["env"] == {"HF_TOKEN": "abc"}


def test_a_host_header_outside_the_allow_list_is_refused(api: App) -> None:
    evil = api.client.get("/v1/runs", headers={"Host": "attacker.example"})
    assert evil.status_code == 400 and "LONGRUN_ALLOWED_HOSTS" in evil.json()["detail"]
    for name in ("127.0.0.1:8080", "localhost", "[::1]:8080", "LOCALHOST:1"):
        assert api.client.get("/v1/runs", headers={"Host": name}).status_code == 200, name
    assert api.client.get("/healthz", headers={"Host": "attacker.example"}).status_code == 400


def test_an_allow_list_from_the_settings_replaces_the_loopback_default(tmp_path: Path) -> None:
    from server.api.app import create_app
    from server.config import Settings

    settings = Settings(home=tmp_path, allowed_hosts="lr.internal, 10.0.0.5")
    assert settings.host_allow_list() == ["lr.internal", "10.0.0.5"]
    assert Settings(home=tmp_path).host_allow_list("10.1.2.3")[-1] == "10.1.2.3"
    client = TestClient(create_app(None, settings), base_url="http://lr.internal:8080")  # type: ignore[arg-type]
    assert client.get("/healthz").status_code == 200
    assert client.get("/healthz", headers={"Host": "127.0.0.1"}).status_code == 400


def test_docs_and_the_openapi_document_need_the_token_when_one_is_set(tmp_path: Path, database_url: str) -> None:
    guarded = App(tmp_path / "home", database_url, token="s3cret")
    try:
        bare = TestClient(guarded.app, base_url="http://127.0.0.1")
        assert bare.get("/openapi.json").status_code == 401 and bare.get("/docs").status_code == 401
        assert bare.get("/healthz").status_code == 200
        assert guarded.client.get("/openapi.json").json()["info"]["title"] == "longrun"
        assert "swagger" in guarded.client.get("/docs").text.lower()
    finally:
        guarded.close()


def test_a_body_above_the_limit_is_a_413_before_it_is_parsed(api: App) -> None:
    big = b'{"name": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    r = api.client.post("/v1/runs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "LONGRUN_MAX_BODY_BYTES" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"name": "'
        for _ in range(40):
            yield b"x" * 64 * 1024
        yield b'"}'

    streamed = api.client.post("/v1/runs", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and "LONGRUN_MAX_BODY_BYTES" in streamed.json()["detail"]
    assert api.client.get("/v1/runs").json()["items"] == []


def _serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "LONGRUN_API_TOKEN"}
    environ.update(LONGRUN_HOME=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-m", "longrun.cli", "serve", *args], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.0.0.5", "example.org"])
def test_serve_refuses_a_non_loopback_address_without_a_token(tmp_path: Path, bind: str) -> None:
    done = _serve(tmp_path, "--host", bind, "--port", str(free_port()))
    assert done.returncode != 0
    assert f"refusing to listen on {bind} without LONGRUN_API_TOKEN" in done.stderr
    assert not (tmp_path / "longrun.db").exists(), "refused before anything was opened"


@pytest.mark.slow
def test_serve_refuses_a_non_loopback_bind_host_from_the_environment(tmp_path: Path) -> None:
    done = _serve(tmp_path, LONGRUN_BIND_HOST="0.0.0.0")
    assert done.returncode != 0 and "LONGRUN_API_TOKEN" in done.stderr


def test_args_and_env_beyond_their_bounds_are_422s_naming_the_field(api: App) -> None:
    base = {"name": "toy", "host": "local", "entrypoint": "/opt/train.py"}
    assert locs(api.client.post("/v1/runs", json={**base, "args": ["a"] * 1025})) == [["body", "args"]]
    assert locs(api.client.post("/v1/runs", json={**base, "args": ["a" * 20_000]})) == [["body", "args", 0]]
    many = {f"V{i}": "x" for i in range(257)}
    assert locs(api.client.post("/v1/runs", json={**base, "env": many})) == [["body", "env"]]
    assert locs(api.client.post("/v1/runs", json={**base, "env": {"V": "x" * 40_000}})) == [["body", "env"]]
    assert locs(api.client.post("/v1/runs", json={**base, "cwd": "/" + "d" * 5000})) == [["body", "cwd"]]


def test_a_spec_whose_launch_would_not_fit_is_refused_at_submit_naming_its_largest_field(api: App) -> None:
    base = {"name": "toy", "host": "local", "entrypoint": "/opt/train.py"}
    # each value is allowed alone; together they exceed what one launch may carry (before: stuck in launching)
    env = {f"V{i}": "x" * 30_000 for i in range(4)}
    r = api.client.post("/v1/runs", json={**base, "env": env, "args": ["y" * 10_000]})
    assert locs(r) == [["body", "env"]] and "at most 98304" in r.text and "pass large data as a file" in r.text
    assert api.client.get("/v1/runs").json()["items"] == []
    run = api.submit(env={"V0": "x" * 30_000})
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    grown = api.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"args": ["z" * 16_000] * 5}})
    assert locs(grown) == [["body", "overrides", "args"]]


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_a_job_clock_an_hour_off_moves_neither_the_eta_nor_the_startup(api: App, skew: float) -> None:
    run = api.submit()
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    now = utcnow()
    lines = "".join(json.dumps({"step": i, "total_steps": 100, "time": now.timestamp() + skew - 10 + i}) + "\n"
                    for i in range(1, 11))
    with api.db.writing() as s:
        stored = s.get(Run, run["id"])
        start_attempt(stored.current, now)
        store_metrics(s, stored, stored.current, lines, now)
    shown = api.client.get(f"/v1/runs/{run['id']}").json()
    assert shown["progress"] == 0.1 and shown["attempts"][0]["seconds_per_step"] == pytest.approx(1.0)
    assert 85 < shown["eta_seconds"] <= 90, "90 steps of 1 s left, whatever the job's clock says"
    assert shown["attempts"][0]["first_step_at"] == shown["attempts"][0]["started_at"]


@pytest.mark.parametrize("target", ["/", "/etc", "/usr"])
def test_a_local_workspace_that_is_a_symlink_to_the_root_or_a_system_directory_is_refused(
        api: App, tmp_path: Path, target: str) -> None:
    link = tmp_path / "ws-link"
    link.symlink_to(target)
    r = api.client.post("/v1/hosts", json={"name": "here", "address": "local", "workspace": str(link / ".")})
    assert r.status_code == 422 and f"leads to {target}" in r.text, r.text
    assert api.client.get("/v1/hosts/here").status_code == 404
    real = tmp_path / "real-ws"
    real.mkdir()
    assert api.client.post("/v1/hosts", json={"name": "here", "address": "local",
                                              "workspace": str(real)}).status_code == 201
    moved = api.client.patch("/v1/hosts/here", json={"workspace": str(link)})
    assert moved.status_code == 422 and f"leads to {target}" in moved.text
