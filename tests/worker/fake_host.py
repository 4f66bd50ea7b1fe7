"""An in-memory host: a Transport that answers the host agent's verbs (worker/hostside/) from a model of processes and files.

It reads the very command HostAgent sends (`... exec python -S hostside-… VERB`, the request on stdin), so the worker's
client, protocol and services run unchanged; only the host is imagined. Tests drive the host with
`write_metrics`, `finish`, `vanish`, `go_down` and `hold_gpu`.
"""

import itertools
import json
import posixpath
import shlex
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from server.layout import HostLayout
from server.models import Host
from worker.clock import Clock
from worker.host_agent import RESOLVE
from worker.host_errors import HostError, HostUnreachable
from worker.transport_interface import CommandResult, Transport
from worker.transport_pool import TransportPool


class FakeClock(Clock):
    def __init__(self) -> None:
        self._now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
        self._monotonic = 1000.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._monotonic += seconds

    def jump(self, seconds: float) -> None:
        """The wall clock set forward or back (NTP, a person): the monotonic clock does not move."""
        self._now += timedelta(seconds=seconds)


@dataclass
class FakeJob:
    dir: str
    token: str
    argv: list[str]
    env: dict[str, str]
    pids: list[int]
    alive: bool = True
    exit_code: int | None = None
    metrics: str = ""
    log: str = ""
    # a cancel does not get rid of it (processes stuck in uninterruptible sleep)
    stubborn: bool = False
    # its wrapper died (killed, OOM) while the job's processes (pids[1:]) still run
    orphaned: bool = False


@dataclass
class GpuHolder:
    pid: int
    gpu: int
    user: str
    token: str | None = None


@dataclass
class FakeHost(Transport):
    name: str
    workspace: str = "/ws"
    gpus: int = 0
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    holders: list[GpuHolder] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    up: bool = True
    # raised instead of answering (a refused key, say); None answers
    refuse: HostError | None = None
    # answered instead of the verb's answer (a broken or hostile host); None answers
    garble: str | None = None
    # how many calls answer `garble` before the host answers right again (None: every call while it is set)
    garble_left: int | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # where a workspace's symlinks lead on this host (a workspace not named here is its own real path)
    real_paths: dict[str, str] = field(default_factory=dict)
    _pids: Any = field(default_factory=lambda: itertools.count(4000))

    # what a test does to the host

    def job(self, run_id: str, attempt: int, node: int = 0) -> FakeJob:
        return self.jobs[HostLayout(self.workspace).attempt_dir(run_id, attempt, node)]

    def write_metrics(self, job: FakeJob, *lines: dict[str, Any]) -> None:
        job.metrics += "".join(json.dumps(line) + "\n" for line in lines)

    def finish(self, job: FakeJob, exit_code: int) -> None:
        job.alive, job.exit_code = False, exit_code
        job.log += f"exited {exit_code}"  # the last line has no newline: handed out once the job is over

    def vanish(self, job: FakeJob) -> None:
        job.alive = False

    def kill_wrapper(self, job: FakeJob) -> None:
        job.alive, job.orphaned = False, True

    def go_down(self) -> None:
        self.up = False

    def come_back(self) -> None:
        self.up = True

    def hold_gpu(self, gpu: int, user: str = "alice") -> GpuHolder:
        holder = GpuHolder(next(self._pids), gpu, user)
        self.holders.append(holder)
        return holder

    def verbs(self) -> list[str]:
        return [verb for verb, _ in self.calls]

    # the Transport interface

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        self.round_trips += 1
        if not self.up:
            raise HostUnreachable(f"connection to {self.name} refused")
        if self.refuse is not None:
            raise self.refuse
        if RESOLVE in (argv := shlex.split(command)):  # the workspace's real path, asked with nothing installed
            workspace = argv[-1]
            self.calls.append(("workspace", {"workspace": workspace}))
            return CommandResult(0, json.dumps({"real": self.real_paths.get(workspace, workspace)}) + "\n", "")
        verb = shlex.split(command.split("; then exec ", 1)[1].split(";", 1)[0])[-1]
        request = json.loads((stdin or b"").split(b"\n", 1)[0])
        self.calls.append((verb, request))
        if self.garble is not None and self.garble_left != 0:
            if self.garble_left is not None:
                self.garble_left -= 1
            return CommandResult(0, self.garble, "")
        answer = getattr(self, f"_{verb}")(request)
        return CommandResult(2 if "error" in answer else 0, json.dumps(answer) + "\n", "")

    # the verbs, as worker/hostside/ answers them

    def _launch(self, req: dict[str, Any]) -> dict[str, Any]:
        if req["dir"] in self.jobs:
            return {"pid": self.jobs[req["dir"]].pids[0], "already": True}
        job = FakeJob(req["dir"], req["token"], req["argv"], req["env"], [next(self._pids), next(self._pids)])
        self.jobs[req["dir"]] = job
        return {"pid": job.pids[0], "already": False}

    def _status(self, d: str) -> dict[str, Any]:
        job = self.jobs.get(d)
        if job is None:
            return {"state": "missing", "exit_code": None, "pid": None}
        if job.exit_code is not None:
            return {"state": "exited", "exit_code": job.exit_code, "pid": job.pids[0]}
        return {"state": "running" if job.alive else "lost", "exit_code": None, "pid": job.pids[0]}

    def _probe(self, req: dict[str, Any]) -> dict[str, Any]:
        out = self._status(req["dir"])
        job = self.jobs.get(req["dir"])
        if job is not None and job.orphaned:
            # as the host agent: a dead wrapper's processes are stopped before the node is answered lost
            job.orphaned = job.stubborn
            out.update(stopped=job.pids[1:], remaining=job.pids[1:] if job.stubborn else [])
        left = (job.metrics if job else "")[req["metrics_offset"]:]
        limit = int(req.get("limit", 4 << 20))
        metrics = left[:limit]  # as the agent: at most `limit` of the file an answer, `more` when it cut
        metrics = metrics[: metrics.rfind("\n") + 1]
        log = (job.log if job else "")[req["log_offset"]:]
        if out["state"] == "running":
            log = log[: log.rfind("\n") + 1]
        out.update(metrics=metrics, metrics_offset=req["metrics_offset"] + len(metrics), log=log,
                   log_offset=req["log_offset"] + len(log), more=len(left) > limit)
        if req.get("gpus"):
            out["gpus"] = self._gpus(req["gpus"])
        return out

    def _cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(req["dir"])
        signalled = list(job.pids) if job and (job.alive or job.orphaned) else []
        if job and (job.alive or job.orphaned) and not job.stubborn:
            job.alive = job.orphaned = False
            job.exit_code = 137 if job.exit_code is None else job.exit_code
        remaining = list(job.pids) if job and (job.alive or job.orphaned) else []
        out: dict[str, Any] = {"remaining": remaining, "signalled": signalled,
                               "exit_code": job.exit_code if job else None}
        if req.get("gpus") and not remaining:
            out["gpus"] = self._gpus(req["gpus"])
        if req.get("probe") is not None:
            out["probe"] = self._probe({**req["probe"], "dir": req["dir"]})
        return out

    def _clean(self, req: dict[str, Any]) -> dict[str, Any]:
        path, workspace, records = req["path"], req["workspace"], req["records"]
        if not path.startswith(workspace + "/") or path == records or path.startswith(records + "/"):
            return {"error": f"refusing to clean {path}: outside the workspace or longrun's records"}
        kept = []
        if req.get("keep_into"):
            self.files.add(posixpath.join(req["keep_into"], "model.safetensors"))
            kept = ["model.safetensors"]
        removed = [f for f in self.files if f.startswith(path + "/")]
        self.files -= set(removed)
        return {"removed": len(removed), "kept": kept}

    def _gpus(self, req: dict[str, Any]) -> dict[str, Any]:
        if not self.gpus:
            missing = {"rc": 127, "stdout": "", "stderr": "nvidia-smi: not found"}
            return {"gpu": missing, "apps": missing, "owners": {}}
        uuid = [f"GPU-{i:04d}" for i in range(self.gpus)]
        gpu_csv = "".join(f"{i}, {uuid[i]}, NVIDIA H200, 0, 0, 143771\n" for i in range(self.gpus))
        apps_csv = "".join(f"{h.pid}, {uuid[h.gpu]}, 20000, python3\n" for h in self.holders)
        tokens = set(req.get("tokens", []))
        owners = {str(h.pid): {"user": h.user, "token": h.token if h.token in tokens else None} for h in self.holders}
        return {"gpu": {"rc": 0, "stdout": gpu_csv, "stderr": ""}, "apps": {"rc": 0, "stdout": apps_csv, "stderr": ""},
                "owners": owners}


class FakeTransports(TransportPool):
    """A TransportPool whose transports are FakeHosts, by host name."""

    def __init__(self, *hosts: FakeHost):
        super().__init__()
        self.hosts = {h.name: h for h in hosts}

    def get(self, host: Host) -> Transport:
        return self.hosts[host.name]
