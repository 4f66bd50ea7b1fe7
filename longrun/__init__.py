"""longrun: run long GPU training jobs on remote machines and keep them under control.

`from longrun import Client` for the Python client of the REST API; the `longrun` command is longrun.cli.
"""

from longrun.client import (
    APIError,
    Client,
    Conflict,
    Event,
    InvalidRequest,
    LongrunError,
    NotFound,
    ServerUnreachable,
    Unauthorized,
    Unavailable,
)

__all__ = ["APIError", "Client", "Conflict", "Event", "InvalidRequest", "LongrunError", "NotFound",
           "ServerUnreachable", "Unauthorized", "Unavailable"]
