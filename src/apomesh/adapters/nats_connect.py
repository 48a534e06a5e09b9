"""Opening apomesh's NATS connection, and the raw JetStream requests the adapters share.

``connect`` opens one nats-py connection from a list of server URLs with optional credentials,
token, user/password or TLS. Once connected it reconnects forever (a daemon outlives server
restarts), but the first connection is bounded: a server that cannot be reached within
``connect_timeout`` seconds is a ``LogUnavailable``, never a hang. ``unavailable_as_log_error``
maps the nats-py failures that mean "NATS cannot be reached right now" to ``LogUnavailable``;
``direct_get_batch`` runs one batched direct-get request and collects its messages up to the
end-of-batch status; ``api_request`` runs one raw ``$JS.API`` request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from apomesh.core.errors import LogError, LogUnavailable

__all__ = [
    "NATS",
    "DirectGetPage",
    "api_request",
    "close_quietly",
    "connect",
    "direct_get_batch",
    "split_urls",
    "tls_context",
    "unavailable_as_log_error",
]

_log = logging.getLogger("apomesh.nats")

JS_API_PREFIX = "$JS.API"

UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
"""nats-py failures that say the server (or its JetStream) is out of reach, not that we erred."""


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """``"a:4222,b:4222"`` or a list of URLs -> a list of ``nats://`` URLs."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    result = []
    for part in parts:
        url = part.strip()
        if not url:
            continue
        result.append(url if "://" in url else f"nats://{url}")
    if not result:
        raise ValueError("no NATS server URL given")
    return result


def tls_context(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client TLS context trusting ``ca_file`` (or the system store), with an optional client
    certificate for servers that verify clients."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


async def connect(
    urls: str | Sequence[str],
    *,
    name: str | None = None,
    credentials: str | None = None,
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    connect_timeout: float = 10.0,
    reconnect_wait: float = 0.5,
) -> NATS:
    """Open a connection that reconnects forever once it is up.

    ``credentials`` is the path of a ``.creds`` file (JWT + nkey seed). Raises ``LogUnavailable``
    naming the URLs and the last error when no server answers within ``connect_timeout`` seconds.
    """
    servers = split_urls(urls)
    client = NATS()

    async def on_error(exc: Exception) -> None:
        _log.debug("nats connection error: %r", exc)

    async def on_disconnected() -> None:
        _log.info("disconnected from NATS (%s); reconnecting", ", ".join(servers))

    async def on_reconnected() -> None:
        _log.info(
            "reconnected to NATS at %s",
            client.connected_url.netloc if client.connected_url else "?",
        )

    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": reconnect_wait,
        "connect_timeout": max(1, int(min(connect_timeout, 5.0))),
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if credentials is not None:
        options["user_credentials"] = credentials
    if token is not None:
        options["token"] = token
    if user is not None:
        options["user"] = user
        options["password"] = password
    if tls is not None:
        options["tls"] = tls
    try:
        await asyncio.wait_for(client.connect(**options), timeout=connect_timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        last = client.last_error or exc
        await close_quietly(client)
        raise LogUnavailable(
            f"cannot reach NATS at {', '.join(servers)} within {connect_timeout:g} s"
            f" (last error: {last!r})"
        ) from None
    return client


async def close_quietly(client: NATS) -> None:
    """Close a connection whose server may be gone (nats-py raises when it cannot flush)."""
    try:
        await client.close()
    except (OSError, nats.errors.Error) as exc:  # nothing is left to flush to; the close is done
        _log.debug("closing a NATS connection: %r", exc)


@contextmanager
def unavailable_as_log_error(what: str) -> Iterator[None]:
    """Turn "NATS cannot be reached" failures inside the block into ``LogUnavailable``."""
    try:
        yield
    except UNAVAILABLE_ERRORS as exc:
        raise LogUnavailable(f"{what}: NATS is unavailable ({type(exc).__name__}: {exc})") from None


async def api_request(
    nc: NATS, subject: str, request: dict[str, Any], *, timeout: float
) -> dict[str, Any]:
    """One raw JetStream API request; a JSON error answer raises ``LogError``."""
    with unavailable_as_log_error(subject):
        reply = await nc.request(subject, json.dumps(request).encode(), timeout=timeout)
    answer: dict[str, Any] = json.loads(reply.data)
    error = answer.get("error")
    if error is not None:
        if error.get("code") == 503:
            raise LogUnavailable(f"{subject}: {error.get('description', error)}")
        raise LogError(
            f"{subject}: {error.get('description', error)} (err_code {error.get('err_code')})"
        )
    return answer


class DirectGetPage:
    """The messages one batched direct get returned, and what the server said was left."""

    __slots__ = ("last_sequence", "messages", "pending")

    def __init__(self, messages: list[Msg], pending: int, last_sequence: int) -> None:
        self.messages = messages
        self.pending = pending
        self.last_sequence = last_sequence


async def direct_get_batch(
    nc: NATS, stream: str, request: dict[str, Any], *, timeout: float, prefix: str = JS_API_PREFIX
) -> DirectGetPage:
    """Send one batched direct get (``{"seq", "next_by_subj", "batch", ...}`` or ``multi_last``)
    and collect the answers until the end-of-batch status.

    A "no message" answer (404) is an empty page. ``pending`` is the server's count of matching
    messages left after this page. Raises ``LogUnavailable`` when the answer does not complete
    within ``timeout`` seconds or no JetStream responds, ``LogError`` for a refused request.
    """
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[tuple[int, int]] = loop.create_future()
    messages: list[Msg] = []

    async def collect(msg: Msg) -> None:
        headers = msg.headers
        status = headers.get("Status") if headers and not msg.data else None
        if status is None:
            messages.append(msg)
            return
        if finished.done():
            return
        if status == "204":
            pending = int(headers.get("Nats-Num-Pending", "0")) if headers else 0
            last = int(headers.get("Nats-Last-Sequence", "0")) if headers else 0
            finished.set_result((pending, last))
        elif status == "404":
            finished.set_result((0, 0))
        elif status == "503":
            finished.set_exception(
                LogUnavailable(f"direct get on {stream}: no JetStream responder")
            )
        else:
            description = headers.get("Description", "") if headers else ""
            finished.set_exception(
                LogError(f"direct get on {stream} refused: {status} {description}")
            )

    inbox = nc.new_inbox()
    with unavailable_as_log_error(f"direct get on {stream}"):
        subscription = await nc.subscribe(inbox, cb=collect)
        try:
            await nc.publish(
                f"{prefix}.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            pending, last = await asyncio.wait_for(finished, timeout=timeout)
        finally:
            # When the connection is gone, the subscription went with it.
            with contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()
    return DirectGetPage(messages, pending, last)
