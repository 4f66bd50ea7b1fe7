"""An attempt's start and end come from its host's clock, set against the server's: an estimate a few
milliseconds off is held inside what the server knows, so one attempt never ends after the next one starts."""

from datetime import UTC, datetime, timedelta

from server.lifecycle import AttemptNode
from server.models import Attempt
from worker.attempt_io import _job_times
from worker.protocol import HostTimes

OPENED = datetime(2026, 12, 3, 8, 11, 12, tzinfo=UTC)


def times(attempt: Attempt, started: float, ended: float | None, host_now: float, now: datetime):
    return _job_times(attempt, AttemptNode(host="h", dir="/w/a"), HostTimes(started, ended, host_now), now)


def test_a_start_mapped_just_before_the_attempt_was_opened_is_taken_as_its_opening() -> None:
    attempt = Attempt(created_at=OPENED)
    now = OPENED + timedelta(seconds=10)
    # the host's clock 3 ms behind what the offset estimate says: the start maps before the attempt existed
    started, ran = times(attempt, OPENED.timestamp() - 0.003, None, now.timestamp(), now)
    assert started == OPENED.timestamp() and ran is None


def test_an_end_mapped_just_past_now_is_taken_as_now_and_one_far_off_not_at_all() -> None:
    attempt = Attempt(created_at=OPENED)
    now = OPENED + timedelta(seconds=10)
    start = OPENED.timestamp() + 1
    started, ran = times(attempt, start, now.timestamp() + 0.003, now.timestamp(), now)
    assert started == start and started + ran == now.timestamp()
    assert times(attempt, start, now.timestamp() + 3600, now.timestamp(), now)[1] is None
    assert times(attempt, OPENED.timestamp() - 3600, None, now.timestamp(), now)[0] is None


def test_a_start_mapped_before_the_previous_attempt_ended_is_taken_as_that_end() -> None:
    """A restart opens attempt 2 before attempt 1 is stopped, and a batch job's StartTime is in whole seconds: the
    start it maps to can fall before attempt 1's recorded end (19:26:41.048 against 19:26:41.305 on a Slurm run).
    Attempt 2 launched only once attempt 1 had stopped, so its start is held to that end."""
    from server.models import Run

    run = Run(id="r", attempts=[])
    first = Attempt(number=1, created_at=OPENED, ended_at=OPENED + timedelta(seconds=30.305))
    second = Attempt(number=2, created_at=OPENED + timedelta(seconds=20))
    run.attempts.extend([first, second])
    now = OPENED + timedelta(seconds=40)
    slurm_start = (OPENED + timedelta(seconds=30)).timestamp()  # whole seconds, before attempt 1's end
    started, _ = times(second, slurm_start, None, now.timestamp(), now)
    assert started == first.ended_at.timestamp()
    assert first.ended_at.timestamp() <= started


def test_an_attempt_never_ends_after_a_later_attempt_of_its_run_started() -> None:
    from server.lifecycle import AttemptStatus, end_attempt
    from server.models import Run

    run = Run(id="r", attempts=[])
    first = Attempt(number=1, created_at=OPENED, status="running")
    second = Attempt(number=2, created_at=OPENED, started_at=OPENED + timedelta(seconds=30))
    run.attempts.extend([first, second])
    end_attempt(first, AttemptStatus.CANCELLED, None, "stopped", OPENED + timedelta(seconds=30.3))
    assert first.ended_at == second.started_at
