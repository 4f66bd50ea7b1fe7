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
