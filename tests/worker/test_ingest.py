import json
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.db import Database
from server.models import Attempt, Event, LogChunk, MetricPoint, Run, utcnow
from worker.attempt_io import probe_nodes, store_probes
from worker.host_agent import HostAgent
from worker.ingest import store_metrics
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest


def test_replaying_the_same_lines_stores_nothing_twice(db: Database) -> None:
    lines = "".join(json.dumps({"step": i, "total_steps": 3, "time": 1000.0 + i, "loss": 1.0 / i, "acc_0": 0.5})
                    + "\n" for i in range(1, 4))
    with db.writing() as s:
        run = Run(id="r", name="r", status="running", spec={}, hosts=["local"], latest={})
        s.add(run)
        s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    for _ in range(2):
        # a crash after storing but before the offset was saved: the same bytes come again
        with db.writing() as s:
            run, attempt = s.get(Run, "r"), s.query(Attempt).one()
            store_metrics(s, run, attempt, lines)
            attempt.metrics_lines = 0
    with db.reading() as s:
        points = s.query(MetricPoint).filter_by(name="loss").order_by(MetricPoint.step).all()
        assert [p.step for p in points] == [1, 2, 3]
        assert s.query(MetricPoint).count() == 6
        run = s.get(Run, "r")
        assert run.latest["step"] == 3 and run.latest["total_steps"] == 3


def test_garbage_lines_keep_their_place(db: Database) -> None:
    text = '{"step": 1, "loss": 2.0}\nnot json\n{"step": 2, "loss": NaN}\n{"step": 3, "loss": 1.5}\n'
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec={}, hosts=["local"], latest={}))
        s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    with db.writing() as s:
        assert store_metrics(s, s.get(Run, "r"), s.query(Attempt).one(), text) == 4
    with db.reading() as s:
        assert [(p.line, p.step) for p in s.query(MetricPoint).order_by(MetricPoint.line)] == [(0, 1), (3, 3)]
        assert s.query(Attempt).one().metrics_lines == 4


# what a real job wrote, read by the host agent in its largest reads and stored as the worker stores probes

LOG_JOB = """
import os, sys, time
for i in range(int(sys.argv[1])):
    print(f"step {i}/{sys.argv[1]} loss {1 + i % 7 * 0.125:.3f} " + "x" * (200 + i % 97))
sys.stdout.flush()
while not os.path.exists(sys.argv[2]):  # then it waits: its log is read while it runs
    time.sleep(0.01)
"""
METRICS_JOB = """
import json, os, sys, time
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    # a line half written, holding a raw carriage return, while the worker reads
    f.write('{"step": 0, "note": "a\\r'); f.flush()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    f.write('b", "loss": 2.0}\\n')
    for i in range(1, int(sys.argv[1])):
        f.write(json.dumps({"step": i, "loss": 1 + i % 7 * 0.125, "pad": "x" * (250 + i % 97)}) + "\\n")
"""


def _add_attempt(db: Database, spec: dict, directory: str) -> None:
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec=spec, hosts=["local"], latest={}, attempt=1))
        s.add(Attempt(run_id="r", number=1, spec=spec, token="t", metrics_lines=0,
                      nodes=[{"host": "local", "dir": directory, "state": "running"}]))


def _drain(db: Database, agent: HostAgent, until_ended: bool = True) -> int:
    """Probe and store until the node has ended and nothing is left to read; returns the reads made."""
    reads, deadline = 0, time.time() + 120
    while time.time() < deadline:
        with db.writing() as s:
            run, attempt = s.get(Run, "r"), s.query(Attempt).one()
            probes = probe_nodes(SimpleNamespace(agent=lambda host: agent), attempt, {"local": None})
            store_probes(s, run, attempt, probes, utcnow())
        reads += 1
        answer = probes[0].answer
        if not until_ended or (answer.state != "running" and not answer.more):
            return reads
        if answer.state == "running" and not answer.more:
            time.sleep(0.05)
    raise AssertionError("the job did not end within 120 s")


def _steps(db: Database) -> list[int]:
    with db.reading() as s:
        return [p.step for p in s.query(MetricPoint).filter_by(name="loss").order_by(MetricPoint.line)]


def test_a_log_of_many_largest_reads_loses_no_line_at_their_boundaries(db: Database, tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("r", 1)
    n = 36_000  # about 9 MiB of log: two boundaries of the host's 4 MiB reads, each inside a line
    go = tmp_path / "go"
    _add_attempt(db, {"entrypoint": "/opt/train.py", "host": "local"}, d)
    agent.launch(LaunchRequest(d, "t", [sys.executable, "-c", LOG_JOB, str(n), str(go)], {}))
    deadline = time.time() + 60
    while not (Path(d) / "output.log").exists() or (Path(d) / "output.log").stat().st_size < 9_000_000:
        assert time.time() < deadline
        time.sleep(0.05)
    # the whole log written before the first read: every read but the last is a full one (read while the job
    # runs: once it is over, records are read from the log's last 4 MiB only, tests/worker/test_attempt_reads.py)
    reads = 0
    while reads < 3:
        reads += _drain(db, agent, until_ended=False)
    go.touch()
    _drain(db, agent)
    assert _steps(db) == list(range(n))


def test_metric_lines_across_read_boundaries_and_one_half_written_with_a_raw_cr_are_all_stored(
        db: Database, tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("r", 1)
    n = 30_000  # about 9 MiB of metric lines
    go = tmp_path / "go"
    _add_attempt(db, {"entrypoint": "/opt/train.py", "host": "local"}, d)
    agent.launch(LaunchRequest(d, "t", [sys.executable, "-c", METRICS_JOB, str(n), str(go)], {}))
    deadline = time.time() + 30
    while not (Path(d) / "metrics.jsonl").exists() or not (Path(d) / "metrics.jsonl").stat().st_size:
        assert time.time() < deadline, (Path(d) / "output.log").read_text()
        time.sleep(0.01)
    _drain(db, agent, until_ended=False)  # the first line is still being written
    go.touch()
    _drain(db, agent)
    assert _steps(db) == list(range(n))
    with db.reading() as s:
        assert s.query(Attempt).one().metrics_lines == n


TRUNCATING_JOB = """
import json, os, sys, time
path = os.environ["LONGRUN_METRICS_FILE"]
with open(path, "a") as f:
    for i in range(10):
        f.write(json.dumps({"step": i, "loss": 1.0}) + "\\n")
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
with open(path, "w") as f:  # written anew: truncated, and shorter than what was read
    for i in range(10, 15):
        f.write(json.dumps({"step": i, "loss": 0.5}) + "\\n")
"""


def _run_in_two_halves(db: Database, tmp_path: Path, job: str, first_half_stored, *args: str) -> None:
    """Run `job` (its argv[1]: a file it waits for between its two halves) and store what it writes: its first
    half read and stored (`first_half_stored()` true) before it goes on, then everything until it has ended."""
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("r", 1)
    go = tmp_path / "go"
    _add_attempt(db, {"entrypoint": "/opt/train.py", "host": "local"}, d)
    agent.launch(LaunchRequest(d, "t", [sys.executable, "-c", job, str(go), *args], {}))
    deadline = time.time() + 30
    while not first_half_stored():
        assert time.time() < deadline
        _drain(db, agent, until_ended=False)
    go.touch()
    _drain(db, agent)


def test_a_metrics_file_the_job_truncates_is_read_again_from_its_start_and_said(db: Database, tmp_path: Path) -> None:
    _run_in_two_halves(db, tmp_path, TRUNCATING_JOB, lambda: len(_steps(db)) >= 10)
    assert _steps(db) == list(range(15)), "none of the lines written after the truncation is lost"
    with db.reading() as s:
        events = [e.data for e in s.query(Event).filter_by(run_id="r", kind="file_truncated")]
    assert len(events) == 1 and events[0]["file"] == "metrics.jsonl" and "truncated" in events[0]["message"]


def test_lines_without_a_time_give_the_step_rate_of_the_reads_that_bring_them(db: Database) -> None:
    """A job stepping every 0.5 s, read every 2 s, writing no `time`: 0.5 s per step (before: 2 s, each read's
    first line taking the whole read as one step)."""
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec={}, hosts=["local"], latest={}, attempt=1))
        s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    start = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    for read in range(5):
        lines = "".join(json.dumps({"step": step, "total_steps": 100, "loss": 1.0}) + "\n"
                        for step in range(4 * read, 4 * read + 4))
        with db.writing() as s:
            store_metrics(s, s.get(Run, "r"), s.query(Attempt).one(), lines, start + timedelta(seconds=2 * read))
    with db.reading() as s:
        attempt = s.query(Attempt).one()
        assert abs(attempt.sec_per_step - 0.5) < 0.5 * 0.15, attempt.sec_per_step
        assert attempt.last_step == 19


REWRITING_JOB = """
import json, os, sys, time
path = os.environ["LONGRUN_METRICS_FILE"]
def lines(first):
    return "".join(json.dumps({"step": i, "loss": 1.0}) + "\\n" for i in range(first, first + 10))
with open(path, "a") as f:
    f.write(lines(10))
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
if sys.argv[2] == "rewrite":  # written anew with as many bytes as were read: no shorter than the offset
    with open(path, "w") as f:
        f.write(lines(20))
else:  # a longer copy of it renamed over it: a new inode, the same bytes where the read stood
    with open(path + ".tmp", "w") as f:
        f.write(lines(10) + lines(20))
    os.replace(path + ".tmp", path)
"""


@pytest.mark.parametrize("how", ["rewrite", "replace"])
def test_a_metrics_file_the_job_writes_anew_at_the_same_length_is_read_again_and_said(
        db: Database, tmp_path: Path, how: str) -> None:
    _run_in_two_halves(db, tmp_path, REWRITING_JOB, lambda: len(_steps(db)) >= 10, how)
    assert _steps(db) == list(range(10, 30)), "every line written anew stored once, none of the first doubled"
    with db.reading() as s:
        events = [e.data for e in s.query(Event).filter_by(run_id="r", kind="file_rewritten")]
    if how == "rewrite":
        assert len(events) == 1 and events[0]["file"] == "metrics.jsonl" and events[0]["how"] == "rewritten"
        assert "wrote metrics.jsonl anew" in events[0]["message"]
    else:
        assert events == [], "a copy holding what was read and more is read on, not again"


LOG_TRUNCATING_JOB = """
import os, sys, time
for i in range(5):
    print(f"before {i}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
open(os.path.join(os.environ["LONGRUN_ATTEMPT_DIR"], "output.log"), "w").close()  # stdout appends: it goes on at 0
for i in range(3):
    print(f"after {i}", flush=True)
"""


def test_a_log_the_job_truncates_is_read_again_stored_after_the_rest_and_said(db: Database, tmp_path: Path) -> None:
    _run_in_two_halves(db, tmp_path, LOG_TRUNCATING_JOB, lambda: _log(db).endswith("before 4\n"))
    assert _log(db) == "".join(f"before {i}\n" for i in range(5)) + "".join(f"after {i}\n" for i in range(3))
    with db.reading() as s:
        events = [e.data for e in s.query(Event).filter_by(run_id="r", kind="file_truncated")]
    assert len(events) == 1 and events[0]["file"] == "output.log" and events[0]["offset"] == 45


def _log(db: Database) -> str:
    with db.reading() as s:
        return "".join(c.text for c in s.query(LogChunk).filter_by(run_id="r").order_by(LogChunk.offset))
