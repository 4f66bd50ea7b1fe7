"""The worker's view of a host: each method is one call of worker/hostside.py over a transport.

The agent script installs itself on first use (content-addressed under <workspace>/.longrun/bin),
inside the same single command, so every action stays one round trip.
"""

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.gpus import QUERY_APPS_CMD, QUERY_GPU_CMD, GpuSnapshot, attach_users, snapshot_from_outputs
from worker.transport import Transport, TransportError

HOSTSIDE_SOURCE = (Path(__file__).parent / "hostside.py").read_bytes()
HOSTSIDE_NAME = f"hostside-{hashlib.sha256(HOSTSIDE_SOURCE).hexdigest()[:12]}.py"


@dataclass
class GpuView:
    """A GPU snapshot plus which of its processes carry which attempt token."""

    snapshot: GpuSnapshot
    token_of: dict[int, str]

    def pids_of(self, tokens: set[str]) -> set[int]:
        return {pid for pid, token in self.token_of.items() if token in tokens}


def gpu_view(answer: dict[str, Any]) -> GpuView:
    g, a = answer["gpu"], answer["apps"]
    snapshot = snapshot_from_outputs(g["rc"], g["stdout"], a["stdout"], g["stderr"] + a["stderr"], apps_rc=a["rc"])
    owners = {int(pid): o for pid, o in answer.get("owners", {}).items()}
    attach_users(snapshot, {pid: o["user"] for pid, o in owners.items()})
    return GpuView(snapshot, {pid: o["token"] for pid, o in owners.items() if o.get("token")})


class AgentError(Exception):
    """The host answered, but the action was refused or failed there."""


class HostAgent:
    def __init__(self, transport: Transport, workspace: str, python: str = "python3",
                 timeout: float = 120.0):
        self.transport = transport
        self.workspace = workspace.rstrip("/") or "/"
        self.python = python
        self.timeout = timeout
        self.script = f"{self.workspace}/.longrun/bin/{HOSTSIDE_NAME}"

    def attempt_dir(self, run_id: str, attempt: int, node: int = 0) -> str:
        base = f"{self.workspace}/.longrun/{run_id}/{attempt}"
        return base if node == 0 else f"{base}/node{node}"

    def call(self, verb: str, payload: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        script, bindir = shlex.quote(self.script), shlex.quote(str(Path(self.script).parent))
        run = shlex.join([self.python, self.script, verb, json.dumps(payload)])
        command = (f"[ -f {script} ] || {{ mkdir -p {bindir} && cat > {script}.$$ && mv {script}.$$ {script}; }}"
                   f" && exec {run}")
        result = self.transport.exec(command, stdin=HOSTSIDE_SOURCE, timeout=timeout or self.timeout)
        try:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            if result.returncode == 255:
                raise TransportError(result.stderr.strip() or "connection lost") from None
            raise AgentError(f"{verb} failed on the host (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout).strip()[-2000:]}") from None
        if "error" in answer:
            raise AgentError(answer["error"])
        return answer

    def launch(self, directory: str, token: str, argv: list[str], env: dict[str, str],
               cwd: str | None = None, node_address: str | None = None) -> dict[str, Any]:
        """Start the job detached; `node_address` (multi-node runs) is where the other nodes reach this host."""
        return self.call("launch", {"dir": directory, "token": token, "argv": argv, "env": env, "cwd": cwd,
                                    "node_address": node_address})

    def probe(self, directory: str, metrics_offset: int, log_offset: int,
              gpu_tokens: list[str] | None = None) -> dict[str, Any]:
        """Status, new metric lines and log text; with gpu_tokens also a GPU snapshot, in the same round trip."""
        req: dict[str, Any] = {"dir": directory, "metrics_offset": metrics_offset, "log_offset": log_offset}
        if gpu_tokens is not None:
            req["gpus"] = self._gpu_request(gpu_tokens)
        return self.call("probe", req)

    def cancel(self, directory: str, grace: float, read_from: dict[str, int] | None = None,
               gpu_tokens: list[str] | None = None) -> dict[str, Any]:
        """Stop the attempt and verify; in the same round trip, with `read_from` (metrics_offset, log_offset)
        a last probe (answer["probe"]), with gpu_tokens a GPU snapshot once nothing remains (answer["gpus"])."""
        req: dict[str, Any] = {"dir": directory, "grace": grace}
        if read_from is not None:
            req["probe"] = read_from
        if gpu_tokens is not None:
            req["gpus"] = self._gpu_request(gpu_tokens)
        return self.call("cancel", req, timeout=grace + self.timeout)

    def clean(self, path: str, keep_into: str | None = None) -> dict[str, Any]:
        """Empty `path` (inside the workspace); with keep_into, move the exported draft there first."""
        return self.call("clean", {"workspace": self.workspace, "path": path, "keep_into": keep_into})

    def pids(self, token: str) -> list[int]:
        return self.call("pids", {"token": token})["pids"]

    @staticmethod
    def _gpu_request(tokens: list[str]) -> dict[str, Any]:
        return {"query_gpu": QUERY_GPU_CMD, "query_apps": QUERY_APPS_CMD, "tokens": tokens}

    def gpus(self, tokens: list[str]) -> GpuView:
        return gpu_view(self.call("gpus", self._gpu_request(tokens)))
