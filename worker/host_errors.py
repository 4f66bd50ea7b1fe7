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
