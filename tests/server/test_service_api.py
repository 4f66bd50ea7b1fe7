"""The API against hostile input: workspaces that spell `/`, secrets in `env`, limits, and exposure."""

import json

import pytest

from server.lifecycle import RunStatus as S
from server.models import Host, Run
from tests.inprocess import App


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
