"""The unit lane's own rule: no test in it starts a process."""

import subprocess
import sys

import pytest

from tests.unit.conftest import StartedAProcess


def test_a_unit_test_that_starts_a_process_fails() -> None:
    with pytest.raises(StartedAProcess, match="tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"])
