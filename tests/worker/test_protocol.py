"""The host protocol's two ends agree: the worker's typed requests are what hostside.py reads, and its answers
read back as the typed answers; the attempt layout's file names are the ones hostside.py writes."""

import sys
from pathlib import Path

from server import layout
from worker import hostside
from worker.host_agent import HostAgent
from worker.protocol import CancelRequest, GpuQuery, LaunchRequest, ProbeAnswer, ProbeRequest, ReadFrom
from worker.transport import LocalTransport


def test_the_layouts_file_names_are_the_ones_the_host_side_writes() -> None:
    assert (layout.LOG_FILE, layout.METRICS_FILE) == (hostside.LOG_FILE, hostside.METRICS_FILE)
    host = layout.HostLayout("/data/ws/")
    assert host.attempt_dir("r1", 2) == "/data/ws/.longrun/r1/2"
    assert host.attempt_dir("r1", 2, node=1) == "/data/ws/.longrun/r1/2/node1"
    assert host.holds_records_of(host.draft_stash("r1", 3), "r1")
    assert not host.holds_records_of("/data/ws/.longrun/r10/x", "r1")


def test_requests_go_on_the_wire_with_hostsides_field_names() -> None:
    assert ProbeRequest("/d", 3, 4, GpuQuery(["t"])).to_wire() == {
        "dir": "/d", "metrics_offset": 3, "log_offset": 4,
        "gpus": {"tokens": ["t"], "query_gpu": GpuQuery(["t"]).query_gpu, "query_apps": GpuQuery(["t"]).query_apps}}
    assert CancelRequest("/d", 2.0, ReadFrom(1, 2)).to_wire()["probe"] == {"metrics_offset": 1, "log_offset": 2}


def test_a_probe_of_a_directory_never_launched_answers_missing(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable)
    answer = agent.probe(agent.layout.attempt_dir("r1", 1), ReadFrom())
    assert answer == ProbeAnswer(state="missing", exit_code=None, pid=None, metrics="", metrics_offset=0, log="",
                                 log_offset=0, more=False)


def test_launch_answers_the_typed_launch_answer(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable)
    d = agent.layout.attempt_dir("r1", 1)
    first = agent.launch(LaunchRequest(d, "tok-proto", [sys.executable, "-c", "pass"], {}))
    assert first.already is False and first.pid > 0
    assert agent.launch(LaunchRequest(d, "tok-proto", [sys.executable, "-c", "pass"], {})).pid == first.pid
