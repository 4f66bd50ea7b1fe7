"""What can go wrong between the worker and a host, as one hierarchy.

- `HostUnreachable`: the host did not answer (refused, timed out, connection dropped). The run is kept
  and the call retried later: unreachable is not dead (server.lifecycle.host_unreachable).
- `AnswerLost`: the host ran the command, but no answer of the agent's came back whole (nothing, or not JSON): a
  HostUnreachable, asked again at once (worker/host_agent.py), then kept and retried as one.
- `HostKeyRefused`: the host presented a key nobody trusted. Nothing was run there.
- `AuthRefused`: the host refused our key.
- `CommandFailed`: the host answered, but the action was refused or failed there.

Only `HostUnreachable` may cure itself; the others fail the run with their message, which says what to fix.
"""


class HostError(Exception):
    """Talking to a host failed; `host` names it once known."""

    def __init__(self, message: str, host: str | None = None):
        super().__init__(message)
        self.host = host


class HostUnreachable(HostError):
    """The host could not be reached, or the command did not complete: the host may come back."""


class AnswerLost(HostUnreachable):
    """The host ran the command, but the agent's answer came back empty or unreadable: the agent was killed
    mid-answer (as an out-of-memory kill does), or something else wrote on its stdout. Every verb may be asked again
    (the same request does the same thing), and a host that keeps answering so is away, not refusing."""


class HostKeyRefused(HostError):
    """The host's key is unknown or changed: nothing is run there until a person trusts it."""


class AuthRefused(HostError):
    """The host refused to let us log in with the configured user and key: a person must fix it."""


class CommandFailed(HostError):
    """The host answered, but the action was refused or failed there."""


# how a Python traceback a host's python printed begins (the agent's install, or the agent itself, raising)
TRACEBACK = "Traceback (most recent call last):"
# what an OSError's errno says of the host's file system, and what fixes it
FILE_SYSTEM_FULL = {"[Errno 28]": "is full", "[Errno 122]": "is over its quota"}


def in_one_sentence(message: str, host: str, workspace: str) -> str | None:
    """A failure a host reported with a Python traceback in it, as its head and the exception's own line (a full
    disk or quota named for what it is, with the workspace); None when it holds no traceback."""
    head, found, tail = message.partition(TRACEBACK)
    if not found:
        return None
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")[:300]
    why = next((words for errno, words in FILE_SYSTEM_FULL.items() if errno in last), None)
    if why is not None:
        last += (f": the file system of the workspace {workspace} on {host} {why}; make room there, or give the "
                 f"host another workspace (longrun hosts update {host} --workspace DIR)")
    return f"{head.strip()} {last} (the whole traceback is in the server's log)"
