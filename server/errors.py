"""Domain errors: what a command or query refuses, and why. They know nothing of HTTP; server/api maps them."""

from typing import Any

from pydantic import ValidationError


class DomainError(Exception):
    """Base of the errors a caller of server's commands and queries can act on."""


class NotFound(DomainError):
    """The run, host or attempt asked for does not exist."""


class Conflict(DomainError):
    """The request clashes with the current state of the thing it names (a run's status, a taken name)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


class FieldError(DomainError):
    """Bad input, naming each wrong field by its path in the request (pydantic's error shape)."""

    def __init__(self, loc: tuple[str | int, ...], message: str, value: Any = None):
        super().__init__(f"{'.'.join(map(str, loc))}: {message}")
        self.errors: list[dict[str, Any]] = [{"type": "value_error", "loc": loc, "msg": message, "input": value}]

    @classmethod
    def from_validation(cls, exc: ValidationError, under: tuple[str | int, ...] = (),
                        strip: tuple[str, ...] = ()) -> "FieldError":
        """Pydantic's errors, each loc put under `under`, with a leading component in `strip` removed."""
        errors = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            if len(loc) > 1 and loc[0] in strip:
                loc = loc[1:]
            errors.append({**err, "loc": (*under, *loc)})
        first = errors[0]
        error = cls(first["loc"], first["msg"], first.get("input"))
        error.errors = errors
        return error


class Unavailable(DomainError):
    """The answer needs something that is not there yet (a host's first GPU snapshot from the worker)."""
