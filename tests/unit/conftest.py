"""The unit lane: in-process, SQLite, no subprocess. A test here that starts a process fails, naming what it ran:
a test that needs a server, sshd, torchrun or a job belongs in tests/integration (or the lane of its kind)."""

import subprocess

import pytest


class StartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, args, *rest, **kwargs):  # noqa: ANN001
        raise StartedAProcess(f"a unit test started a process: {args!r}; move the test to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
