"""A rank of a user's own script that raised without torch elastic's @record leaves no error file: torchrun's summary
shows only torch's placeholder link, and `logs --rank N` shows that rank's last traceback found in the node's log
instead, saying where it came from and how to have the file recorded.

The logs are real torchrun 2.13 output of tests/faults/job_raises_unrecorded.py (2 ranks, `--standalone`): plain
(as longrun launches it), with a gloo process group (torch's `[rank1]: ` prefix) and with `--tee 3`
(`[default1]:`)."""

from pathlib import Path

import pytest

from server import tracebacks

LOGS = Path(__file__).parents[1] / "fixtures" / "torchrun_logs"
EXCEPTION = "ValueError: shard 1: 3 columns, expected 4"


def shown(text: str, rank: int = 1, node: int = 0) -> str:
    failures = tracebacks.parse_summary(text)
    failure = next(f for f in failures if f.rank == rank)
    return tracebacks.from_log_if_unrecorded(text, failure, failures, node).traceback


@pytest.mark.parametrize(("log", "how"), [
    ("unrecorded_plain.log", "the last traceback before torchrun's summary; its lines carry no rank"),
    ("unrecorded_group.log", "its own lines, by their rank prefix"),
    ("unrecorded_tee.log", "its own lines, by their rank prefix"),
])
def test_the_ranks_own_traceback_is_found_in_the_log_said_where_from_and_how_to_record_it(log, how):
    text = (LOGS / log).read_text()
    summary = tracebacks.parse_summary(text)
    assert [(f.rank, f.traceback) for f in summary if f.rank == 1] == [
        (1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")]  # what it showed before
    lines = shown(text).splitlines()
    assert lines[0] == f"(rank 1 recorded no error file; from node 0's log: {how})"
    assert lines[1] == "Traceback (most recent call last):"
    assert any("load_shard(rank)" in line for line in lines) and lines[-2] == EXCEPTION
    assert not any(line.startswith("[") or "torch/distributed/run.py" in line for line in lines[1:-1]), lines
    assert "@record" in lines[-1] and "torch.distributed.elastic.multiprocessing.errors import record" in lines[-1]
    # rank 0 was stopped by torchrun: its summary line is what it is, not a traceback of another rank
    assert shown(text, rank=0).startswith("Signal 15 (SIGTERM) received by PID")


def test_a_recorded_traceback_is_kept_as_recorded():
    text = (LOGS / "unrecorded_plain.log").read_text().replace(
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "Traceback (most recent call last):\n    raise KeyError('x')\n  KeyError: 'x'")
    assert shown(text) == "Traceback (most recent call last):\n  raise KeyError('x')\nKeyError: 'x'"


def test_two_unprefixed_ranks_raising_are_said_to_be_told_apart_by_nothing():
    text = (LOGS / "unrecorded_plain.log").read_text()
    text = text.replace("  exitcode  : -15 (pid:", "  exitcode  : 1 (pid:").replace(
        "  traceback : Signal 15 (SIGTERM) received by PID",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n  ignored")
    assert "; ranks 0 raised too, so it may be theirs)" in shown(text).splitlines()[0]


def test_a_log_without_a_traceback_says_so_and_how_to_record_one():
    text = (LOGS / "unrecorded_plain.log").read_text()
    start = text.index("Traceback (most recent call last):")
    end = text.index(EXCEPTION) + len(EXCEPTION)
    note = shown(text[:start] + text[end:])
    assert note.startswith("rank 1 recorded no error file (torchrun's summary: 'To enable traceback see: https://")
    assert "holds no traceback before the summary" in note and "@record" in note
