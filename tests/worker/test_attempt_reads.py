"""Reading a finished attempt on this machine through the host agent, stored as the worker stores probes: the last
metrics line the job left without a newline, and a log far longer than the server keeps."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from server.db import Database
from server.models import Attempt, Event, LogChunk, MetricPoint, Run, utcnow
from server.queries import log_lines
from tests.worker.conftest import Rig
from worker.attempt_io import probe_nodes, store_probes
from worker.host_agent import HostAgent
from worker.hostside.files import LOG_KEPT_BYTES, READ_LIMIT
from worker.ingest import (
    LAST_METRIC_LINE_INVALID,
    LOG_METRICS_AFTER_END_BYTES,
    LOG_METRICS_PASSED,
    LOG_SKIPPED,
    MAX_STORED_LOG_BYTES,
)
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest, ProbeAnswer

LAST_LINE_JOB = """
import json, os, sys
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    for i in range(1, 20):
        f.write(json.dumps({"step": i, "loss": 1.0 / i}) + "\\n")
    f.write(sys.argv[1])  # the last line, without its newline
"""
# a log of argv[1] progress lines of 1 KiB each, written 16 MiB at a time, then a last line
BIG_LOG_JOB = """
import sys
n = int(sys.argv[1])
for block in range(0, n, 1 << 14):
    sys.stdout.buffer.write(b"".join((b"step %d/%d loss 0.500 " % (i, n)).ljust(1023, b"y") + b"\\n"
                                     for i in range(block, min(n, block + (1 << 14)))))
sys.stdout.buffer.write(b"the last line\\n")
"""


def _ended_attempt(db: Database, tmp_path: Path, program: str, *args: str) -> HostAgent:
    """A real attempt of `program` on this machine, waited for until its wrapper recorded its exit code."""
    agent = HostAgent(LocalTransport(), str(tmp_path / "ws"), sys.executable)
    d = agent.layout.attempt_dir("r", 1)
    spec = {"entrypoint": "/opt/train.py", "host": "local"}
    with db.writing() as s:
        s.add(Run(id="r", name="r", status="running", spec=spec, hosts=["local"], latest={}, attempt=1))
        s.add(Attempt(run_id="r", number=1, spec=spec, token="t", metrics_lines=0,
                      nodes=[{"host": "local", "dir": d, "state": "running"}]))
    agent.launch(LaunchRequest(d, "t", [sys.executable, "-c", program, *args], {}))
    deadline = time.time() + 120
    while not (Path(d) / "exit_code").exists():
        assert time.time() < deadline, "the job did not end within 120 s"
        time.sleep(0.05)
    return agent


def _drain(db: Database, agent: HostAgent) -> list[ProbeAnswer]:
    """Probe and store until nothing is left to read (the job has ended); returns every answer."""
    answers: list[ProbeAnswer] = []
    while not answers or answers[-1].more:
        assert len(answers) < 1000
        with db.writing() as s:
            run, attempt = s.get(Run, "r"), s.query(Attempt).one()
            probes = probe_nodes(SimpleNamespace(agent=lambda host: agent), attempt, {"local": None})
            store_probes(s, run, attempt, probes, utcnow())
        answers.append(probes[0].answer)
    assert answers[-1].state == "exited"
    return answers


def _events(db: Database, kind: str) -> list[dict]:
    with db.reading() as s:
        return [e.data for e in s.query(Event).filter_by(run_id="r", kind=kind)]


def test_a_last_metrics_line_without_a_newline_is_stored_once_the_job_has_ended(db: Database, tmp_path: Path) -> None:
    agent = _ended_attempt(db, tmp_path, LAST_LINE_JOB, json.dumps({"step": 20, "loss": 0.05}))
    _drain(db, agent)
    with db.reading() as s:
        assert [p.step for p in s.query(MetricPoint).filter_by(name="loss").order_by(MetricPoint.line)] == \
            list(range(1, 21)), "19 lines and the 20th, left without its newline"
        assert s.query(Attempt).one().metrics_lines == 20
    assert _events(db, LAST_METRIC_LINE_INVALID) == []
    _drain(db, agent)  # read again: nothing doubled
    with db.reading() as s:
        assert s.query(MetricPoint).filter_by(name="loss").count() == 20


def test_a_last_metrics_line_without_a_newline_that_is_not_json_is_said(db: Database, tmp_path: Path) -> None:
    agent = _ended_attempt(db, tmp_path, LAST_LINE_JOB, '{"step": 20, "loss": 0.0')
    _drain(db, agent)
    with db.reading() as s:
        assert s.query(MetricPoint).filter_by(name="loss").count() == 19
    said = _events(db, LAST_METRIC_LINE_INVALID)
    assert len(said) == 1 and said[0]["line"] == 20, said
    assert "line 20" in said[0]["message"] and "no newline" in said[0]["message"]
    assert '{"step": 20, "loss": 0.0' in said[0]["message"]


def test_a_log_far_longer_than_what_is_kept_is_read_from_its_kept_tail_once_the_job_has_ended(
        db: Database, tmp_path: Path) -> None:
    """256 MiB of log written at once: read whole at the probe's 4 MiB, that is 64 reads (the outcome waits on all
    of them, and on reading their records for metrics); only its last 64 MiB are kept, so only they are read, the
    records of their last 4 MiB only, and both are said."""
    assert LOG_KEPT_BYTES == MAX_STORED_LOG_BYTES, "the host skips to what the server keeps"
    n = 1 << 18
    agent = _ended_attempt(db, tmp_path, BIG_LOG_JOB, str(n))
    size = (Path(agent.layout.attempt_dir("r", 1)) / "output.log").stat().st_size
    assert size > 4 * LOG_KEPT_BYTES
    answers = _drain(db, agent)
    handed = sum(len(a.log) for a in answers)
    assert handed <= LOG_KEPT_BYTES, f"{handed} bytes of log read, more than the {LOG_KEPT_BYTES} kept"
    assert len(answers) <= LOG_KEPT_BYTES // READ_LIMIT + 1
    skipped = _events(db, LOG_SKIPPED)
    assert len(skipped) == 1, skipped
    assert skipped[0]["skipped"] == size - handed and skipped[0]["from"] == 0
    assert f"{size - handed} bytes" in skipped[0]["message"]
    with db.reading() as s:
        chunks = s.query(LogChunk).order_by(LogChunk.offset).all()
        assert chunks[0].offset == size - handed and chunks[-1].end == size
        assert all(a.end == b.offset for a, b in zip(chunks, chunks[1:], strict=False)), "no gap in what is kept"
        _, _, page = log_lines(s, "r", 1, 2, 0)
        lines, end, dropped = page.lines, page.next_offset, page.dropped
    assert lines[1] == "the last line" and lines[0].startswith(f"step {n - 1}/{n} ")
    assert end == size and dropped == size - handed
    with db.reading() as s:
        steps = [p.step for p in s.query(MetricPoint).filter_by(name="loss").order_by(MetricPoint.line)]
    # records of the log's last 4 MiB (1 KiB lines), the last step among them
    assert steps[-1] == n - 1 and len(steps) <= LOG_METRICS_AFTER_END_BYTES // 1024 + 1
    assert steps == list(range(n - len(steps), n)), "none of the records in the last 4 MiB lost"
    assert len(_events(db, LOG_METRICS_PASSED)) == 1


def test_a_job_that_is_over_with_its_files_still_being_read_is_read_again_at_once(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read after the job's end follows the last without waiting for the worker's next tick: the outcome waits
    only on the reads themselves."""
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    host.finish(host.job(run_id, 1), 0)
    answer, left = host._probe, [3]

    def drained_in_four_reads(req: dict[str, Any]) -> dict[str, Any]:
        out = answer(req)
        left[0], out["more"] = max(0, left[0] - 1), left[0] > 0
        return out

    monkeypatch.setattr(host, "_probe", drained_in_four_reads)
    assert run_id in rig.supervisor.claimer.run_once()
    assert [rig.supervisor.driver.step(run_id) for _ in range(4)] == [True, True, True, False]
    assert rig.run(run_id).status == "succeeded" and host.verbs().count("probe") == 4
