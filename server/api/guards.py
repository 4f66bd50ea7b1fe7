"""What every request passes before a route: the Host header against an allow-list (DNS rebinding), and a
bound on the body's size (413 before the body is parsed)."""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException, status
from starlette.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


def host_name(header: str) -> str:
    """The host of a Host header without its port: `[::1]:8080` is `::1`, `example.org:80` is `example.org`."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostAllowList:
    """Refuse (400) a request whose Host header names none of `allowed` ("*" allows any)."""

    def __init__(self, app: ASGIApp, allowed: list[str]):
        self.app, self.allowed = app, {h.lower() for h in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            name = host_name(_header(scope, b"host") or "").lower()
            if name not in self.allowed:
                detail = (f"Host {name!r} is not one this server answers to; add it to LONGRUN_ALLOWED_HOSTS "
                          f"(comma-separated) on the server")
                await JSONResponse({"detail": detail}, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse (413) a request body above `max_bytes`: by its Content-Length at once, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"request body larger than {self.max_bytes} bytes (LONGRUN_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await JSONResponse({"detail": self._too_large()}, status_code=413)(scope, receive, send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI passes an HTTPException raised while reading the body through as the answer
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, self._too_large())
            return message

        await self.app(scope, bounded, send)
