"""Service-side faults driven through the real worker services over in-memory hosts (tests/worker/fake_host.py):
an API call landing between the worker's transactions, and a job that writes what it should not."""

import json
from typing import Any

import pytest

from server.lifecycle import nodes_of
from server.models import Event, LogChunk, MetricPoint
from server.queries import log_lines
from server.runs import request_restart
from server.schemas import RestartRequest
from tests.worker.conftest import Rig, rig  # noqa: F401 - the worker's fixture, shared
from worker.attempt_io import store_probes

__all__ = ["rig"]


def _restart_via_api(rig: Rig, run_id: str, **overrides: Any) -> None:
    with rig.db.writing() as s:
        request_restart(s, run_id, RestartRequest(overrides=overrides))


def test_a_restart_landing_while_the_worker_launches_stops_the_attempt_it_launched(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id)  # queued -> launching
    host = rig.hosts["a"]
    launch = host._launch

    def restart_then_launch(req: dict[str, Any]) -> dict[str, Any]:
        # the API's restart commits after the worker planned the nodes and before the launch is recorded
        _restart_via_api(rig, run_id, args=["--again"])
        return launch(req)

    host._launch = restart_then_launch  # type: ignore[method-assign]
    rig.step(run_id)
    host._launch = launch  # type: ignore[method-assign]
    first = host.job(run_id, 1)
    assert first.alive, "attempt 1 was launched before the restart was seen"
    rig.step(run_id)
    run = rig.run(run_id)
    assert not first.alive, "the attempt launched during the restart is stopped before attempt 2 starts"
    assert run.status == "running" and run.attempt == 2
    assert [j.alive for j in host.jobs.values()] == [False, True], "exactly one copy of the job runs"
    assert run.attempts[0].status == "cancelled" and run.attempts[0].message == "superseded by attempt 2"
    rig.cancel(run_id)
    rig.step(run_id)
    assert rig.run(run_id).status == "cancelled" and not any(j.alive for j in host.jobs.values())


def test_a_restart_before_any_launch_still_drops_the_attempt_at_once(rig: Rig) -> None:
    run_id = rig.submit()
    _restart_via_api(rig, run_id, args=["--again"])
    first = rig.attempt(run_id, 1)
    assert (first.status, first.message) == ("cancelled", "never started")
    rig.step(run_id)
    assert rig.run(run_id).status == "running" and list(rig.hosts["a"].jobs) == ["/ws/.longrun/run1/2"]
    assert nodes_of(rig.attempt(run_id, 2))[0].state == "running"
    assert json.dumps(rig.statuses(run_id)) == json.dumps(["queued", "restarting", "launching", "running"])


POISON = [
    {"step": 1, "total_steps": 10, "time": 1_767_268_800_000, "loss": 2.0},  # a millisecond timestamp
    {"step": 2**64, "loss": 1.9},  # a step no database column holds
    {"step": 2, "total_steps": 2**70, "time": -5, "loss": float("nan"), "acc": 10**400},
    {"step": 3, "loss": 1.5, "gpu_util_0": 99.0, "node1_gpu_mem_1": 1.0, "attempt": 7, "nested": {"a": [1, {}]}},
    {"step": 4, "loss": 1.25, "padding": "x" * 70_000},  # longer than a metric line may be
    {"step": 5, **{f"k{i}": i for i in range(300)}},  # more keys than a line may have
    {"step": 6, "total_steps": 10, "time": 1_767_268_800.5, "loss": "1.0\u2028", "note": "a\u2028b\rc"},
]


def test_poisoned_metric_lines_are_dropped_and_the_run_stays_in_control(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    job.metrics = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in POISON) + "[1, 2]\n"
    rig.step(run_id)
    run = rig.run(run_id)
    attempt = run.attempts[0]
    assert run.status == "running" and attempt.metrics_lines == 8, "every line read once, in its place"
    gpus = {k: v for k, v in run.latest.items() if k.startswith("gpu_")}
    assert gpus == {"gpu_util_0": 0.0, "gpu_util_1": 0.0, "gpu_mem_0": 0.0, "gpu_mem_1": 0.0}, "the server's own"
    # 10**400 is beyond a double: shown as the run's latest, not stored (worker/metric_values.py)
    assert {k: v for k, v in run.latest.items() if k not in gpus} == {"step": 6, "loss": 1.5, "acc": "Infinity",
                                                                     "total_steps": 10}
    assert attempt.last_step == 6 and attempt.total_steps == 10
    # two lines too long or wide, the line of step 2**64, a total of 2**70, a NaN loss and an infinite acc
    assert attempt.metrics_skipped == 6
    assert attempt.message.startswith("6 metric line(s) or value(s) skipped, the last: line 2's total_steps")
    assert run.message is None or "diverged" not in run.message, "the loss was finite again on the next line"
    rig.cancel(run_id)
    rig.step(run_id)
    assert rig.run(run_id).status == "cancelled" and not job.alive


def test_a_step_that_keeps_raising_fails_the_run_with_its_error_instead_of_wedging_it(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    job = rig.hosts["a"].job(run_id, 1)

    def broken(*_: Any) -> None:
        raise RuntimeError("database disk image is malformed")

    monkeypatch.setattr("worker.attempt_stopper.store_probes", broken)
    rig.cancel(run_id)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "cancelling" and run.step_failures == 1
    assert run.message == ("worker step failed (1 of 3 in a row; trying again): "
                           "RuntimeError: database disk image is malformed")
    rig.step(run_id, 2)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message == (
        "gave up after 3 failed worker steps in a row: RuntimeError: database disk image is malformed")
    assert run.attempts[0].status == "failed" and run.attempts[0].abandoned, "what may run is left to the reaper"
    monkeypatch.undo()
    rig.supervisor.reaper.stop(run.attempts[0].id)
    assert not job.alive and not rig.attempt(run_id, 1).abandoned


def test_a_step_that_goes_through_starts_the_count_again(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    calls = {"n": 0}

    def flaky(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] % 3:
            raise OSError("transient")
        store_probes(*args)

    monkeypatch.setattr("worker.run_driver.store_probes", flaky)
    rig.step(run_id, 9)
    assert rig.run(run_id).status == "running", "two failures, then a good step, never three in a row"


def test_a_log_beyond_what_is_kept_keeps_its_tail_and_the_api_says_how_much_was_dropped(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("worker.ingest.MAX_STORED_LOG_BYTES", 1000)
    run_id = rig.submit()
    rig.step(run_id, 2)
    job = rig.hosts["a"].job(run_id, 1)
    for i in range(30):
        job.log += f"line {i:04d} " + "." * 89 + "\n"  # 100 bytes a line, one read per step
        rig.step(run_id)
    with rig.db.reading() as s:
        stored = sum(len(c.text) for c in s.query(LogChunk).filter_by(run_id=run_id))
        _, _, page = log_lines(s, run_id, None, None, None)
        lines, end, dropped = page.lines, page.next_offset, page.dropped
    assert stored == 1000 and end == 3000 and dropped == 2000
    assert lines[0].startswith("line 0020") and lines[-1].startswith("line 0029")


def test_metrics_events_beyond_what_is_kept_are_dropped_oldest_first(rig: Rig,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("worker.ingest.MAX_METRICS_EVENTS", 5)
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    for step in range(1, 13):
        host.write_metrics(host.job(run_id, 1), {"step": step, "loss": 1.0 / step})
        rig.step(run_id)
    with rig.db.reading() as s:
        kept = [e.data["step"] for e in s.query(Event).filter_by(run_id=run_id, kind="metrics").order_by(Event.id)]
        assert kept == [8, 9, 10, 11, 12]
        assert s.query(Event).filter_by(run_id=run_id, kind="status").count() == 3, "status events all kept"
        assert s.query(MetricPoint).filter_by(run_id=run_id, name="loss").count() == 12, "the series whole"


def _steady_steps(rig: Rig, run_id: str, attempt: int, steps: range, skew: float = 0.0) -> None:
    """The job writes a step every 2 s of its own clock, which is `skew` seconds off the server's."""
    host = rig.hosts["a"]
    for step in steps:
        rig.clock.advance(2)
        when = rig.clock.now().timestamp() + skew
        host.write_metrics(host.job(run_id, attempt), {"step": step, "total_steps": 1000, "time": when})
        rig.step(run_id)


@pytest.mark.parametrize("skew", [0.0, 3600.0, -3600.0])
def test_a_step_that_stops_moving_is_marked_stalled_once_by_the_servers_clock(rig: Rig, skew: float) -> None:
    rig.supervisor.driver.settings.stall_floor = 60
    run_id = rig.submit()
    rig.step(run_id, 2)
    _steady_steps(rig, run_id, 1, range(1, 6), skew)
    assert rig.attempt(run_id, 1).sec_per_step == pytest.approx(2.0), "measured on the job's clock, offset or not"
    rig.clock.advance(59)
    rig.step(run_id)
    assert rig.run(run_id).message == "attempt 1 running", "within the floor: not stalled"
    rig.clock.advance(2)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.message == (
        "stalled: step 5 has not advanced for 61s (10 x its 2s per step, at least 60s)")
    rig.clock.advance(100)
    rig.step(run_id)
    with rig.db.reading() as s:
        stalls = [e.data for e in s.query(Event).filter_by(run_id=run_id, kind="stall")]
    assert len(stalls) == 1 and stalls[0]["step"] == 5 and stalls[0]["seconds"] == 61
    _steady_steps(rig, run_id, 1, range(6, 7), skew)
    assert rig.run(run_id).message == "attempt 1 running; its step moved again after a stall"
    assert rig.attempt(run_id, 1).stalled_at is None


@pytest.mark.parametrize("jump", [3600.0, -3600.0])
def test_the_servers_clock_set_an_hour_off_mid_run_neither_stalls_nor_restarts_a_healthy_attempt(
        rig: Rig, jump: float) -> None:
    """The stall rule reads how long the worker itself watched the step stand still: a server clock set forward an
    hour made every running attempt look stalled for 3600 s, and with on_stall: restart restarted it. A real stall
    after the jump is still seen."""
    rig.supervisor.driver.settings.stall_floor = 60
    run_id = rig.submit(max_retries=1, on_stall="restart")
    rig.step(run_id, 2)
    _steady_steps(rig, run_id, 1, range(1, 6))
    rig.clock.jump(jump)
    rig.step(run_id)
    _steady_steps(rig, run_id, 1, range(6, 9))
    run = rig.run(run_id)
    assert (run.status, run.attempt, run.retries_used) == ("running", 1, 0), run.message
    assert rig.attempt(run_id, 1).stalled_at is None and "stalled" not in (run.message or "")
    with rig.db.reading() as s:
        assert s.query(Event).filter_by(run_id=run_id, kind="stall").count() == 0
    # then the step really stands still: seen once the attempt's window has passed (its step time, measured on the
    # job's clock, may hold the jump itself for one step)
    allowed = max(60, 10 * rig.attempt(run_id, 1).sec_per_step)
    rig.clock.advance(allowed + 1)
    rig.step(run_id)
    assert rig.run(run_id).message.startswith("retry 1 of 1: attempt 1 stalled: step 8 has not advanced for")


def test_the_stall_window_is_the_attempts_own_step_time_times_the_factor(rig: Rig) -> None:
    rig.supervisor.driver.settings.stall_floor = 5
    run_id = rig.submit()
    rig.step(run_id, 2)
    _steady_steps(rig, run_id, 1, range(1, 6))
    rig.clock.advance(19)
    rig.step(run_id)
    assert rig.attempt(run_id, 1).stalled_at is None, "10 x 2 s: not yet"
    rig.clock.advance(2)
    rig.step(run_id)
    assert rig.attempt(run_id, 1).stalled_at is not None


def test_on_stall_restart_relaunches_from_the_checkpoint_as_a_counted_retry(rig: Rig) -> None:
    rig.supervisor.driver.settings.stall_floor = 60
    run_id = rig.submit(max_retries=1, on_stall="restart")
    rig.step(run_id, 2)
    _steady_steps(rig, run_id, 1, range(1, 4))
    stuck = rig.hosts["a"].job(run_id, 1)
    rig.clock.advance(61)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "restarting" and run.retries_used == 1 and run.attempt == 2
    assert run.message.startswith("retry 1 of 1: attempt 1 stalled: step 3 has not advanced for 61s")
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and not stuck.alive and rig.hosts["a"].job(run_id, 2).alive
    assert run.attempts[1].spec == run.attempts[0].spec, "the same spec: the job resumes from its checkpoint"
    _steady_steps(rig, run_id, 2, range(3, 5))
    rig.clock.advance(61)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.message.endswith("not restarted: no retries left (max_retries 1)")


def test_a_job_inventing_new_series_on_every_line_stops_at_the_runs_bound(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    host.write_metrics(host.job(run_id, 1), *({"step": i, **{f"s{i}_{k}": 1.0 for k in range(250)}}
                                              for i in range(1, 6)))
    rig.step(run_id)
    run = rig.run(run_id)
    invented = [name for name in run.latest if name.startswith("s") and name != "step"]
    assert run.status == "running" and 1000 < len(invented) <= 1024 and "s5_249" not in run.latest
    with rig.db.reading() as s:
        stored = s.query(MetricPoint.name).filter(MetricPoint.run_id == run_id, MetricPoint.name.like("s%"))
        assert stored.distinct().count() == len(invented)


def test_a_backlog_larger_than_the_room_the_store_has_is_stored_in_pieces_with_the_outcome_last(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a full disk, the lines the job wrote meanwhile and its outcome were stored in one transaction: a backlog
    larger than the room a refused write frees was refused whole for ever, the run left `running`. The reads halve
    while the store refuses, so the backlog goes in pieces that fit, each moving the offsets on."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from worker import attempt_io

    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    host.write_metrics(job, *({"step": i, "total_steps": 3000, "loss": 1.0 / i} for i in range(1, 3001)))
    host.finish(job, 0)
    room = 40_000  # bytes of metric lines one transaction may store
    real = attempt_io.store_metrics

    def full_disk(session, run, attempt, text, *args, **kwargs):  # noqa: ANN001, ANN202
        if len(text) > room:
            raise OperationalError("INSERT INTO metric_points", {}, sqlite3.OperationalError("database or disk is full"))
        return real(session, run, attempt, text, *args, **kwargs)

    monkeypatch.setattr(attempt_io, "store_metrics", full_disk)
    for _ in range(200):
        rig.step(run_id)
        if rig.run(run_id).status != "running":
            break
    assert rig.run(run_id).status == "succeeded"
    with rig.db.reading() as s:
        steps = [p.step for p in s.query(MetricPoint).filter_by(run_id=run_id, name="loss").order_by(MetricPoint.step)]
    assert steps == list(range(1, 3001)), "every line the job wrote, each once"
