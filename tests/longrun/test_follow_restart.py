"""`longrun watch` and `logs -f` outlive a server restart: they follow the run's event stream, wait for the
server with backoff while it is away, resume after the last event and end with the run's real outcome."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.service import ROOT, Service, toy_spec

pytestmark = pytest.mark.slow


def follower(service: Service, *args: str) -> subprocess.Popen:
    # unbuffered bytes: readline() then takes one line off the pipe and communicate() gets all the rest (a text
    # pipe's readline buffers what came with that line, and communicate reads past that buffer)
    return subprocess.Popen([sys.executable, "-m", "longrun.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0, env={**os.environ, "LONGRUN_URL": service.url})


def test_watch_and_logs_follow_survive_a_server_restart_and_end_with_the_outcome(service: Service,
                                                                                   tmp_path: Path) -> None:
    run = service.submit(toy_spec(steps=60, sleep=0.15, nproc=1))
    service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 3, what="a few steps")
    watch = follower(service, "watch", run["id"], "--json", "--interval", "0.3")
    logs = follower(service, "logs", run["id"], "-f", "--json", "--interval", "0.3", "--tail", "10000")
    try:
        first = json.loads(watch.stdout.readline())
        assert first["status"] == "running"
        first_log = json.loads(logs.stdout.readline())
        assert first_log["attempt"] == 1  # both have reached the server
        service.kill()  # a crash: no shutdown hook; the job goes on on its host
        time.sleep(2)
        assert watch.poll() is None and logs.poll() is None, "a follower gave up while the server was away"
        service.start()
        out, err = (b.decode() for b in watch.communicate(timeout=120))
        log_out, log_err = (b.decode() for b in logs.communicate(timeout=60))
    finally:
        watch.kill()
        logs.kill()
    assert watch.returncode == 0, err
    snapshots = [first, *map(json.loads, out.splitlines())]
    assert snapshots[-1]["status"] == "succeeded" and snapshots[-1]["latest"]["step"] == 60
    assert "reconnecting" in err
    assert logs.returncode == 0, log_err
    lines = [first_log["line"], *(json.loads(line)["line"] for line in log_out.splitlines())]
    # the job's progress lines (every 20th step; the whole log, so a slow start of `logs -f` misses none), the one
    # written while the server was away included, once each
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["20/60", "40/60", "60/60"]
