"""Slurm hosts and the `slurm` part of a run spec through the API: what is refused is a 422 naming the field,
and nothing is written."""

import pytest

from server.lifecycle import RunStatus as S
from tests.inprocess import App
from tests.server.test_api_routes import locs

RUN = {"name": "a", "host": "cluster", "entrypoint": "/opt/train.py"}


def _register_cluster(api: App) -> None:
    r = api.client.post("/v1/hosts", json={"name": "cluster", "kind": "slurm", "address": "login.example",
                                           "workspace": "/shared/ws"})
    assert r.status_code == 201 and r.json()["kind"] == "slurm", r.text


def test_a_slurm_spec_is_kept_whole_and_bad_values_are_422s_naming_the_field(api: App) -> None:
    _register_cluster(api)
    slurm = {"nodes": 2, "partition": "gpu,debug", "account": "team-a", "time_limit": "2-00:00:00",
             "gpus_per_node": 8, "sbatch_options": ["--qos=high", "--constraint=h100&nvlink", "--exclusive"]}
    run = api.client.post("/v1/runs", json={**RUN, "slurm": slurm})
    assert run.status_code == 201, run.text
    assert run.json()["spec"]["slurm"] == slurm
    bad = [
        (("partition",), {"partition": "gpu\n#SBATCH --uid=0"}),
        (("account",), {"account": "a b"}),
        (("account",), {"account": "team\n"}),
        (("time_limit",), {"time_limit": "1h"}),
        (("nodes",), {"nodes": 0}),
        (("sbatch_options", 0), {"sbatch_options": ["--qos=high\n#SBATCH --account=other"]}),
        (("sbatch_options", 1), {"sbatch_options": ["--qos=x", "--output=/etc/passwd"]}),
        (("sbatch_options", 0), {"sbatch_options": ["-p gpu"]}),
        (("unknown",), {"unknown": 1}),
    ]
    for field, value in bad:
        assert locs(api.client.post("/v1/runs", json={**RUN, "slurm": value})) == [["body", "slurm", *field]], field
    newline = api.client.post("/v1/runs", json={**RUN, "slurm": {"sbatch_options": ["--comment=a\rb"]}})
    assert "line break" in newline.text
    own = api.client.post("/v1/runs", json={**RUN, "slurm": {"sbatch_options": ["--time=5"]}})
    assert "set by longrun" in own.text
    assert [e["loc"][:3] for e in api.client.post(
        "/v1/runs", json={**RUN, "slurm": {"gpus_per_node": "8 gpus"}}).json()["detail"]] == [
        ["body", "slurm", "gpus_per_node"]] * 2
    assert len(api.client.get("/v1/runs").json()["items"]) == 1


def test_slurm_goes_with_one_slurm_host_and_restarts_check_it_too(api: App) -> None:
    _register_cluster(api)
    direct = api.client.post("/v1/runs", json={**RUN, "host": "local", "slurm": {"nodes": 1}})
    assert locs(direct) == [["body", "slurm"]] and "not of kind `slurm`" in direct.text
    both = {k: v for k, v in RUN.items() if k != "host"} | {"hosts": ["cluster", "local"]}
    assert locs(api.client.post("/v1/runs", json=both)) == [["body", "hosts"]]

    run = api.client.post("/v1/runs", json={**RUN, "slurm": {"time_limit": "10"}}).json()
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    path = f"/v1/runs/{run['id']}/restart"
    assert locs(api.client.post(path, json={"overrides": {"slurm": {"time_limit": "soon"}}})) == [
        ["body", "overrides", "slurm", "time_limit"]]
    longer = api.client.post(path, params={"dry_run": True}, json={"overrides": {"slurm": {"time_limit": "20"}}})
    assert longer.status_code == 200 and longer.json()["new_spec"]["slurm"]["time_limit"] == "20"
    assert api.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1


@pytest.mark.parametrize("option", ["--arr=0-2", "--array=0-2", "--a=0-2", "--outp=/etc/x", "--job=x", "--gpus-per=8",
                                    "--ti=5", "--wr=id", "--chd=/", "--nt=9", "--export-f=/x", "--n=2", "--part=x"])
def test_an_abbreviation_of_an_option_longrun_sets_is_refused_as_sbatch_would_read_it(api: App, option: str) -> None:
    _register_cluster(api)
    r = api.client.post("/v1/runs", json={**RUN, "slurm": {"sbatch_options": [option]}})
    assert r.status_code == 422 and "set by longrun" in r.text, r.text


@pytest.mark.parametrize("option", ["--gpus=2", "--qos=high", "--exclusive", "--time-min=5", "--nodelist=a1",
                                    "--comment=--array=0-2", "--gpu-bind=closest"])
def test_options_that_only_look_like_longruns_are_kept(api: App, option: str) -> None:
    _register_cluster(api)
    r = api.client.post("/v1/runs", json={**RUN, "slurm": {"sbatch_options": [option]}})
    assert r.status_code == 201, r.text
