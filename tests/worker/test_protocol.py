"""The host protocol's two ends agree: the worker's typed requests are what the host agent (worker/hostside/)
reads, and its answers read back as the typed answers; the attempt layout's file names are the ones it writes;
it ships as one zipapp named by its content, unpacked on the host once."""

import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from server import layout
from worker.host_agent import (
    ANSWER_TRIES,
    HOSTSIDE_NAME,
    HOSTSIDE_ZIPAPP,
    MAX_ANSWER_BYTES,
    HostAgent,
    hostside_zipapp,
)
from worker.host_errors import AnswerLost, CommandFailed, HostUnreachable
from worker.hostside import files as hostside_files
from worker.local_transport import LocalTransport
from worker.protocol import (
    CancelRequest,
    GpuQuery,
    HostTimes,
    InterconnectRequest,
    LaunchRequest,
    ProbeAnswer,
    ProbeRequest,
    ReadFrom,
)
from worker.transport_interface import CommandResult, Transport


def test_the_layouts_file_names_are_the_ones_the_host_side_writes() -> None:
    assert (layout.LOG_FILE, layout.METRICS_FILE) == (hostside_files.LOG_FILE, hostside_files.METRICS_FILE)
    host = layout.HostLayout("/data/ws/")
    assert host.attempt_dir("r1", 2) == "/data/ws/.longrun/r1/2"
    assert host.attempt_dir("r1", 2, node=1) == "/data/ws/.longrun/r1/2/node1"
    assert host.holds_records_of(host.draft_stash("r1", 3), "r1")
    assert not host.holds_records_of("/data/ws/.longrun/r10/x", "r1")


def test_requests_go_on_the_wire_with_hostsides_field_names() -> None:
    assert ProbeRequest("/d", 3, 4, GpuQuery(["t"])).to_wire() == {
        "dir": "/d", "metrics_offset": 3, "log_offset": 4,
        "gpus": {"tokens": ["t"]}, "metrics_identity": None, "log_identity": None, "limit": 4 << 20}
    assert CancelRequest("/d", 2.0, ReadFrom(1, 2)).to_wire()["probe"] == {
        "metrics_offset": 1, "log_offset": 2, "metrics_identity": None, "log_identity": None}
    # the agent owns its command lines: no request carries one for it to run
    sweep = InterconnectRequest(tp=2, sweep_path="/w/.longrun/bin/sweep.py", sweep_source="print()").to_wire()
    assert set(sweep) == {"tp", "sweep_path", "sweep_source", "sizes", "timeout"}


def test_the_agent_ships_as_one_zipapp_named_by_its_content_and_installs_compiled_once(tmp_path: Path) -> None:
    assert hostside_zipapp() == HOSTSIDE_ZIPAPP, "the same code builds the same bytes"
    assert HOSTSIDE_NAME == f"hostside-{hashlib.sha256(HOSTSIDE_ZIPAPP).hexdigest()[:12]}"
    agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable)
    agent.probe(agent.layout.attempt_dir("r1", 1), ReadFrom())
    installed = Path(agent.script)
    with zipfile.ZipFile(io.BytesIO(HOSTSIDE_ZIPAPP)) as shipped:
        assert {p.relative_to(installed).as_posix() for p in installed.rglob("*.py")} == set(shipped.namelist())
        assert all((installed / name).read_bytes() == shipped.read(name) for name in shipped.namelist())
    assert not list(installed.parent.glob(f"{HOSTSIDE_NAME}.*")), "no staging directory is left behind"
    # installed, it runs alone with -S: no site-packages, nothing of the worker on its path; its bytecode is cached
    # beside it even where the environment says not to write any, so the next call compiles nothing
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-S", "-I", str(installed), "probe"], input='{"dir": "/nonexistent/x"}\n',
                          capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert json.loads(done.stdout)["state"] == "missing", done.stderr
    cached = {p.name.split(".")[0] for p in (installed / "hostside" / "__pycache__").glob("*.pyc")}
    assert {"agent", "attempt", "files", "launch"} <= cached


def test_two_first_calls_at_once_install_one_agent_and_both_answer(tmp_path: Path) -> None:
    agents = [HostAgent(LocalTransport(), str(tmp_path), sys.executable) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda a: a.probe(a.layout.attempt_dir("r1", 1), ReadFrom()), agents))
    assert [a.state for a in answers] == ["missing"] * 4
    assert sorted(p.name for p in Path(agents[0].layout.bin_dir).iterdir()) == [HOSTSIDE_NAME]


def test_a_probe_of_a_directory_never_launched_answers_missing(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable)
    answer = agent.probe(agent.layout.attempt_dir("r1", 1), ReadFrom())
    assert answer.times is not None and (answer.times.started, answer.times.ended) == (None, None)
    assert replace(answer, times=None) == ProbeAnswer(state="missing", exit_code=None, pid=None, metrics="", metrics_offset=0, log="",
                                 log_offset=0, more=False)


def test_launch_answers_the_typed_launch_answer(tmp_path: Path) -> None:
    agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable)
    d = agent.layout.attempt_dir("r1", 1)
    first = agent.launch(LaunchRequest(d, "tok-proto", [sys.executable, "-c", "pass"], {}))
    assert first.already is False and first.pid > 0
    assert agent.launch(LaunchRequest(d, "tok-proto", [sys.executable, "-c", "pass"], {})).pid == first.pid


class Answering(Transport):
    """A host that answers every command with the same text."""

    def __init__(self, stdout: str, returncode: int = 0):
        self.result = CommandResult(returncode, stdout, "")

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        return self.result


PROBE = {"state": "running", "exit_code": None, "pid": 7, "metrics": "", "metrics_offset": 0, "log": "",
         "log_offset": 0, "more": False}


@pytest.mark.parametrize(("stdout", "says"), [
    ("[1, 2]\n", "probe: the host answered list, not a JSON object"),
    ("x" * (MAX_ANSWER_BYTES + 1), f"more than the {MAX_ANSWER_BYTES}"),
    ('{"state": "running"}\n', "probe: the host's answer is not of the expected shape (KeyError"),
    ('{"state": "asleep", "exit_code": null}\n', "not of the expected shape"),
    (json.dumps({**PROBE, "metrics_offset": "12"}), "metrics_offset is str, not int"),
    (json.dumps({**PROBE, "more": 1}), "more is int, not bool"),
    (json.dumps({**PROBE, "gpus": {"gpu": [], "apps": {}}}), "expected a JSON object, got list"),
    (json.dumps({**PROBE, "stopped": ["1"]}), "stopped holds something other than pids"),
])
def test_a_host_answer_of_another_shape_is_a_command_failed_naming_the_verb(stdout: str, says: str) -> None:
    with pytest.raises(CommandFailed) as raised:
        HostAgent(Answering(stdout), "/ws").probe("/ws/.longrun/r/1", ReadFrom())
    assert says in str(raised.value)


class AnsweringInTurn(Transport):
    """A host that answers each command with the next of its answers (the last one for ever)."""

    def __init__(self, *answers: tuple[int, str]):
        self.answers = list(answers)
        self.calls = 0

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        self.calls += 1
        returncode, stdout = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return CommandResult(returncode, stdout, "")


@pytest.mark.parametrize("lost", [(0, ""), (0, "NOT JSON\n"), (-9, '{"state": "running", "exit_co')])
def test_an_answer_that_did_not_come_back_whole_is_asked_again(lost: tuple[int, str]) -> None:
    host = AnsweringInTurn(lost, (0, json.dumps(PROBE) + "\n"))
    assert HostAgent(host, "/ws").probe("/ws/.longrun/r/1", ReadFrom()).pid == 7
    assert host.calls == 2


def test_an_agent_that_keeps_answering_nothing_readable_is_a_host_away_not_a_refusal() -> None:
    host = AnsweringInTurn((0, "NOT JSON\n"))
    with pytest.raises(AnswerLost) as raised:
        HostAgent(host, "/ws").probe("/ws/.longrun/r/1", ReadFrom())
    assert isinstance(raised.value, HostUnreachable) and host.calls == ANSWER_TRIES
    assert str(raised.value) == (f"probe: no readable answer from the host agent (exit 0): 'NOT JSON' "
                                 f"({ANSWER_TRIES} tries in a row)")
    with pytest.raises(CommandFailed, match="exit 127"):  # a python that cannot run is not asked again
        HostAgent(AnsweringInTurn((127, "")), "/ws").probe("/ws/.longrun/r/1", ReadFrom())


def test_a_cancel_answer_without_its_verdict_is_not_taken_for_nothing_left() -> None:
    with pytest.raises(CommandFailed, match="KeyError"):
        HostAgent(Answering('{"signalled": [1]}\n'), "/ws").cancel("/ws/.longrun/r/1", 1.0)


def test_a_hosts_times_of_another_shape_are_dropped_not_believed() -> None:
    assert HostTimes.from_wire({"started": 10.0, "ended": 12.5, "now": 13}) == HostTimes(10.0, 12.5, 13)
    assert HostTimes.from_wire({"started": "10", "ended": float("nan"), "now": 13.0}) == HostTimes(None, None, 13.0)
    assert HostTimes.from_wire({"started": 10.0, "ended": True, "now": None}) is None
    assert HostTimes.from_wire(["10"]) is None
