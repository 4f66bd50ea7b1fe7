"""What every request passes before a route: the Host header against an allow-list (DNS rebinding), a bound
on the body's size (413 before the body is parsed), for a state-changing request a check that no page of
another origin sent it (cross-site request forgery), and no NUL in its path or query (PostgreSQL refuses one in a
text value); and what every answer carries: the security headers."""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

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


class NoNul:
    """Refuse (422, naming the parameter) a path or query parameter holding a NUL: no name, id or cursor holds one,
    and PostgreSQL refuses one in a text value (a 500 from the first query that looked it up)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True,
                              errors="replace")
            loc = (["path"] if "\x00" in scope["path"] else
                   next((["query", k] for k, v in query if "\x00" in k or "\x00" in v), None))
            if loc is not None:
                error = {"type": "value_error", "loc": [part.replace("\x00", "\\x00") for part in loc],
                         "msg": "must not contain NUL bytes"}
                await JSONResponse({"detail": [error]}, status_code=422)(scope, receive, send)
                return
        await self.app(scope, receive, send)


UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# what a page on another site can send without a CORS preflight (a form, a no-cors fetch): refused as bodies
JSON_TYPES = ("application/json",)


def _origin_host(origin: str) -> str | None:
    """The host[:port] of an Origin header, or None when it names none ("null", from a sandbox or a file)."""
    scheme, sep, rest = origin.partition("://")
    return rest.lower() if sep and scheme in ("http", "https") and rest else None


class SameOriginWrites:
    """Refuse (403) a state-changing request a browser sends on behalf of a page of another origin, and (415) one
    whose body is not JSON.

    Browsers say where a request comes from: Sec-Fetch-Site (same-origin, or none when the user typed it) and
    Origin, which they send with every POST, form or no-cors fetch; the CLI and other programs send neither.
    A page elsewhere can send a form or text/plain body without asking, never a JSON one, so a body must be
    JSON (an empty one may go without a type). Reads are left alone: a page elsewhere cannot read the answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        site = _header(scope, b"sec-fetch-site")
        if site is not None and site.lower() not in ("same-origin", "none"):
            return 403, f"refusing a {scope['method']} sent from a page of another site (Sec-Fetch-Site: {site})"
        origin = _header(scope, b"origin")
        if site is None and origin is not None:
            host = (_header(scope, b"host") or "").lower()
            if _origin_host(origin) != host:
                return 403, f"refusing a {scope['method']} sent from a page of another origin ({origin[:200]})"
        content_type = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
        if content_type and content_type not in JSON_TYPES:
            return 415, f"the request body must be JSON (Content-Type: application/json), not {content_type[:100]}"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in UNSAFE_METHODS:
            refusal = self._refusal(scope)
            if refusal is not None:
                code, detail = refusal
                await JSONResponse({"detail": detail}, status_code=code)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# the page loads its scripts, styles and data from this server only, and no other page may frame it
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# /docs is FastAPI's Swagger UI: its script and styles come from a CDN, with an inline script to start it
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; "
            "style-src 'self' 'unsafe-inline' https://cdn.jsdelivr.net; img-src 'self' data: https://fastapi.tiangolo.com; "
            "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"no-referrer"), (b"cross-origin-opener-policy", b"same-origin")]


class SecurityHeaders:
    """Content-Security-Policy, X-Frame-Options, X-Content-Type-Options and Referrer-Policy on every answer."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        csp = (DOCS_CSP if scope["path"] == "/docs" else PAGE_CSP).encode()

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in [(b"content-security-policy", csp), *SECURITY_HEADERS] if k not in names]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, with_headers)
