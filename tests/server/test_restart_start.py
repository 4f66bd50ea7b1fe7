"""A restart's dry run says whether the new attempt resumes the trainer's checkpoint (from which step, trained at
which TTT depth) or starts fresh, and prices that: in-process, the API without the worker."""

from server.lifecycle import RunStatus as S
from server.models import Attempt
from tests.inprocess import App


def test_the_dry_run_says_a_ttt_change_without_clean_resumes_the_old_depths_checkpoint_and_prices_it(api: App) -> None:
    out = str(api.workspace / "out")
    trainer = {"verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": out,
               "ttt_steps": 3, "save_every": 100, "epochs": 2}
    run = api.submit(entrypoint=None, trainer=trainer)
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    with api.session() as s:
        a = s.get(Attempt, s.query(Attempt.id).filter_by(run_id=run["id"]).scalar())
        a.last_step, a.total_steps, a.sec_per_step = 570, 1520, 0.5
    url = f"/v1/runs/{run['id']}/restart"

    resumed = api.client.post(url, params={"dry_run": True}, json={"overrides": {"ttt_steps": 5}}).json()
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
    restarted = api.client.post(url, json={"overrides": {"ttt_steps": 5}}).json()
    assert "resumes the checkpoint at step 500" in restarted["message"], restarted["message"]
