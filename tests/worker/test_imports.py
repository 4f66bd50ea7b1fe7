"""The worker loads neither the web framework nor the trainer (docs/architecture.md: who imports whom)."""

import subprocess
import sys

from tests.service import ROOT


def test_the_worker_does_not_load_fastapi_or_the_trainer() -> None:
    """Of the trainer, only its series names (trainer/series.py, the standard library alone: docs/architecture.md)."""
    check = ("import sys, worker.supervisor; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in {'fastapi', 'starlette', 'trainer', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "['trainer', 'trainer.series']"
