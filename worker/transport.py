"""How the worker reaches a host: one interface, a `local` and an `ssh` implementation.

A transport runs one shell command on the host and returns its result. Commands are built
with `shlex.join`/`shlex.quote` by the caller, so the same quoting is exercised locally and
over SSH.
"""

import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass

from worker.host_errors import HostUnreachable


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class Transport(ABC):
    round_trips: int = 0

    @abstractmethod
    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        """Run `command` with /bin/sh on the host; raise HostUnreachable if the host did not answer."""

    def connect(self) -> None:  # noqa: B027 - most transports have no connection to open
        """Open the connection now, if the transport keeps one, so that the next command does not wait for it."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release the connection, if any."""


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
