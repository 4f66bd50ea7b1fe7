"""Which package may import which (docs/architecture.md): checked on every module, in a fresh interpreter."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def loaded_after_importing(package: str) -> set[str]:
    """Top-level packages in sys.modules after importing every module of `package`."""
    code = (f"import importlib, pkgutil, sys, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_server_never_imports_the_worker_or_the_trainer() -> None:
    loaded = loaded_after_importing("server")
    assert "worker" not in loaded and "trainer" not in loaded and "torch" not in loaded


def test_the_worker_does_not_load_the_web_framework() -> None:
    loaded = loaded_after_importing("worker")
    assert not loaded & {"fastapi", "starlette", "uvicorn", "longrun"}


def test_the_client_needs_neither_server_nor_worker() -> None:
    code = "import sys, longrun.client; print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    assert not loaded & {"server", "worker", "trainer", "fastapi", "sqlalchemy"}
