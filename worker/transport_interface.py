"""How the worker reaches a host: the one interface that `local_transport.py` and `ssh_transport.py` implement.

A transport runs one shell command on the host and returns its result. Commands are built
with `shlex.join`/`shlex.quote` by the caller, so the same quoting is exercised locally and
over SSH.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass


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
