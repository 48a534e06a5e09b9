"""What keeps web pages from driving the API through the operator's browser: an ASGI middleware
that refuses a state-changing request (``POST``, ``PUT``, ``PATCH``, ``DELETE``) sent by a page of
another origin (403 ``cross_origin``, judged by ``Sec-Fetch-Site`` and ``Origin``) or with a body
type other than ``application/json`` (415 ``unsupported_media_type``: an HTML form can only send
``text/plain``, ``multipart/form-data`` or ``application/x-www-form-urlencoded``, and a cross-site
``fetch`` with JSON needs a CORS preflight the API never grants). Together with the ``Host`` check
(against DNS rebinding: 400 ``invalid_host`` unless it names the listen host, a loopback name or
``[http] allowed_hosts``; Starlette's ``TrustedHostMiddleware`` would answer untyped text and
cannot parse a bracketed IPv6 host) and bearer tokens, on loopback too, a page the
browser opens can neither start nor change anything. Clients that are not browsers send neither
header; the command line and the SDK send ``Content-Type: application/json`` on every write.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

import msgspec
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from apomesh.api.openapi import ErrorBody

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SAME_ORIGIN_FETCH_SITES = frozenset({"same-origin", "none"})
"""``Sec-Fetch-Site`` values of a request the console itself (or the user, typing) made."""


def refusal(
    headers: Headers, method: str, allowed_hosts: Sequence[str] | None
) -> tuple[int, str, str] | None:
    """(status, code, message) refusing a request with these headers, or None to let it through.
    ``allowed_hosts`` None checks no ``Host``; ``"*"`` in it allows any."""
    if allowed_hosts is not None and "*" not in allowed_hosts:
        host = host_name(headers.get("host", ""))
        if host not in allowed_hosts:
            return 400, "invalid_host", "the Host header names no host this daemon answers for"
    if method not in STATE_CHANGING:
        return None
    site = headers.get("sec-fetch-site")
    if site is not None and site.lower() not in SAME_ORIGIN_FETCH_SITES:
        return 403, "cross_origin", f"a {site} page may not change this daemon"
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, headers.get("host", "")):
        return 403, "cross_origin", "the request's Origin is not this daemon"
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        return (
            415,
            "unsupported_media_type",
            f"{method} requests must be Content-Type: application/json",
        )
    return None


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without port or IPv6 brackets, lower-cased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.partition(":")[0]


def _same_origin(origin: str, host: str) -> bool:
    """Whether a browser's ``Origin`` names the host:port the request was sent to."""
    if origin == "null":  # sandboxed frames, file: pages, some redirects
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host.lower()


class BrowserGuard:
    """ASGI middleware answering ``refusal`` with a typed JSON error before the app sees it."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str] | None = None) -> None:
        self.app = app
        self.allowed_hosts = (
            None
            if allowed_hosts is None
            else [h.strip().strip("[]").lower() for h in allowed_hosts]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = refusal(Headers(scope=scope), scope["method"], self.allowed_hosts)
            if refused is not None:
                status, code, message = refused
                body = msgspec.json.encode(ErrorBody(error=code, message=message))
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
