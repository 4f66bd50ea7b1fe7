"""A restart's dry run says whether the new attempt resumes the trainer's checkpoint (from which step, trained at
which TTT depth) or starts fresh, and prices that; resuming another depth's checkpoint is asked for explicitly
(resume) or refused: in-process, the API without the worker."""

from server.lifecycle import RunStatus as S
from server.models import Attempt
from tests.inprocess import App


def test_a_ttt_change_over_a_checkpoint_is_refused_unless_resume_or_clean_and_the_dry_run_prices_each(api: App) -> None:
    out = str(api.workspace / "out")
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": out,
               "ttt_steps": 3, "save_every": 100, "epochs": 2}
    run = api.submit(entrypoint=None, trainer=trainer)
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    with api.session() as s:
        a = s.get(Attempt, s.query(Attempt.id).filter_by(run_id=run["id"]).scalar())
        a.last_step, a.total_steps, a.sec_per_step = 570, 1520, 0.5
    url = f"/v1/runs/{run['id']}/restart"

    # another depth over a checkpoint: refused until the restart says resume or clean, the dry run as the restart
    for params in ({"dry_run": True}, {}):
        refused = api.client.post(url, params=params, json={"overrides": {"ttt_steps": 5}})
        assert refused.status_code == 422, refused.text
        [error] = refused.json()["detail"]
        assert error["loc"] == ["body", "resume"]
        assert error["msg"].startswith(f"the checkpoint at step 500 in {out} was trained with 3 TTT steps and this "
                                       "attempt trains 5: say resume: true to continue it"), error["msg"]
        assert "clean: true to train TTT=5 from step 0" in error["msg"]
    assert api.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1, "the refusal changed nothing"
    both = api.client.post(url, params={"dry_run": True}, json={"overrides": {"ttt_steps": 5}, "resume": True,
                                                                "clean": True})
    assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["body", "resume"]
    same_depth = api.client.post(url, params={"dry_run": True}, json={"overrides": {"epochs": 3}}).json()
    assert (same_depth["start"], same_depth["resumes_from_step"]) == ("resume", 500), "no depth change: no question"

    resumed = api.client.post(url, params={"dry_run": True}, json={"overrides": {"ttt_steps": 5},
                                                                   "resume": True}).json()
    assert (resumed["start"], resumed["resumes_from_step"], resumed["resumes_ttt_steps"]) == ("resume", 500, 3)
    assert "trained with 3 TTT steps, continuing with 5" in resumed["start_reason"]
    assert "resumes at step 500 of 1520" in resumed["basis"]

    fresh = api.client.post(url, params={"dry_run": True}, json={"overrides": {"ttt_steps": 5}, "clean": True}).json()
    assert (fresh["start"], fresh["resumes_from_step"]) == ("fresh", None) and "step 0" in fresh["start_reason"]
    # the 500 steps the checkpoint holds are not priced again (each at the TTT=5 step time)
    per_step = (fresh["predicted_duration_seconds"] - resumed["predicted_duration_seconds"]) / 500
    assert per_step > 0.5, (fresh, resumed)

    # another output dir holds no checkpoint: fresh, and the restart's message says which it is
    other = api.client.post(url, params={"dry_run": True}, json={"overrides": {"output_dir": out + "2"}}).json()
    assert other["start"] == "fresh"
    restarted = api.client.post(url, json={"overrides": {"ttt_steps": 5}, "resume": True}).json()
    assert "resumes the checkpoint at step 500" in restarted["message"], restarted["message"]


def test_a_restart_that_would_resume_the_last_step_is_refused_saying_why(api: App) -> None:
    """A run that trained all its steps (ended, or in its final evaluation): resuming its checkpoint would train
    nothing, and `succeeded ... TTT 5` would be a draft trained at TTT=3. Refused, naming the fresh start."""
    out = str(api.workspace / "out")
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": out,
               "ttt_steps": 3, "save_every": 100, "epochs": 2}
    run = api.submit(entrypoint=None, trainer=trainer, name="done")
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    with api.session() as s:
        a = s.get(Attempt, s.query(Attempt.id).filter_by(run_id=run["id"]).scalar())
        a.last_step, a.total_steps, a.sec_per_step = 456, 456, 0.5  # every step trained: it is evaluating
    url = f"/v1/runs/{run['id']}/restart"
    for params in ({"dry_run": True}, {}):
        for body, field in (({"overrides": {"ttt_steps": 5}, "resume": True}, "resume"), ({}, "clean")):
            refused = api.client.post(url, params=params, json=body)
            assert refused.status_code == 422, refused.text
            [error] = refused.json()["detail"]
            assert error["loc"] == ["body", field]
            assert "checkpoint at step 456" in error["msg"] and "resuming it would train no step" in error["msg"]
            assert "longrun restart done --start fresh" in error["msg"], error["msg"]
    assert api.client.get(f"/v1/runs/{run['id']}").json()["attempt"] == 1, "the refusal stopped nothing"
    more = api.client.post(url, params={"dry_run": True}, json={"overrides": {"epochs": 3}}).json()
    assert (more["start"], more["resumes_from_step"]) == ("resume", 456), "more epochs train on from it"
    fresh = api.client.post(url, params={"dry_run": True}, json={"overrides": {"ttt_steps": 5}, "clean": True}).json()
    assert fresh["start"] == "fresh"


def test_a_fresh_restart_outside_the_workspace_names_the_restart_that_goes_inside(api: App) -> None:
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/etc/out"}
    run = api.submit(entrypoint=None, trainer=trainer, name="outside")
    refused = api.client.post(f"/v1/runs/{run['id']}/restart", json={"clean": True})
    assert refused.status_code == 422
    said = refused.json()["detail"][0]["msg"]
    assert said.startswith(f"refusing to clean /etc/out: it is outside the workspace {api.workspace}"), said
    assert f"longrun restart outside --set output_dir={api.workspace}/outside --start fresh" in said
