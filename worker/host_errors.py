"""What can go wrong between the worker and a host, as one hierarchy.

- `HostUnreachable`: the host did not answer (refused, timed out, connection dropped). The run is kept
  and the call retried later: unreachable is not dead (server.lifecycle.host_unreachable).
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


class HostKeyRefused(HostError):
    """The host's key is unknown or changed: nothing is run there until a person trusts it."""


class AuthRefused(HostError):
    """The host refused to let us log in with the configured user and key: a person must fix it."""


class CommandFailed(HostError):
    """The host answered, but the action was refused or failed there."""
