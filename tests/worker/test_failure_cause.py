"""A failed run says why: the exception its first failed rank recorded (torch elastic's error file), with that
rank, in the API and in `longrun status`; real server, real torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service import ROOT, Service, attempt_processes
from worker import failure_cause

pytestmark = pytest.mark.slow  # a real server and torchrun

JOB = Path(__file__).parents[1] / "faults" / "job_raises_in_rank1.py"
CAUSE = "rank 1 raised FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/shard-00001.bin'"


def test_a_run_that_raises_in_rank_1_shows_the_exception_and_the_rank(service: Service) -> None:
    run = service.submit({"name": "raises", "host": "local", "nproc_per_node": 2, "entrypoint": str(JOB),
                          "args": []})
    done = service.wait_status(run["id"], "failed", "succeeded", "cancelled", timeout=120)
    assert done["status"] == "failed"
    assert done["message"] == f"attempt 1 exited with code 1 on local: {CAUSE}", done["message"]
    assert done["attempts"][0]["message"] == f"attempt 1 exited with code 1 on local: {CAUSE}"
    assert attempt_processes(done, 1) == []
    shown = subprocess.run([sys.executable, "-m", "longrun.cli", "status", "raises"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ, "LONGRUN_URL": service.url})
    assert shown.returncode == 0, shown.stderr
    assert "FileNotFoundError" in shown.stdout and "rank 1" in shown.stdout, shown.stdout


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
