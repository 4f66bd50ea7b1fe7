import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service import Service

# torch's worker threads spin while idle; on a small shared machine that starves the other processes
# (servers, torchrun ranks) a test starts, so every process the suite starts waits passively
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _kill_leftovers(workspace: Path) -> None:
    """After a test, no job it started may keep running (a failed test must not leak CPU hogs)."""
    prefix = f"LONGRUN_ATTEMPT_DIR={workspace}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(prefix) for v in env):
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "home")
    svc.home.mkdir()
    svc.start()
    yield svc
    svc.stop()
    _kill_leftovers(svc.workspace)
