"""A failed run says why: the exception its first failed rank recorded (torch elastic's error file), with that
rank, in the API and in `longrun status`, and each failed rank's traceback in `longrun logs --rank N`; real
server, real torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server import tracebacks
from tests.service import ROOT, Service, attempt_processes
from worker import failure_cause

JOB = Path(__file__).parents[1] / "faults" / "job_raises_in_rank1.py"
UNRECORDED_JOB = Path(__file__).parents[1] / "faults" / "job_raises_unrecorded.py"
CAUSE = "rank 1 raised FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/shard-00001.bin'"


def failed_run(service: Service, name: str, job: Path) -> tuple[dict, dict]:
    """(the run as submitted, as it ended: failed) of `job` on 2 ranks."""
    run = service.submit({"name": name, "host": "local", "nproc_per_node": 2, "entrypoint": str(job), "args": []})
    done = service.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=120)
    assert done["status"] == "failed"
    return run, done


@pytest.mark.slow  # a real server and torchrun
def test_logs_rank_shows_the_traceback_a_rank_without_record_printed(service: Service) -> None:
    """A user's own script whose main is not @record'ed: torchrun's summary holds only torch's placeholder link; the
    rank's own traceback is shown from its log, with where it came from and how to record it."""
    run, done = failed_run(service, "unrecorded", UNRECORDED_JOB)
    # the run's message (the API, `status`, the page) says what raised, where, and where the whole traceback is
    for message in (done["message"], done["attempts"][0]["message"]):
        assert message.startswith("attempt 1 exited with code 1 on local: rank 1 raised ValueError: shard 1: 3 "
                                  "columns, expected 4 at "), message
        assert "job_raises_unrecorded.py:11 in load_shard" in message
        assert "`longrun logs unrecorded --rank 1` has the whole traceback" in message, message
    status = subprocess.run([sys.executable, "-m", "longrun.cli", "status", "unrecorded"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LONGRUN_URL": service.url, "COLUMNS": "400"})
    assert "rank 1 raised ValueError: shard 1: 3 columns, expected 4" in status.stdout, status.stdout
    shown = subprocess.run([sys.executable, "-m", "longrun.cli", "logs", "unrecorded", "--rank", "1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env={**os.environ, "LONGRUN_URL": service.url})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1] == ("(rank 1 recorded no error file; from node 0's log: the last traceback before torchrun's "
                        "summary; its lines carry no rank)"), shown.stdout
    assert lines[2] == "Traceback (most recent call last):" and "load_shard(rank)" in shown.stdout
    assert lines[-2] == "ValueError: shard 1: 3 columns, expected 4", shown.stdout
    assert "@record" in lines[-1] and "errors.html" not in shown.stdout


@pytest.mark.slow  # a real server and torchrun
def test_a_run_that_raises_in_rank_1_shows_the_exception_and_the_rank(service: Service) -> None:
    run, done = failed_run(service, "raises", JOB)
    assert done["message"] == f"attempt 1 exited with code 1 on local: {CAUSE}", done["message"]
    assert done["attempts"][0]["message"] == f"attempt 1 exited with code 1 on local: {CAUSE}"
    assert attempt_processes(done, 1) == []
    shown = subprocess.run([sys.executable, "-m", "longrun.cli", "status", "raises"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "LONGRUN_URL": service.url})
    assert shown.returncode == 0, shown.stderr
    assert "FileNotFoundError" in shown.stdout and "rank 1" in shown.stdout, shown.stdout
    # the rank's traceback, as it recorded it (@record): `longrun logs --rank 1`
    shown = subprocess.run([sys.executable, "-m", "longrun.cli", "logs", "raises", "--rank", "1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env={**os.environ, "LONGRUN_URL": service.url})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "attempt 1, rank 1 on node 0 (the first to fail):", shown.stdout
    assert lines[1] == "Traceback (most recent call last):", shown.stdout
    assert 'with open("/nonexistent/shard-00001.bin", "rb"):' in shown.stdout
    assert lines[-1] == CAUSE.removeprefix("rank 1 raised "), shown.stdout
    assert "Root Cause" not in shown.stdout and "exitcode" not in shown.stdout, "the traceback alone"
    failed = service.client.get(f"/v1/runs/{run['id']}/traceback", params={"rank": 0}).json()
    assert (failed["rank"], failed["root_cause"]) == (0, False) and "SIGTERM" in failed["traceback"], failed
    unknown = subprocess.run([sys.executable, "-m", "longrun.cli", "logs", "raises", "--rank", "3"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "LONGRUN_URL": service.url})
    assert unknown.returncode == 5, unknown.stderr
    assert "rank 3 did not fail in attempt 1" in unknown.stderr and "failed: rank 0, 1" in unknown.stderr


def test_a_ranks_traceback_is_read_from_torchruns_last_failure_summary_only() -> None:
    summary = (FIXTURE_SUMMARY.replace("RANK", "7").replace("ERROR", "ValueError: shard 7")
               .replace("OTHER", "5"))
    fake = summary.replace("ValueError: shard 7", "printed by the job")
    failures = tracebacks.parse_summary("step 1\n" + fake + "step 2\n" + summary)
    assert [(f.rank, f.root_cause) for f in failures] == [(5, False), (7, True)]
    assert failures[1].traceback == ("Traceback (most recent call last):\n  File \"train.py\", line 3, in main\n"
                                     "    raise ValueError('shard 7')\n\nValueError: shard 7")
    assert failures[0].traceback == "Signal 15 (SIGTERM) received by PID 41"
    assert tracebacks.parse_summary("Traceback (most recent call last):\nValueError: no torchrun\n") == []


FIXTURE_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_06:28:09
  host      : gpu-box
  rank      : OTHER (local_rank: 0)
  exitcode  : -15 (pid: 41)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 41
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_06:28:09
  host      : gpu-box
  rank      : RANK (local_rank: 1)
  exitcode  : 1 (pid: 42)
  error_file: /tmp/torchelastic_x/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "train.py", line 3, in main
      raise ValueError('shard 7')
~~
  ERROR
~~
============================================================
""".replace("~~", "  ")  # torchrun indents a traceback's blank lines too


def test_a_cause_is_read_only_from_what_torch_elastic_wrote() -> None:
    error = ('{"message": {"message": "ValueError: bad [red]x[/red]", "extraInfo": {"py_callstack": "Traceback '
             '(most recent call last):\\n  ...\\nValueError: bad", "timestamp": "1"}, "errorCode": 1}}')
    tail = "Root Cause (first observed failure):\n[0]:\n  time      : ...\n  rank      : 3 (local_rank: 1)\n"
    assert failure_cause.cause({"error_file": error, "log_tail": tail}) == "rank 3 raised ValueError: bad [red]x[/red]"
    assert failure_cause.cause({"error_file": error, "log_tail": ""}) == "a rank raised ValueError: bad [red]x[/red]"
    assert failure_cause.traceback_of(error).startswith("Traceback")
    for junk in (None, "", "{", "[]", '{"message": "x"}', '{"message": {"message": 3}}'):
        assert failure_cause.cause({"error_file": junk, "log_tail": tail}) is None
    assert failure_cause.cause(None) is None
    long = failure_cause.cause({"error_file": error.replace("bad", "b" * 2000), "log_tail": tail})
    assert len(long) <= len("rank 3 raised ") + failure_cause.MAX_CHARS


LOGS = Path(__file__).parents[1] / "fixtures" / "torchrun_logs"


@pytest.mark.parametrize("log", ["unrecorded_plain", "unrecorded_group", "unrecorded_tee"])
def test_without_record_the_cause_is_the_failing_ranks_last_traceback_lines_from_its_log(log: str) -> None:
    """torchrun's summary says only "To enable traceback see: ..." for a main not wrapped in @record: the cause comes
    from the rank's own lines in the log (by prefix, or the last traceback before the summary)."""
    tail = (LOGS / f"{log}.log").read_text()
    said = failure_cause.cause({"error_file": None, "log_tail": tail}, "my-run")
    assert said.startswith("rank 1 raised ValueError: shard 1: 3 columns, expected 4 at "), said
    assert 'job_raises_unrecorded.py:11 in load_shard: raise ValueError(f"shard {rank}: 3 columns, expected 4")' in said
    assert said.endswith("[from its log: wrap main in @record for torchrun to record it; `longrun logs my-run "
                         "--rank 1` has the whole traceback]"), said
    assert "errors.html" not in said and "ChildFailedError" not in said, "torchrun's own words are not the cause"


def test_a_job_without_torchrun_or_a_traceback_gets_its_own_or_none() -> None:
    one = ("step 1\nTraceback (most recent call last):\n  File \"job.py\", line 3, in <module>\n"
           "    batch['labels']\nKeyError: 'labels'\n")
    assert failure_cause.cause({"error_file": None, "log_tail": one}, "r") == (
        "the job raised KeyError: 'labels' at job.py:3 in <module>: batch['labels'] [from its log: `longrun logs r` "
        "has the whole traceback]")
    assert failure_cause.cause({"error_file": None, "log_tail": "step 1\nKilled\n"}, "r") is None
    signalled = FIXTURE_SUMMARY.replace("RANK", "1").replace("OTHER", "0").replace("ERROR", "x").replace(
        "Traceback (most recent call last):\n    File \"train.py\", line 3, in main\n      raise ValueError('shard 7')",
        "Signal 9 (SIGKILL) received by PID 42")
    assert failure_cause.cause({"error_file": None, "log_tail": signalled}, "r") is None
    huge = one.replace("'labels'", "'" + "l" * 3000 + "'")
    said = failure_cause.cause({"error_file": None, "log_tail": huge}, "r")
    assert len(said) <= failure_cause.MAX_CHARS and said.endswith("has the whole traceback]")
