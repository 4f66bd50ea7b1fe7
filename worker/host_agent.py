"""The worker's client of a host: each call sends one request of worker/protocol.py to worker/hostside.py
over a transport and reads its typed answer.

The agent script installs itself on first use (content-addressed under <workspace>/.longrun/bin),
inside the same single command, so every action stays one round trip.
"""

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from server.layout import HostLayout
from worker.host_errors import CommandFailed, HostUnreachable
from worker.protocol import (
    CancelAnswer,
    CancelRequest,
    CleanAnswer,
    CleanRequest,
    GpuQuery,
    GpusAnswer,
    GpusRequest,
    GpuView,
    LaunchAnswer,
    LaunchRequest,
    ProbeAnswer,
    ProbeRequest,
    ReadFrom,
    Request,
)
from worker.transport import Transport

HOSTSIDE_SOURCE = (Path(__file__).parent / "hostside.py").read_bytes()
HOSTSIDE_NAME = f"hostside-{hashlib.sha256(HOSTSIDE_SOURCE).hexdigest()[:12]}.py"
# ssh's own exit status when the connection failed: the host never ran the command
SSH_FAILED = 255


class HostAgent:
    def __init__(self, transport: Transport, workspace: str, python: str = "python3",
                 timeout: float = 120.0):
        self.transport = transport
        self.layout = HostLayout(workspace)
        self.python = python
        self.timeout = timeout
        self.script = f"{self.layout.bin_dir}/{HOSTSIDE_NAME}"

    def call(self, request: Request, timeout: float | None = None) -> Any:
        """Send `request`; its answer comes back as `request.answer`. Raises HostUnreachable, CommandFailed."""
        script, bindir = shlex.quote(self.script), shlex.quote(self.layout.bin_dir)
        run = shlex.join([self.python, self.script, request.verb, json.dumps(request.to_wire())])
        command = (f"[ -f {script} ] || {{ mkdir -p {bindir} && cat > {script}.$$ && mv {script}.$$ {script}; }}"
                   f" && exec {run}")
        result = self.transport.exec(command, stdin=HOSTSIDE_SOURCE, timeout=timeout or self.timeout)
        try:
            answer = json.loads(result.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            if result.returncode == SSH_FAILED:
                raise HostUnreachable(result.stderr.strip() or "connection lost") from None
            raise CommandFailed(f"{request.verb} failed on the host (exit {result.returncode}): "
                                f"{(result.stderr or result.stdout).strip()[-2000:]}") from None
        if "error" in answer:
            raise CommandFailed(answer["error"])
        return request.answer.from_wire(answer)

    def launch(self, request: LaunchRequest) -> LaunchAnswer:
        return self.call(request)

    def probe(self, directory: str, read_from: ReadFrom, gpu_tokens: list[str] | None = None) -> ProbeAnswer:
        """Status, new metric lines and log text; with gpu_tokens also a GPU snapshot, in the same round trip."""
        gpus = GpuQuery(gpu_tokens) if gpu_tokens is not None else None
        return self.call(ProbeRequest(directory, read_from.metrics_offset, read_from.log_offset, gpus))

    def cancel(self, directory: str, grace: float, read_from: ReadFrom | None = None,
               gpu_tokens: list[str] | None = None) -> CancelAnswer:
        """Stop the attempt and verify; with `read_from` a last probe, with gpu_tokens a GPU snapshot once
        nothing remains, in the same round trip."""
        gpus = GpuQuery(gpu_tokens) if gpu_tokens is not None else None
        return self.call(CancelRequest(directory, grace, read_from, gpus), timeout=grace + self.timeout)

    def clean(self, path: str, keep_into: str | None = None) -> CleanAnswer:
        """Empty `path` (inside the workspace); with keep_into, move the exported draft there first."""
        return self.call(CleanRequest(self.layout.workspace, self.layout.records, path, keep_into))

    def gpus(self, tokens: list[str]) -> GpuView:
        answer: GpusAnswer = self.call(GpusRequest(tokens))
        return answer.view()
