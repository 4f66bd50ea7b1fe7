"""The `local` transport: commands run with /bin/sh on this machine, the worker's own."""

import subprocess

from worker.host_errors import HostUnreachable
from worker.transport_interface import CommandResult, Transport


class LocalTransport(Transport):
    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        self.round_trips += 1
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], input=stdin or b"", capture_output=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise HostUnreachable(f"command timed out after {timeout}s") from exc
        return CommandResult(proc.returncode, proc.stdout.decode("utf-8", "replace"),
                             proc.stderr.decode("utf-8", "replace"))
