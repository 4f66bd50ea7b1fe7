"""A real `longrun serve` process for tests: its own LONGRUN_HOME (local workspace, SQLite file unless given a
database) and port."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.server_fork import Forked, Forks

ROOT = Path(__file__).resolve().parent.parent
TOY = str(ROOT / "examples" / "toy_train.py")
# a stdlib `torch.distributed.run` (tests/stubrun): toy jobs started through it skip the real launcher's torch import
STUBRUN = str(ROOT / "tests" / "stubrun")
STUB_ENV = {"PYTHONPATH": STUBRUN}  # the `env` of a spec whose job is stdlib only


FORKS = Forks()  # this pytest process's forking process, started on first use


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, home: Path, token: str | None = None, database_url: str | None = None, **settings: Any):
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the worker's tick at its default, 1 s: each tick asks the host agent about every running attempt (a python
        # process on the `local` host, about 0.03 CPU-s) and stores what the attempt wrote; a server running a toy job
        # took 0.125 CPU-s a second at a 0.5 s tick, 0.07 at 1 s (docs/benchmarks.md)
        self.env = {**os.environ, "LONGRUN_HOME": str(home), "LONGRUN_PORT": str(self.port),
                    "LONGRUN_CANCEL_GRACE": "5", "LONGRUN_LEASE_SECONDS": "3"}
        self.env.pop("LONGRUN_POLL_INTERVAL", None)
        self.env.pop("LONGRUN_DATABASE_URL", None)
        self.env.pop("LONGRUN_API_TOKEN", None)
        if database_url:
            self.env["LONGRUN_DATABASE_URL"] = database_url
        if token:
            self.env["LONGRUN_API_TOKEN"] = token
        self.env.update({f"LONGRUN_{k.upper()}": str(v) for k, v in settings.items()})
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        self.proc: subprocess.Popen | None = None
        self.started_once = False

    def _move_to(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.env["LONGRUN_PORT"] = str(port)
        self.client.base_url = self.url

    @property
    def workspace(self) -> Path:
        return self.home / "workspace"

    def start(self, worker: bool = True) -> "Service":
        # `python -m longrun.cli serve`, forked from a process that imported it once (tests/server_fork.py)
        self.proc = FORKS.spawn(["serve"] + ([] if worker else ["--no-worker"]), self.env, ROOT,
                                self.home / "server.log")
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                said = (self.home / "server.log").read_text()[-3000:]
                if not self.started_once and "address already in use" in said.rsplit("serving on", 1)[-1]:
                    # free_port's port was taken (as some connection's source port) before the server bound it: a
                    # first start takes another; a restart keeps its URL, which the test may hold
                    self._move_to(free_port())
                    return self.start(worker)
                raise RuntimeError(f"server exited: {said}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    self.started_once = True
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def submit(self, spec: dict[str, Any], expect: int = 201, **kwargs: Any) -> dict[str, Any]:
        """Submit `spec`; a name a live run has gets a suffix (NAME-2) unless `params` say otherwise."""
        kwargs.setdefault("params", {"name_suffix": "true"})
        r = self.client.post("/v1/runs", json=spec, **kwargs)
        assert r.status_code == expect, r.text
        return r.json()

    def run(self, run_id: str) -> dict[str, Any]:
        r = self.client.get(f"/v1/runs/{run_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, run_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 120,
             what: str = "condition") -> dict[str, Any]:
        deadline = time.time() + timeout
        run = self.run(run_id)
        while time.time() < deadline:
            run = self.run(run_id)
            if until(run):
                return run
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; run is {run['status']}: {run.get('message')}\n"
                             f"server log tail:\n{(self.home / 'server.log').read_text()[-3000:]}")

    def wait_status(self, run_id: str, *statuses: str, timeout: float = 120) -> dict[str, Any]:
        return self.wait(run_id, lambda r: r["status"] in statuses, timeout, f"status in {statuses}")

    def series(self, run_id: str, name: str, **params: Any) -> list[dict[str, Any]]:
        r = self.client.get(f"/v1/runs/{run_id}/metrics", params={"names": name, **params})
        assert r.status_code == 200, r.text
        return r.json()["series"].get(name, [])

    def events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's stored events, as the SSE stream replays them (it ends once the run is over)."""
        text = self.client.get(f"/v1/runs/{run_id}/events").text
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]

    def logs(self, run_id: str, **params: Any) -> list[str]:
        r = self.client.get(f"/v1/runs/{run_id}/logs", params=params)
        assert r.status_code == 200, r.text
        return r.json()["lines"]


def start_worker(svc: Service, name: str) -> Forked:
    """A `longrun worker` process on the service's database and LONGRUN_HOME, logging to <home>/<name>.log."""
    return FORKS.spawn(["worker"], svc.env, ROOT, svc.home / f"{name}.log")


def stop_processes(processes: list[subprocess.Popen | Forked]) -> None:
    """SIGTERM, and SIGKILL for any still there 10 s later."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def toy_spec(steps: int = 40, sleep: float = 0.05, nproc: int = 2, real_torchrun: bool = False,
             **extra: Any) -> dict[str, Any]:
    """The toy job as a run spec, started by the stand-in launcher of tests/stubrun unless `real_torchrun` (or an
    `env` of the caller's own, which replaces the spec's)."""
    args = ["--steps", str(steps), "--sleep", str(sleep)] + extra.pop("args", [])
    env = {} if real_torchrun else STUB_ENV
    return {"name": "toy", "host": "local", "nproc_per_node": nproc, "entrypoint": TOY, "args": args,
            "env": {**env, **extra.pop("env", {})}, **extra}


def processes_with_env(needle: str, prefix: bool = False) -> list[int]:
    """Pids of live processes whose environment holds `needle` (e.g. LONGRUN_ATTEMPT_DIR=...), or with
    prefix=True an entry starting with it."""
    found = []
    want = needle.encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if any(v.startswith(want) for v in env) if prefix else want in env:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (where no init reaps orphans, the killed stay listed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_leftovers(workspace: Path) -> None:
    """After a test, no job it started may keep running (a failed test must not leak CPU hogs)."""
    for pid in processes_with_env(f"LONGRUN_ATTEMPT_DIR={workspace}", prefix=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def attempt_processes(run: dict[str, Any], number: int) -> list[int]:
    attempt = next(a for a in run["attempts"] if a["number"] == number)
    return [p for node in attempt["nodes"] for p in processes_with_env(f"LONGRUN_ATTEMPT_DIR={node['dir']}")]


@contextmanager
def attempts_overlap(service: Service, run_id: str) -> Iterator[list[tuple[list[int], list[int]]]]:
    """While inside, sample the run's attempt 1 and 2 processes; the list yielded collects every moment both had
    live processes (a restart must stop attempt 1 before attempt 2 starts)."""
    overlap: list[tuple[list[int], list[int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            r = service.run(run_id)
            one = attempt_processes(r, 1)
            two = attempt_processes(r, 2) if r["attempt"] == 2 and r["attempts"][-1]["nodes"] else []
            if one and two:
                overlap.append((one, two))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield overlap
    finally:
        stop.set()
        sampler.join()


def use_fake_gpus(svc: Service, state: Path) -> None:
    """Give the service tests/fakegpu's nvidia-smi (two H200s); `state` says who holds which GPU (see there)."""
    svc.env["PATH"] = f"{ROOT / 'tests' / 'fakegpu'}:{svc.env['PATH']}"
    svc.env["FAKE_GPU_STATE"] = str(state)


def serve_with_fake_gpus(directory: Path, token: str | None = None, **settings: Any) -> Iterator[tuple[Service, Path]]:
    """For a fixture: a started service under `directory` with the fake nvidia-smi, and its GPU state file;
    stopped, and its jobs killed, after."""
    state = directory / "gpus.json"
    svc = Service(directory / "home", token=token, **settings)
    use_fake_gpus(svc, state)
    svc.home.mkdir()
    svc.start()
    yield svc, state
    svc.stop()
    kill_leftovers(svc.workspace)
