"""No silent resume: a trainer run submitted into an output directory that holds another run's checkpoint would
continue it (the trainer resumes the newest checkpoint there), so it is refused naming the checkpoint and the two
choices, unless the request (`start`) or the spec (`trainer.no_resume`) says which; in-process, no worker."""

import pytest

from server.lifecycle import RunStatus as S
from server.models import Attempt, Run
from tests.inprocess import App
from tests.longrun.test_cli import exit_code


def ended_run_with_a_checkpoint(api: App, name: str = "ttt3") -> tuple[dict, dict]:
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v",
               "output_dir": str(api.workspace / "out"), "ttt_steps": 3, "save_every": 100, "epochs": 1}
    run = api.submit(entrypoint=None, trainer=trainer, name=name)
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    with api.session() as s:
        a = s.query(Attempt).filter_by(run_id=run["id"]).one()
        a.last_step, a.total_steps = 456, 456
    return run, trainer


def test_resubmitting_an_ended_runs_spec_is_refused_naming_its_checkpoint_and_the_choices(api: App) -> None:
    old, trainer = ended_run_with_a_checkpoint(api)
    spec = {"name": "ttt3", "host": "local", "nproc_per_node": 2, "trainer": trainer}
    refused = api.client.post("/v1/runs", json=spec)
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "trainer", "output_dir"]
    said = error["msg"]
    assert f"holds the checkpoint at step 456 of run ttt3 ({old['id']}, succeeded), trained with 3 TTT steps" in said
    assert "--start resume" in said and "--start fresh" in said, said
    assert len(api.client.get("/v1/runs").json()["items"]) == 1, "nothing was submitted"

    resumed = api.client.post("/v1/runs", params={"start": "resume"}, json=spec)
    assert resumed.status_code == 201, resumed.text
    fresh = api.client.post("/v1/runs", params={"start": "fresh"}, json={**spec, "name": "ttt3-fresh"})
    assert fresh.status_code == 201, fresh.text
    with api.session() as s:
        assert s.get(Run, fresh.json()["id"]).clean_pending, "the worker empties the directory before launching"
        assert not s.get(Run, resumed.json()["id"]).clean_pending
    said_in_spec = api.client.post("/v1/runs", json={**spec, "name": "ttt3-said",
                                                     "trainer": {**trainer, "no_resume": False}})
    assert said_in_spec.status_code == 201, "the spec says it: continue"


@pytest.mark.parametrize("change", [{"output_dir": "elsewhere"}, {"ttt_steps": 5, "output_dir": "other"}])
def test_an_output_directory_no_run_trained_in_needs_no_choice(api: App, change: dict) -> None:
    _, trainer = ended_run_with_a_checkpoint(api)
    trainer = {**trainer, **change, "output_dir": str(api.workspace / change["output_dir"])}
    assert api.client.post("/v1/runs", json={"name": "b", "host": "local", "nproc_per_node": 2,
                                             "trainer": trainer}).status_code == 201


def test_a_fresh_start_outside_the_workspace_is_refused(api: App) -> None:
    _, trainer = ended_run_with_a_checkpoint(api)
    spec = {"name": "b", "host": "local", "nproc_per_node": 2, "trainer": {**trainer, "output_dir": "/etc/out"}}
    refused = api.client.post("/v1/runs", params={"start": "fresh"}, json=spec)
    assert refused.status_code == 422 and "outside the workspace" in refused.json()["detail"][0]["msg"]


def test_the_command_says_the_choices_and_takes_one(cli: App, capsys, tmp_path) -> None:
    _, trainer = ended_run_with_a_checkpoint(cli)
    spec = tmp_path / "run.yaml"
    spec.write_text(f"name: ttt3\nhost: local\nnproc_per_node: 2\ntrainer: {trainer}\n")
    assert exit_code(["submit", str(spec)]) == 5
    err = " ".join(capsys.readouterr().err.split())
    assert "holds the checkpoint at step 456" in err and "longrun submit SPEC --start fresh" in err, err
    assert exit_code(["submit", str(spec), "--start", "fresh", "--json"]) == 0
