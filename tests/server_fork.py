"""`longrun serve` and `longrun worker` for the tests, forked from a process that has imported them once.

A server's start was about 1 CPU-s, 0.8 of it imports (FastAPI, pydantic, SQLAlchemy, Alembic, uvicorn), and the
integration lane alone starts about 70. `Forks` is a process of the test's own (one per pytest process, started on
first use) that imports what `longrun serve` imports and then only forks: each child takes the environment, working
directory and argv it is given, points stdout and stderr at its log and runs `python -m longrun.cli ...` as the
interpreter would (`runpy`, then the interpreter's own exit: atexit handlers, flushed streams, and an exit by
signal where uvicorn re-raises SIGTERM), as gunicorn's preload does for its workers. What differs from an exec is
what the imports left in memory, and `/proc/PID/cmdline` and `/proc/PID/environ`, which show the forking process's.

The child is the forking process's, not the test's: `Forked` stands in for `subprocess.Popen` (pid, poll, wait,
terminate, kill, send_signal, returncode), asking the forking process for the child's exit status.

Run as a script it is the forking process: requests are JSON lines on stdin, answers JSON lines on stdout.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Forks:
    """The forking process, talked to over its stdin and stdout (one request at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True, bufsize=1)
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the forking process ended (its stderr is the test's)")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def spawn(self, args: list[str], env: dict[str, str], cwd: Path, log: Path) -> "Forked":
        """`python -m longrun.cli ARGS` in `cwd` with exactly `env`, stdout and stderr appended to `log`."""
        answer = self._ask({"op": "spawn", "args": args, "env": env, "cwd": str(cwd), "log": str(log)})
        return Forked(self, answer["pid"], args)

    def status(self, pid: int) -> int | None:
        return self._ask({"op": "status", "pid": pid})["returncode"]


class Forked:
    """A forked child, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, forks: Forks, pid: int, args: list[str]):
        self._forks, self.pid, self.args = forks, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._forks.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)  # the forking process reaps it only when asked: the pid stays this child's

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve() -> dict[str, Any]:
    """The forking process's loop; returns, in a child only, the request it was forked for."""
    # what `longrun serve` and `longrun worker` import, imported once here
    import uvicorn  # noqa: F401

    import longrun.cli  # noqa: F401
    import longrun.processes  # noqa: F401
    import server.api.app  # noqa: F401
    import server.hosts  # noqa: F401
    import worker.supervisor  # noqa: F401

    exited: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    return request
                answer: dict[str, Any] = {"pid": pid}
            else:
                pid = request["pid"]
                if pid not in exited:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        exited[pid] = os.waitstatus_to_exitcode(status)
                answer = {"returncode": exited.get(pid)}
        except Exception as exc:  # noqa: BLE001 - said to the test, which raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    sys.exit(0)


def _become(request: dict[str, Any]) -> None:
    """In the child: the process `python -m longrun.cli ARGS` would be, up to the module's run."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
    sys.argv = [sys.executable, *request["args"]]


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # not tests/, which `python -m longrun.cli` would not have on its path
    forked_for = _serve()
    _become(forked_for)
    import runpy

    runpy.run_module("longrun.cli", run_name="__main__", alter_sys=True)
