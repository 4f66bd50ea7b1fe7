"""A workspace swapped for a symlink after the host was registered: the host agent, told the workspace's real path
from registration, resolves it again on the host at every launch and clean (and before it installs itself) and
refuses, writing nothing, where it now leads elsewhere. Real processes on this machine; the symlinks lead to a
temporary directory, never to the real /."""

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.service import Service, kill_leftovers
from worker.host_agent import HostAgent
from worker.host_errors import CommandFailed
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest

JOB = [sys.executable, "-c", "print('ran')"]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _swap(ws: Path, outside: Path) -> None:
    """What another user of the host does after registration: the workspace put aside, a symlink in its place."""
    os.rename(ws, ws.with_name("ws.moved"))
    os.symlink(outside, ws)


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path, str]:
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    return ws, outside, os.path.realpath(ws)


def test_a_workspace_swapped_before_the_agent_was_installed_is_refused_and_nothing_is_written(
        places: tuple[Path, Path, str]) -> None:
    ws, outside, registered = places
    _swap(ws, outside)
    agent = HostAgent(LocalTransport(), str(ws), sys.executable, registered_real=registered)
    with pytest.raises(CommandFailed) as refused:
        agent.launch(LaunchRequest(agent.layout.attempt_dir("r", 1), "t", JOB, {}))
    message = str(refused.value)
    assert f"{ws}/.longrun/bin" in message and f"leads to {outside}" in message and registered in message, message
    assert _tree(outside) == [], "the agent was not installed there, nor anything else written"


def test_a_workspace_swapped_for_one_where_the_agent_is_installed_is_refused_at_launch_and_clean(
        places: tuple[Path, Path, str]) -> None:
    """The agent installed at the symlink's target already (another workspace of the same host): the launch and
    the clean themselves refuse."""
    ws, outside, registered = places
    agent = HostAgent(LocalTransport(), str(ws), sys.executable, registered_real=registered)
    agent.launch(LaunchRequest(agent.layout.attempt_dir("r", 1), "t", JOB, {}))  # before the swap: it goes ahead
    shutil.copytree(ws / ".longrun" / "bin", outside / ".longrun" / "bin")
    (outside / "out").mkdir()
    (outside / "out" / "precious").write_text("keep")
    before = _tree(outside)
    _swap(ws, outside)
    with pytest.raises(CommandFailed, match=f"launch: refusing to write under {ws}: it leads to {outside}"):
        agent.launch(LaunchRequest(agent.layout.attempt_dir("r", 2), "t2", JOB, {}))
    with pytest.raises(CommandFailed, match=f"clean: refusing to write under {ws}: it leads to {outside}"):
        agent.clean(str(ws / "out"))
    assert _tree(outside) == before and (outside / "out" / "precious").read_text() == "keep"


def test_a_records_directory_swapped_for_a_symlink_out_of_the_workspace_is_refused_at_launch(
        places: tuple[Path, Path, str]) -> None:
    ws, outside, registered = places
    agent = HostAgent(LocalTransport(), str(ws), sys.executable, registered_real=registered)
    agent.launch(LaunchRequest(agent.layout.attempt_dir("r", 1), "t", JOB, {}))
    shutil.copytree(ws / ".longrun" / "bin", outside / "bin")
    os.symlink(outside, ws / ".longrun" / "r2")
    before = _tree(outside)
    with pytest.raises(CommandFailed, match=f"refusing to write under {ws}/.longrun/r2/1: it leads to {outside}/1"):
        agent.launch(LaunchRequest(agent.layout.attempt_dir("r2", 1), "t2", JOB, {}))
    assert _tree(outside) == before


@pytest.mark.slow
def test_a_run_on_a_workspace_swapped_after_registration_fails_naming_it_and_writes_nothing_there(
        tmp_path: Path) -> None:
    """The `local` host of a real `longrun serve`: its workspace resolved once the worker reached it, then swapped
    for a symlink to another directory; the next run fails at its launch, saying where the workspace leads."""
    svc = Service(tmp_path / "home")
    svc.home.mkdir()
    svc.start()
    try:
        deadline = time.time() + 120
        while not (host := svc.client.get("/v1/hosts/local").json())["workspace_real"]:
            assert time.time() < deadline, f"the worker did not resolve the local workspace: {host}"
            time.sleep(0.1)
        assert host["workspace_real"] == os.path.realpath(svc.workspace)
        outside = tmp_path / "outside"
        outside.mkdir()
        shutil.rmtree(svc.workspace)
        os.symlink(outside, svc.workspace)
        run = svc.submit({"name": "moved", "host": "local", "entrypoint": "/opt/train.py", "nproc_per_node": 1})
        done = svc.wait_status(run["id"], "failed", "succeeded")
        assert done["status"] == "failed", done
        assert f"refusing to install the host agent under {svc.workspace}/.longrun/bin" in done["message"]
        assert f"leads to {outside}" in done["message"], done["message"]
        assert _tree(outside) == []
    finally:
        svc.stop()
        kill_leftovers(svc.workspace)
