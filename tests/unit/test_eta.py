import pytest

from server.eta import Measured, predict_duration, remaining_seconds, update_step_rate
from server.spec import RunCreate


def _trainer(ttt: int, nproc_per_node: int = 4, **kw: object) -> RunCreate:
    paths = {f: f"/ws/{f}" for f in ("verifier_path", "data_dir", "vocab_mapping_dir", "output_dir")}
    return RunCreate.model_validate({"host": "local", "nproc_per_node": nproc_per_node,
                                     "trainer": {**paths, "ttt_steps": ttt, "epochs": 5, "max_seq_len": 4096, **kw}})


def test_step_rate_is_smoothed_and_ignores_repeats() -> None:
    rate = update_step_rate(None, 10, 100.0, 20, 110.0)
    assert rate == pytest.approx(1.0)
    assert update_step_rate(rate, 20, 110.0, 20, 111.0) == rate
    slower = update_step_rate(rate, 20, 110.0, 21, 113.0)
    assert 1.0 < slower < 3.0


def test_remaining_counts_down_between_metrics() -> None:
    assert remaining_seconds(100, 40, 2.0) == 120.0
    assert remaining_seconds(100, 40, 2.0, seconds_since_last=30) == 90.0
    assert remaining_seconds(100, 100, 2.0, seconds_since_last=30) == 0.0
    assert remaining_seconds(None, 40, 2.0) is None


def test_deeper_ttt_is_predicted_from_one_measured_depth() -> None:
    # 2.0 s/step at TTT=3 with one step of fixed work: 0.5 s per unit, TTT=5 -> 6 units -> 3.0 s/step
    seconds, basis = predict_duration([Measured(_trainer(3), 2.0, 1000)], _trainer(5))
    assert seconds == pytest.approx(1000 * 3.0)
    assert "TTT=3" in basis


def test_a_deeper_ttt_is_priced_from_the_trainers_split_of_its_compiled_steps() -> None:
    # the eager warm-up made the attempt's pace 0.123 s/step; compiled, the trainer timed 0.011 s fixed + 0.008 s per
    # TTT iteration (0.035 s at TTT=3): the dry run prices TTT=5 and 10 from those, not from the warm-up's pace
    measured = Measured(_trainer(3), 0.123, 1000, step_fixed_s=0.011, ttt_iter_s=0.008)
    five, basis = predict_duration([measured], _trainer(5))
    assert five == pytest.approx(1000 * (0.011 + 5 * 0.008))
    assert "timed by the trainer over compiled steps" in basis
    ten, _ = predict_duration([measured], _trainer(10))
    assert ten == pytest.approx(1000 * (0.011 + 10 * 0.008))


def test_a_finished_attempts_start_up_and_wrap_up_are_added() -> None:
    # the final validation and evaluation of a finished attempt do not depend on the TTT depth
    seconds, basis = predict_duration([Measured(_trainer(3), 2.0, 1000, startup_seconds=15, wrapup_seconds=40)],
                                      _trainer(5))
    assert seconds == pytest.approx(15 + 1000 * 3.0 + 40)
    assert "15s start-up" in basis and "40s after the last step" in basis


def test_two_measured_depths_fit_the_line() -> None:
    measured = [Measured(_trainer(5), 3.5, 1000), Measured(_trainer(3), 2.5, 1000)]
    seconds, basis = predict_duration(measured, _trainer(7))
    assert seconds == pytest.approx(1000 * 4.5)
    assert "fitted" in basis


def test_more_processes_mean_fewer_steps() -> None:
    seconds, _ = predict_duration([Measured(_trainer(3), 2.0, 1000)], _trainer(3, nproc_per_node=8))
    assert seconds == pytest.approx(500 * 2.0)


def test_nothing_measured_says_so() -> None:
    seconds, basis = predict_duration([], _trainer(5))
    assert seconds is None and "no step" in basis


def test_a_sample_over_many_steps_weighs_as_that_many_samples_of_one() -> None:
    one_by_one = 1.0
    for step in range(25):
        one_by_one = update_step_rate(one_by_one, step, 10.0 + 0.3 * step, step + 1, 10.0 + 0.3 * (step + 1))
    at_once = update_step_rate(1.0, 0, 10.0, 25, 10.0 + 0.3 * 25)
    assert at_once == pytest.approx(one_by_one) and abs(at_once - 0.3) < 0.06


def test_the_eta_counts_down_through_the_wrap_up_an_earlier_attempt_took_not_0_after_the_last_step(api) -> None:
    from datetime import timedelta

    from server.lifecycle import RunStatus as S
    from server.models import Attempt, utcnow

    run = api.submit(name="wrapped")
    api.move(run["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    now = utcnow()
    with api.session() as s:  # attempt 1: 100 steps of 1 s, then 210 s of final validation and evaluation
        first = s.query(Attempt).filter_by(run_id=run["id"], number=1).one()
        first.status, first.sec_per_step, first.total_steps, first.last_step = "succeeded", 1.0, 100, 100
        first.started_at, first.first_step_at = now - timedelta(seconds=400), now - timedelta(seconds=389)
        first.ended_at = first.started_at + timedelta(seconds=10 + 100 + 210)
    assert api.client.post(f"/v1/runs/{run['id']}/restart", json={}).status_code == 202
    api.move(run["id"], S.LAUNCHING, S.RUNNING)
    with api.session() as s:  # attempt 2: its last step done 60 s ago, evaluating since
        second = s.query(Attempt).filter_by(run_id=run["id"], number=2).one()
        second.status, second.sec_per_step, second.total_steps, second.last_step = "running", 1.0, 100, 100
        second.started_at, second.step_seen_at = now - timedelta(seconds=200), now - timedelta(seconds=60)
    got = api.client.get(f"/v1/runs/{run['id']}").json()
    assert got["progress"] == 1.0
    assert 140 <= got["eta_seconds"] <= 151  # 210 s of wrap-up less the 60 s since the last step


def test_a_first_attempts_eta_counts_the_wrap_up_a_similar_earlier_run_on_the_host_took(api) -> None:
    from datetime import timedelta

    from server.lifecycle import RunStatus as S
    from server.models import Attempt, utcnow

    now = utcnow()
    earlier = api.submit(name="earlier")
    api.move(earlier["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    current = api.submit(name="current")
    api.move(current["id"], S.LAUNCHING, S.RUNNING)
    with api.session() as s:  # the earlier run: 100 steps of 1 s, then 120 s of evaluation
        a = s.query(Attempt).filter_by(run_id=earlier["id"]).one()
        a.status, a.sec_per_step, a.total_steps, a.last_step = "succeeded", 1.0, 100, 100
        a.started_at, a.first_step_at = now - timedelta(seconds=1000), now - timedelta(seconds=999)
        a.ended_at = a.started_at + timedelta(seconds=100 + 120)
        b = s.query(Attempt).filter_by(run_id=current["id"]).one()  # at its last step 20 s ago
        b.status, b.sec_per_step, b.total_steps, b.last_step = "running", 1.0, 100, 100
        b.started_at, b.step_seen_at = now - timedelta(seconds=130), now - timedelta(seconds=20)
    got = api.client.get(f"/v1/runs/{current['id']}").json()
    assert 95 <= got["eta_seconds"] <= 101
    listed = {r["id"]: r for r in api.client.get("/v1/runs").json()["items"]}
    assert 95 <= listed[current["id"]]["eta_seconds"] <= 101
