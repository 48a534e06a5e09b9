"""Opening apomesh's NATS connection, and the raw JetStream requests the adapters share.

``connect`` opens one nats-py connection from a list of server URLs with optional credentials (a
``.creds`` file, an NKey seed file, user/password or a token) and TLS. Once connected it reconnects
forever (a daemon outlives server restarts), but the first connection is bounded: a server that
cannot be reached within ``connect_timeout`` seconds is a ``LogUnavailable``, never a hang, and a
server that refuses who we say we are (``NatsAuthError``) or a TLS handshake that fails
(``NatsTlsError``) is said as such, naming the credentials or certificates involved, never their
secrets. With TLS configured (``tls://`` URLs or a TLS context) a connection is TLS or nothing: a
server whose INFO does not require TLS is refused before the login is sent (nats-py would
otherwise send it in clear). URLs are logged through ``redact_url``, never with a password or
token. A permissions violation the server reports on a live connection is logged as an error. ``unavailable_as_log_error``
maps the nats-py failures that mean "NATS cannot be reached right now" to ``LogUnavailable``;
``direct_get_batch`` runs one batched direct-get request and collects its messages up to the
end-of-batch status, and ``direct_get_pages`` reads such pages until nothing is left; ``api_request`` runs one raw ``$JS.API`` request; ``Replies`` sends the
many small requests of a hot path (a log append is one) over one reply subscription;
``request_many`` sends a batch of requests at once and collects their answers together;
``read_pub_ack`` reads a JetStream publish's answer (a log append's, a lease create's).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from apomesh.adapters.nats_parser import PayloadSink, SinkParser, header_lines, parse_header_block
from apomesh.core.errors import ApomeshError, LogError, LogUnavailable

__all__ = [
    "NATS",
    "WRONG_LAST_SEQUENCE",
    "DirectGetPage",
    "NatsAuthError",
    "NatsTlsError",
    "PageMessage",
    "PubAck",
    "Replies",
    "api_request",
    "close_quietly",
    "connect",
    "direct_get_batch",
    "direct_get_pages",
    "read_pub_ack",
    "redact_url",
    "redact_urls",
    "request_many",
    "split_urls",
    "tls_context",
    "unavailable_as_log_error",
]

_log = logging.getLogger("apomesh.nats")

JS_API_PREFIX = "$JS.API"

WRONG_LAST_SEQUENCE = frozenset({10071, 10164})
"""JetStream's err_codes for a publish whose expected last (subject) sequence did not hold."""

DUPLICATE_IN_PROCESS = 10158
"""The server is storing another message with the same id right now (two writers racing for one
index: a stale one thawed as the lease holder appends): asked again, the answer says which is
stored."""

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


class NatsAuthError(ApomeshError):
    """The NATS server refused the credentials presented (or their absence)."""

    code = "nats_auth_failed"
    retryable = False


class NatsTlsError(ApomeshError):
    """TLS between apomesh and a NATS server could not be set up."""

    code = "nats_tls_failed"
    retryable = False


def describe_credentials(
    *,
    credentials: str | None = None,
    nkey_seed_file: str | None = None,
    token: str | None = None,
    user: str | None = None,
) -> str:
    """What a connection presents, in words an operator can act on, without any secret."""
    if credentials:
        return f"the creds file {credentials}"
    if nkey_seed_file:
        return f"the NKey seed file {nkey_seed_file}"
    if user:
        return f"user {user!r} with its password"
    if token:
        return "a token"
    return (
        "no credentials (set [nats] user and password, creds_file, nkey_seed_file or token in"
        " the config file, or the APOMESH_NATS_* environment variables)"
    )


def _is_auth_refusal(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        isinstance(exc, nats.errors.AuthorizationError)
        or "authorization violation" in text
        or ("authentication" in text and "expired" in text)
    )


def _is_tls_failure(exc: BaseException) -> bool:
    return isinstance(
        exc,
        (ssl.SSLError, ssl.CertificateError, nats.errors.SecureConnRequiredError, TlsNotOffered),
    )


class TlsNotOffered(nats.errors.Error):
    """A server that does not require TLS answered a connection that must use it (``tls://``
    URLs or a TLS context): nothing more is sent to it, credentials least of all."""

    def __str__(self) -> str:
        return "nats: the server does not offer TLS, which this connection requires"


class _Client(NATS):
    """A nats-py client reading with ``SinkParser`` (cheaper framing, and sinks for pages) and
    reading header lines with ``header_lines`` (the same result, cheaper)."""

    _parse_header_lines = staticmethod(header_lines)

    def __init__(self) -> None:
        super().__init__()
        self._ps = SinkParser(self)


class _TlsRequiringClient(_Client):
    """A nats-py client that refuses a server whose INFO does not require TLS.

    nats-py upgrades to TLS only when the server's INFO asks for it, whatever the URL scheme or
    TLS context: a server (or anything in between) that leaves ``tls_required`` out would get the
    CONNECT line, password included, in clear. The INFO is read before anything is sent, so
    refusing it here sends nothing; this holds for every reconnection too."""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        server = self._current_server
        secured_below = server is not None and server.uri.scheme == "wss"
        if initial_connection and not secured_below and not info.get("tls_required", False):
            raise TlsNotOffered()
        await super()._process_info(info, initial_connection=initial_connection)


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


def redact_url(url: str) -> str:
    """``url`` fit for a log line: a password or token in it is replaced by ``***``
    (``nats://user:***@host:4222``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    userinfo, host = authority.rsplit("@", 1)
    user, colon, _ = userinfo.partition(":")
    hidden = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{hidden}@{host}{slash}{path}"


def redact_urls(urls: Sequence[str]) -> str:
    """Several URLs for a log line, each as ``redact_url`` gives it."""
    return ", ".join(redact_url(url) for url in urls)


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
    nkey_seed_file: str | None = None,
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
    tls: ssl.SSLContext | None = None,
    connect_timeout: float = 10.0,
    reconnect_wait: float = 0.5,
    ping_interval: float = 5.0,
    max_pings_outstanding: int = 2,
    inbox_prefix: str | None = None,
) -> NATS:
    """Open a connection that reconnects forever once it is up.

    ``credentials`` is the path of a ``.creds`` file (JWT + NKey seed), ``nkey_seed_file`` that of
    an NKey user seed (it needs the ``nkeys`` package); ``inbox_prefix`` replaces ``_INBOX`` for
    this connection's reply subjects. The server is pinged every ``ping_interval`` seconds; with
    more than ``max_pings_outstanding`` pings unanswered the connection is stale and another
    server of ``urls`` is tried (nats-py's own default, two minutes between pings, kept a client
    on a frozen server for minutes while the rest of the cluster served). Raises
    ``NatsAuthError`` when the server refuses the credentials, ``NatsTlsError`` when the TLS
    handshake fails, and ``LogUnavailable`` naming the URLs and the last error when no server
    answers within ``connect_timeout`` seconds.
    """
    servers = split_urls(urls)
    # TLS configured means TLS required: never a plain connection to a server that offers none.
    client = (
        _TlsRequiringClient()
        if tls is not None or any(url.startswith("tls://") for url in servers)
        else _Client()
    )
    failures: list[BaseException] = []
    # Set when the first connection meets a refusal that trying again cannot fix (credentials,
    # certificates): it ends the attempt at once instead of at the timeout.
    hopeless = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            # A subject this identity may not use: a deployment error worth seeing.
            _log.error("NATS refused: %s", exc)
            return
        if len(failures) < 50:
            failures.append(exc)
        if not client.is_connected and (_is_auth_refusal(exc) or _is_tls_failure(exc)):
            hopeless.set()
        _log.debug("nats connection error: %r", exc)

    async def on_disconnected() -> None:
        if client.is_closed:  # closed on purpose (a shutdown): nothing to reconnect
            _log.debug("connection to NATS closed (%s)", redact_urls(servers))
            return
        _log.info("disconnected from NATS (%s); reconnecting", redact_urls(servers))

    async def on_reconnected() -> None:
        _log.info(
            "reconnected to NATS at %s",
            redact_url(client.connected_url.netloc) if client.connected_url else "?",
        )

    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": reconnect_wait,
        "ping_interval": ping_interval,
        "max_outstanding_pings": max_pings_outstanding,
        "connect_timeout": max(1, int(min(connect_timeout, 5.0))),
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
    }
    if credentials is not None:
        options["user_credentials"] = credentials
    if nkey_seed_file is not None:
        try:
            import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
        except ImportError:
            raise NatsAuthError(
                f"the NKey seed file {nkey_seed_file} needs the nkeys package:"
                " pip install 'apomesh[nkeys]'"
            ) from None
        options["nkeys_seed"] = nkey_seed_file
    if inbox_prefix is not None:
        options["inbox_prefix"] = inbox_prefix
    if token is not None:
        options["token"] = token
    if user is not None:
        options["user"] = user
        options["password"] = password
    if tls is not None:
        options["tls"] = tls
    try:
        await _first_connection(client, options, hopeless, connect_timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        last = client.last_error or exc
        await close_quietly(client)
        seen = [*failures, last, exc]
        refusal = next((e for e in seen if _is_auth_refusal(e)), None)
        if refusal is not None:
            presented = describe_credentials(
                credentials=credentials, nkey_seed_file=nkey_seed_file, token=token, user=user
            )
            raise NatsAuthError(
                f"NATS at {redact_urls(servers)} refused the connection (authorization violation)"
                f" for {presented}: check that the server knows these credentials"
            ) from None
        tls_failure = next((e for e in seen if _is_tls_failure(e)), None)
        if tls_failure is not None:
            raise NatsTlsError(
                f"TLS with NATS at {redact_urls(servers)} failed: {_tls_reason(tls_failure)}"
                f" ({_describe_tls(tls)})"
            ) from None
        raise LogUnavailable(
            f"cannot reach NATS at {redact_urls(servers)} within {connect_timeout:g} s"
            f" (last error: {last!r})"
        ) from None
    return client


async def _first_connection(
    client: NATS, options: dict[str, Any], hopeless: asyncio.Event, timeout: float
) -> None:
    """``client.connect``, ended early by ``hopeless`` and at ``timeout`` seconds."""
    connecting = asyncio.ensure_future(client.connect(**options))
    refused = asyncio.ensure_future(hopeless.wait())
    try:
        done, _ = await asyncio.wait(
            {connecting, refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        refused.cancel()
    if connecting in done:
        connecting.result()
        return
    connecting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await connecting
    raise TimeoutError("refused" if refused in done else "no server answered")


def _tls_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate was not accepted: {exc.verify_message}"
    if isinstance(exc, TlsNotOffered):
        return (
            "the server does not offer TLS, which the connection requires: nothing was sent"
            " to it (no credentials); check the URL and that this is the NATS server meant"
        )
    if isinstance(exc, nats.errors.SecureConnRequiredError):
        return "the server requires TLS and none is configured ([nats] tls_ca, tls_cert, tls_key)"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        reason = exc.reason.replace("_", " ").lower()
        if "certificate required" in reason or "handshake failure" in reason:
            return f"{reason}: the server wants a client certificate ([nats] tls_cert, tls_key)"
        return reason
    return str(exc)


def _describe_tls(tls: ssl.SSLContext | None) -> str:
    if tls is None:
        return "no TLS configured, but the server requires it: set [nats] tls_ca to the CA of its certificate"
    return "TLS configured from [nats] tls_ca / tls_cert / tls_key"


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


_T = TypeVar("_T")

JETSTREAM_RETRY_PAUSE = 1.0
"""Seconds between two attempts of a start that found JetStream unavailable."""


class JetStreamWait:
    """How a start opens what it keeps on JetStream (the KV buckets, the state store's bucket,
    the log and heartbeat streams) while JetStream may not answer yet: a cluster electing its
    leaders after a restart, or after its nodes were paused. Each opening is tried again every
    ``JETSTREAM_RETRY_PAUSE`` seconds; the whole start warns once and gives up ``within``
    seconds after its first attempt, raising the last ``LogUnavailable``."""

    def __init__(self, within: float) -> None:
        self.within = within
        self._deadline: float | None = None
        self._warned = False

    async def answered(self, open_: Callable[[], Awaitable[_T]]) -> _T:
        """``open_()`` once JetStream answers it; ``open_`` must be safe to run again."""
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self.within
        while True:
            try:
                return await open_()
            except LogUnavailable as exc:
                if loop.time() + JETSTREAM_RETRY_PAUSE > self._deadline:
                    raise
                if not self._warned:
                    _log.warning(
                        "JetStream does not answer yet (%s); trying again for up to %.0f s"
                        " ([nats] jetstream_ready_timeout)",
                        exc,
                        self.within,
                    )
                    self._warned = True
            await asyncio.sleep(JETSTREAM_RETRY_PAUSE)


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


class PubAckError(msgspec.Struct):
    """Why a publish was refused: a status ``code`` (503: JetStream unavailable), JetStream's own
    ``err_code`` and its description."""

    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    """A JetStream publish's answer: the sequence the message was stored at (``duplicate`` when
    its ``Nats-Msg-Id`` was stored already), or the ``error`` it was refused with."""

    seq: int = 0
    duplicate: bool = False
    error: PubAckError | None = None

    @property
    def wrong_last_sequence(self) -> bool:
        """Refused because the subject's last sequence was not the expected one."""
        return self.error is not None and self.error.err_code in WRONG_LAST_SEQUENCE

    @property
    def transient(self) -> bool:
        """Refused for now, not for good: JetStream is unavailable (503), or the server is
        storing another message with the same id at this moment."""
        error = self.error
        return error is not None and (
            error.code == 503
            or error.err_code == DUPLICATE_IN_PROCESS
            or "inflight" in error.description
        )

    @property
    def reason(self) -> str:
        """The refusal as the server described it, with its code."""
        error = self.error
        return "" if error is None else f"{error.description} (err_code {error.err_code})"


_pub_ack_decode = msgspec.json.Decoder(PubAck).decode


def read_pub_ack(answer: bytes, what: str) -> PubAck:
    """The PubAck ``answer`` holds; ``LogError`` naming ``what`` when it holds none."""
    try:
        return _pub_ack_decode(answer)
    except msgspec.DecodeError:
        raise LogError(f"{what}: an answer that is not a PubAck: {answer[:80]!r}") from None


class PageMessage:
    """One message read through a sink (of a direct-get page, or an answer ``request_many`` or
    ``Replies`` collected): its payload, and its headers parsed when first asked."""

    __slots__ = ("_headers", "_raw_headers", "data")

    def __init__(
        self,
        data: bytes,
        raw_headers: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.data = data
        self._raw_headers = raw_headers
        self._headers = headers

    @property
    def headers(self) -> dict[str, str] | None:
        if self._headers is None and self._raw_headers:
            self._headers = parse_header_block(self._raw_headers)
        return self._headers


class DirectGetPage:
    """The messages one batched direct get returned, and what the server said was left.

    A message with headers is in ``messages``; one without (a page asked for with ``no_hdr``,
    the boot scan's) is in ``payloads``, as its payload alone, with no ``PageMessage`` built."""

    __slots__ = ("last_sequence", "messages", "payloads", "pending")

    def __init__(
        self,
        messages: list[PageMessage],
        pending: int,
        last_sequence: int,
        payloads: list[bytes] | None = None,
    ) -> None:
        self.messages = messages
        self.payloads = payloads if payloads is not None else []
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
    On a connection ``connect`` opened, the page's messages go straight to this call's collector
    (``SinkParser``); on another, through a subscription's callback.
    """
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[tuple[int, int]] = loop.create_future()
    messages: list[PageMessage] = []
    payloads: list[bytes] = []

    def take(message: PageMessage) -> None:
        if message.data:
            messages.append(message)
            return
        headers = message.headers
        status = headers.get("Status") if headers else None
        if status is None:
            messages.append(message)
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
        async with _answers_to(nc, inbox, {inbox: take}, {inbox: payloads.append}):
            await nc.publish(
                f"{prefix}.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            pending, last = await asyncio.wait_for(finished, timeout=timeout)
    return DirectGetPage(messages, pending, last, payloads)


async def direct_get_pages(
    nc: NATS, stream: str, request: dict[str, Any], *, timeout: float
) -> AsyncIterator[DirectGetPage]:
    """Every page of a batched direct get (``request``, from its ``seq`` or 1) until the server
    says nothing is left, the whole read within ``timeout`` seconds (else ``LogUnavailable``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    seq = int(request.get("seq") or 1)
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise LogUnavailable(f"direct gets on {stream}: no answer within {timeout:g} s")
        page = await direct_get_batch(nc, stream, {**request, "seq": seq}, timeout=remaining)
        if page.messages or page.payloads:
            yield page
        if not (page.messages or page.payloads) or page.pending <= 0:
            return
        seq = page.last_sequence + 1


async def request_many(
    nc: NATS,
    requests: Sequence[tuple[str, bytes, dict[str, str] | None]],
    *,
    timeout: float,
) -> list[PageMessage | None]:
    """Send every ``(subject, payload, headers)`` request at once and answer their replies in
    the same order, waiting at most ``timeout`` seconds for all of them: a request not answered
    by then is None, as is one nobody listened to (a 503 status with no payload).

    The requests share one reply subscription (``<inbox>.<n>``) and one wait: no future, timer
    or task for each, as a loop of ``Replies.request`` would have. On a connection ``connect``
    opened, each answer goes straight from the parser to its slot (``SinkParser``), with no
    ``Msg``; on another, through the subscription's callback. The boot scan's lease creates go
    this way, tens of thousands at once."""
    answers: list[PageMessage | None] = [None] * len(requests)
    if not requests:
        return answers
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    settled = [False] * len(requests)
    left = len(requests)

    def take(slot: int, message: PageMessage) -> None:
        nonlocal left
        if settled[slot] or finished.done():
            return
        settled[slot] = True
        headers = None if message.data else message.headers
        if not (headers and headers.get("Status") == "503"):  # 503: nobody listened (None)
            answers[slot] = message
        left -= 1
        if not left:
            finished.set_result(None)

    inbox = nc.new_inbox()
    replies = {f"{inbox}.{slot}": functools.partial(take, slot) for slot in range(len(requests))}
    with unavailable_as_log_error(f"{len(requests)} requests"):
        async with _answers_to(nc, f"{inbox}.*", replies):
            for (subject, payload, headers), reply in zip(requests, replies, strict=True):
                await nc.publish(subject, payload, reply=reply, headers=headers)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(finished), timeout=timeout)
    return answers


@asynccontextmanager
async def _answers_to(
    nc: NATS,
    subscribe_to: str,
    replies: Mapping[str, Callable[[PageMessage], None]],
    payloads: Mapping[str, PayloadSink] | None = None,
) -> AsyncIterator[None]:
    """Within the block, hand each answer on a subject of ``replies`` to its callback (one
    without headers to that subject's ``payloads`` entry instead, as its payload alone, when it
    has one): straight from the parser on a connection ``connect`` opened (``SinkParser``: no
    ``Msg``), else through a callback of the subscription to ``subscribe_to`` (the inbox, or
    ``<inbox>.*``), which the block's end drops."""
    payloads = payloads or {}

    async def collect(msg: Msg) -> None:
        take = None if msg.headers else payloads.get(msg.subject)
        if take is not None:
            take(msg.data)
            return
        deliver = replies.get(msg.subject)
        if deliver is not None:
            deliver(PageMessage(msg.data, headers=msg.headers))

    parser = getattr(nc, "_ps", None)
    sink_parser = parser if isinstance(parser, SinkParser) else None
    subscription = await nc.subscribe(subscribe_to, cb=collect)
    try:
        if sink_parser is not None:
            for reply, deliver in replies.items():
                sink_parser.sinks[reply.encode()] = functools.partial(_sink_to, deliver)
            for reply, take in payloads.items():
                sink_parser.payload_sinks[reply.encode()] = take
        yield
    finally:
        if sink_parser is not None:
            for reply in replies:
                sink_parser.sinks.pop(reply.encode(), None)
            for reply in payloads:
                sink_parser.payload_sinks.pop(reply.encode(), None)
        # When the connection is gone, the subscription went with it.
        with contextlib.suppress(nats.errors.Error):
            await subscription.unsubscribe()


def _sink_to(
    deliver: Callable[[PageMessage], None], raw_headers: bytes | None, data: bytes
) -> None:
    deliver(PageMessage(data, raw_headers))


class Replies:
    """Requests over one wildcard reply subscription of this connection, for a hot path.

    The same exchange as ``nc.request`` (publish with a reply subject, wait for the one answer,
    ``nats.errors.TimeoutError`` after ``timeout`` seconds, ``NoRespondersError`` when nobody
    listens), at about half of its cost per request: the reply subject is this object's prefix
    and a counter (nats-py draws a random token per request, a system call), the wait is a timer
    on the answer's future (``asyncio.wait_for`` wraps it in more), and on a connection
    ``connect`` opened the answer goes from the parser straight to that future (``SinkParser``:
    no ``Msg``, no queue, no turn of the subscription's task). The subscription is made on first
    use under the connection's inbox prefix (what the connection's permissions already allow for
    replies) and nats-py renews it after a reconnect.
    """

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = ""
        self._counter = itertools.count()
        self._waiting: dict[str, asyncio.Future[PageMessage]] = {}
        self._started: asyncio.Future[None] | None = None
        parser = getattr(nc, "_ps", None)
        self._sinks = parser.sinks if isinstance(parser, SinkParser) else None

    async def _start(self) -> None:
        prefix = self._nc.new_inbox() + "."
        await self._nc.subscribe(prefix + "*", cb=self._on_reply)
        self._prefix = prefix

    async def _on_reply(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result(PageMessage(msg.data, headers=msg.headers))

    async def request(
        self, subject: str, payload: bytes, *, timeout: float, headers: dict[str, str] | None = None
    ) -> PageMessage:
        if not self._prefix:
            if self._started is None:
                self._started = asyncio.ensure_future(self._start())
            try:
                await asyncio.shield(self._started)
            except BaseException:
                if self._started.done():
                    self._started = None  # a failed start is tried again by the next request
                raise
        loop = asyncio.get_running_loop()
        reply = f"{self._prefix}{next(self._counter)}"
        future: asyncio.Future[PageMessage] = loop.create_future()
        self._waiting[reply] = future
        sinks = self._sinks
        key = reply.encode()
        if sinks is not None:
            sinks[key] = functools.partial(_answer, future)
        timer = loop.call_later(timeout, _time_out, future)
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
            msg = await future
        finally:
            timer.cancel()
            self._waiting.pop(reply, None)
            if sinks is not None:
                sinks.pop(key, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg


def _answer(future: asyncio.Future[PageMessage], raw_headers: bytes | None, data: bytes) -> None:
    if not future.done():
        future.set_result(PageMessage(data, raw_headers))


def _time_out(future: asyncio.Future[PageMessage]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())
