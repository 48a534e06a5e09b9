"""The Python client of the apomesh daemon: ``Client`` (async, on httpx) and ``SyncClient`` (the same
methods, blocking), with typed errors and an event iterator that survives reconnects.

``Client.events`` yields a session's events as ``EventRecord``s and ends after ``SessionEnded``.
When the connection drops or the daemon restarts it reconnects by itself with ``Last-Event-ID``,
so no event is lost or repeated; it gives up with ``ServerUnavailable`` only after
``reconnect_window`` seconds (60 by default) of failing to reconnect. Errors the daemon answers
become ``ApiError`` subclasses carrying the HTTP status, the error code and the message.
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar
from urllib.parse import quote, urlsplit

import anyio
import httpx
import msgspec

from apomesh._version import __version__
from apomesh.core.views import (
    AgentConversation,
    AgentRecordView,
    DaemonView,
    PendingPauseView,
    RecoverableFilter,
    RecoverableView,
    ResumeOutcome,
    SessionSummary,
    SessionView,
    SkillView,
    WorkerView,
)
from apomesh.runtime.config import FIRST_TOKEN_FILE, Config, load_config

DEFAULT_URL = "http://127.0.0.1:8750"
T = TypeVar("T")


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_token(url: str, config: Config | None = None) -> str | None:
    """The token a client on the daemon's own machine can use without being given one, when
    ``url`` is a loopback address (never sent anywhere else): ``[http] token`` of ``config``,
    else the operator token the daemon wrote into its data dir at its first start
    (``<data_dir>/http.token``, readable only by the daemon's user), else None. ``config``
    defaults to the configuration from the environment."""
    host = (urlsplit(url).hostname or "").lower()
    if host != "localhost" and not _is_loopback_address(host):
        return None
    config = config if config is not None else load_config()
    if config.http.token:
        return config.http.token
    try:
        text = (config.daemon.data_path() / FIRST_TOKEN_FILE).read_text(encoding="utf-8")
    except OSError:
        return None
    return text.strip() or None


# --- errors -----------------------------------------------------------------------------------


class ApiError(Exception):
    """The daemon refused or failed a request: ``status`` (0 when it was never reached), ``code``
    (the API's stable error code) and ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}" if status else f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class InvalidRequestError(ApiError):
    """400: a bad body, query or agent definition."""


class UnauthorizedError(ApiError):
    """401: no valid token."""


class ForbiddenError(ApiError):
    """403: the token's role does not allow this."""


class NotFoundError(ApiError):
    """404: unknown session, pause, skill or agent."""


class ConflictError(ApiError):
    """409: the request conflicts with the current state (publish conflict, pin error, ...)."""


class ConfirmationRequired(ConflictError):
    """409 ``confirm_required``: a resume asked without ``confirm``; ``preview`` is what it faces."""

    def __init__(self, status: int, code: str, message: str, preview: RecoverableView) -> None:
        super().__init__(status, code, message)
        self.preview = preview


class PayloadTooLargeError(ApiError):
    """413: a body over the daemon's limits."""


class RateLimitedError(ApiError):
    """429: too many failed authentications from this address."""


class ServerUnavailable(ApiError):
    """The daemon cannot be reached (connection refused, dropped) or answered 502/503/504."""


_ERRORS_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: InvalidRequestError,
    429: RateLimitedError,
    502: ServerUnavailable,
    503: ServerUnavailable,
    504: ServerUnavailable,
}


class _ErrorBody(msgspec.Struct):
    error: str = "error"
    message: str = ""
    preview: RecoverableView | None = None


def _error_from(response: httpx.Response) -> ApiError:
    try:
        body = msgspec.json.decode(response.content, type=_ErrorBody)
    except msgspec.DecodeError:
        body = _ErrorBody(error=f"http_{response.status_code}", message=response.text[:200])
    status = response.status_code
    if status == 409 and body.error == "confirm_required" and body.preview is not None:
        return ConfirmationRequired(status, body.error, body.message, body.preview)
    kind = _ERRORS_BY_STATUS.get(status, ApiError)
    return kind(status, body.error, body.message)


def _unreachable(url: str, exc: Exception) -> ServerUnavailable:
    return ServerUnavailable(
        0, "unavailable", f"cannot reach {url}: {type(exc).__name__} {exc}".strip()
    )


# --- results ----------------------------------------------------------------------------------


class EventRecord(msgspec.Struct, frozen=True):
    """One event of a session's log: its index, name (``kind``), time and fields."""

    index: int
    kind: str
    ts: float
    event: dict[str, Any]
    session_id: str = ""
    event_id: str = ""


class Published(NamedTuple):
    """What publishing an agent did: ``created`` is False when the same content was there."""

    created: bool
    agent: AgentRecordView


class _Wire(msgspec.Struct):
    index: int
    kind: str
    ts: float
    event: dict[str, Any]
    session_id: str = ""
    event_id: str = ""
    v: int = 1


class _SessionCreated(msgspec.Struct):
    session_id: str


class Page(list[T], Generic[T]):
    """One page of a listing: its rows, and ``next_cursor`` to pass as ``cursor`` for the next
    page (None on the last one)."""

    def __init__(self, rows: list[T], next_cursor: str | None = None) -> None:
        super().__init__(rows)
        self.next_cursor = next_cursor


class _SessionList(msgspec.Struct):
    sessions: list[SessionSummary]
    next_cursor: str | None = None


class _PauseList(msgspec.Struct):
    pauses: list[PendingPauseView]
    next_cursor: str | None = None


class _Purged(msgspec.Struct):
    sessions: list[str]


class _BulkResumed(msgspec.Struct, frozen=True):
    sessions: list[ResumeOutcome]


class _RecoverableList(msgspec.Struct):
    sessions: list[RecoverableView]
    next_cursor: str | None = None


class _WorkerList(msgspec.Struct):
    workers: list[WorkerView]
    next_cursor: str | None = None


class _DaemonList(msgspec.Struct):
    daemons: list[DaemonView]


class _SkillList(msgspec.Struct):
    skills: list[SkillView]


class _AgentList(msgspec.Struct):
    agents: list[AgentRecordView]


def _agent_body(agent: str) -> dict[str, str]:
    name, sep, version = agent.partition("@")
    return {"name": name, "version": version} if sep else {"name": name}


async def _sse_records(response: httpx.Response) -> AsyncIterator[EventRecord]:
    """Parse a text/event-stream body into records (comments and unknown fields ignored)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                wire = msgspec.json.decode("\n".join(data), type=_Wire)
                data = []
                yield EventRecord(
                    index=wire.index,
                    kind=wire.kind,
                    ts=wire.ts,
                    event=wire.event,
                    session_id=wire.session_id,
                    event_id=wire.event_id,
                )
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)


# --- the async client -------------------------------------------------------------------------


class Client:
    """An async client of a daemon. Use it as ``async with Client(url, token) as client:``.

    ``url`` may list several daemons of one NATS, comma-separated: a request the current one
    cannot be reached for is sent to the next, and an event stream that drops continues on the
    next daemon after the last event it delivered (every daemon reads every session's log).

    ``timeout`` bounds each ordinary request; ``stream_timeout`` is the longest silence an event
    stream tolerates (the daemon sends a keep-alive every 15 s) before reconnecting;
    ``reconnect_window`` how long ``events`` keeps trying to reconnect before giving up."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        stream_timeout: float = 60.0,
        reconnect_window: float = 60.0,
    ) -> None:
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()] or [DEFAULT_URL]
        self.url = self.urls[0]
        headers = {"Accept": "application/json", "User-Agent": f"apomesh-sdk/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._stream_timeout = stream_timeout
        self.reconnect_window = reconnect_window
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _fail_over(self) -> None:
        """Send what follows to the next daemon (when ``url`` lists several)."""
        if len(self.urls) > 1:
            self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
            self._http.base_url = httpx.URL(self.url)

    # --- plumbing -----------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        content = msgspec.json.encode(body) if body is not None else None
        # Every write says JSON, body or not: the daemon refuses any other (415).
        if method != "GET":
            headers = {"Content-Type": "application/json", **(headers or {})}
        failed_over = 0
        sent_again = False
        while True:
            try:
                response = await self._http.request(
                    method, path, content=content, params=params, headers=headers
                )
                break
            except httpx.ConnectError as exc:
                # Never sent: the next daemon may take it.
                failed_over += 1
                if failed_over == len(self.urls):
                    raise _unreachable(self.url, exc) from exc
                self._fail_over()
            except httpx.RemoteProtocolError as exc:
                # The server closed the connection with no answer: most often a kept-alive one
                # it closed as this request went out. A read is sent once more (on a new
                # connection); a write is not, since it may have been applied.
                if method != "GET" or sent_again:
                    raise _unreachable(self.url, exc) from exc
                sent_again = True
            except httpx.TransportError as exc:
                raise _unreachable(self.url, exc) from exc
        if response.status_code >= 400:
            raise _error_from(response)
        return response

    async def _get(self, path: str, kind: type[T], params: dict[str, str] | None = None) -> T:
        response = await self._send("GET", path, params=params)
        return msgspec.json.decode(response.content, type=kind)

    # --- sessions -----------------------------------------------------------------------------

    async def start_session(
        self,
        goal: str,
        agent: str | None = None,
        definition: dict[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> str:
        """Start a session; ``agent`` is ``"name"`` or ``"name@version"`` of a published agent,
        ``definition`` an inline agent definition (the TOML form as a dict). Returns its id.
        With ``idempotency_key`` a retry of the same request (after a timeout, say) answers the
        session the first one started instead of starting another."""
        body: dict[str, Any] = {"goal": goal}
        if agent is not None:
            body["agent"] = _agent_body(agent)
        if definition is not None:
            body["definition"] = definition
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        response = await self._send("POST", "/v1/sessions", body=body, headers=headers)
        return msgspec.json.decode(response.content, type=_SessionCreated).session_id

    async def get_session(self, session_id: str) -> SessionView:
        return await self._get(f"/v1/sessions/{quote(session_id, safe='')}", SessionView)

    async def agent_conversation(self, session_id: str, ref: str) -> AgentConversation:
        """Agent ``ref`` of a session (``root``, ``root/0``, ...) and its conversation: what it
        was asked, the model's text, its tool calls with arguments and results, the questions
        it asked a human and their answers, side effects whose outcome is unknown."""
        path = f"/v1/sessions/{quote(session_id, safe='')}/agents/{quote(ref, safe='/')}"
        return await self._get(path, AgentConversation)

    async def list_sessions(
        self,
        status: str | None = None,
        query: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[SessionSummary]:
        """One page of sessions, the most recently updated first; its ``next_cursor``, passed
        as ``cursor``, asks for the next."""
        params = {"limit": str(limit)}
        if status is not None:
            params["status"] = status
        if query:
            params["q"] = query
        if cursor:
            params["cursor"] = cursor
        answer = await self._get("/v1/sessions", _SessionList, params)
        return Page(answer.sessions, answer.next_cursor)

    async def _all_pages(
        self, path: str, kind: type[Any], field: str, limit: int | None, cursor: str | None
    ) -> Page[Any]:
        """One page of a listing (``limit``), or every row after ``cursor`` (None)."""
        rows: list[Any] = []
        while True:
            params = {"limit": str(limit or 1000)}
            if cursor:
                params["cursor"] = cursor
            answer = await self._get(path, kind, params)
            rows.extend(getattr(answer, field))
            cursor = answer.next_cursor
            if limit is not None or cursor is None:
                return Page(rows, cursor)

    async def purge_session(self, session_id: str) -> None:
        """Remove an ended session: its log subject and every record of it."""
        await self._send("DELETE", f"/v1/sessions/{quote(session_id, safe='')}")

    async def purge_ended(self, ended_before_seconds: float) -> list[str]:
        """Purge every session that ended more than ``ended_before_seconds`` ago; their ids."""
        body = {"ended_before_seconds": ended_before_seconds}
        response = await self._send("POST", "/v1/sessions/purge", body=body)
        return msgspec.json.decode(response.content, type=_Purged).sessions

    async def list_hitl(
        self, limit: int | None = None, cursor: str | None = None
    ) -> Page[PendingPauseView]:
        """The open human-in-the-loop pauses (every one unless ``limit``)."""
        return await self._all_pages("/v1/hitl", _PauseList, "pauses", limit, cursor)

    async def events(self, session_id: str, after: int = -1) -> AsyncIterator[EventRecord]:
        """The session's events after index ``after`` (-1: from the start), live, ending after
        ``SessionEnded``. Reconnects with ``Last-Event-ID`` when the connection drops."""
        path = f"/v1/sessions/{quote(session_id, safe='')}/events"
        last = after
        failing_since: float | None = None
        delay = 0.1
        timeout = httpx.Timeout(self._timeout, read=self._stream_timeout)
        while True:
            problem: Exception | None = None
            headers = {"Accept": "text/event-stream"}
            if last >= 0:
                headers["Last-Event-ID"] = str(last)
            try:
                async with self._http.stream(
                    "GET", path, headers=headers, timeout=timeout
                ) as response:
                    if response.status_code != 200:
                        await response.aread()
                        error = _error_from(response)
                        if not isinstance(error, ServerUnavailable):
                            raise error
                        problem = error
                    else:
                        failing_since, delay = None, 0.1
                        async for record in _sse_records(response):
                            if record.index <= last:
                                continue
                            last = record.index
                            yield record
                            if record.kind == "SessionEnded":
                                return
                        # The daemon ends a stream at once when the session ended at or before
                        # ``after``: that is the end, not a dropped connection.
                        if await self._ended_by(session_id, last):
                            return
            except httpx.TransportError as exc:
                problem = exc
            # The stream ended early or could not start: the daemon stopped, restarted or the
            # network dropped. Try again (on the next daemon, when several are listed) after a
            # growing pause, for a bounded while.
            self._fail_over()
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
            elif now - failing_since > self.reconnect_window:
                if isinstance(problem, ApiError):
                    raise problem
                raise _unreachable(self.url, problem or ConnectionError("stream ended"))
            await anyio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _ended_by(self, session_id: str, index: int) -> bool:
        """Whether the session is terminal with no event after ``index`` (False when the daemon
        cannot say right now: the caller reconnects as for a dropped stream)."""
        try:
            view = await self.get_session(session_id)
        except ServerUnavailable:
            return False
        return view.terminal and view.last_index <= index

    async def wait(self, session_id: str, timeout: float | None = None) -> SessionView:
        """The session's view once it is terminal (``completed``, ``failed`` or ``cancelled``)."""
        scope: AbstractContextManager[Any] = (
            anyio.fail_after(timeout) if timeout is not None else nullcontext()
        )
        with scope:
            view = await self.get_session(session_id)
            if view.terminal:
                return view
            async for _ in self.events(session_id, after=view.last_index):
                pass
            return await self.get_session(session_id)

    async def verify_session(self, session_id: str) -> dict[str, Any]:
        """Fold the session's log from its start and check it against the daemon's stored
        snapshots, journal and completed record: ``{"ok": bool, "problems": [...], ...}``."""
        path = f"/v1/sessions/{quote(session_id, safe='')}/verify"
        return await self._get(path, dict[str, Any])

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str) -> None:
        path = f"/v1/sessions/{quote(session_id, safe='')}/hitl/{quote(pause_id, safe='')}"
        await self._send("POST", path, body={"answer": answer})

    async def cancel(self, session_id: str) -> None:
        await self._send("POST", f"/v1/sessions/{quote(session_id, safe='')}/cancel", body={})

    # --- recovery and workers -----------------------------------------------------------------

    async def list_recoverable(
        self, limit: int | None = None, cursor: str | None = None
    ) -> Page[RecoverableView]:
        """The sessions waiting for an operator (every one unless ``limit``)."""
        return await self._all_pages("/v1/recoverable", _RecoverableList, "sessions", limit, cursor)

    async def recovery_preview(
        self, session_id: str, migrate_pins: dict[str, str] | None = None
    ) -> RecoverableView:
        """What resuming would face; with ``migrate_pins`` holding ``agent``, also what moving
        the session to that version of its published agent changes (``agent_diff``)."""
        query = "&".join(
            f"migrate_pin={quote(f'{name}={version}', safe='')}"
            for name, version in (migrate_pins or {}).items()
        )
        path = f"/v1/recoverable/{quote(session_id, safe='')}" + (f"?{query}" if query else "")
        return await self._get(path, RecoverableView)

    async def resume(
        self, session_id: str, migrate_pins: dict[str, str] | None = None, confirm: bool = True
    ) -> None:
        """Resume a recoverable session. Show ``recovery_preview`` to whoever decides first; with
        ``confirm=False`` the daemon answers ``ConfirmationRequired`` carrying that preview."""
        body = {"migrate_pins": dict(migrate_pins or {}), "confirm": confirm}
        await self._send("POST", f"/v1/sessions/{quote(session_id, safe='')}/resume", body=body)

    async def resume_matching(
        self,
        *,
        category: str | None = None,
        reason: str | None = None,
        goal: str | None = None,
        session_ids: list[str] | None = None,
    ) -> list[ResumeOutcome]:
        """Resume every recoverable session the filter matches (``category`` exactly, ``reason``
        and ``goal`` as substrings, ``session_ids``: only these); one outcome per session. Show
        each one's ``recovery_preview`` to whoever decides first (pass the ids shown)."""
        which = RecoverableFilter(
            category=category, reason=reason, goal=goal, session_ids=session_ids
        )
        body = {"filter": msgspec.to_builtins(which), "confirm": True}
        response = await self._send("POST", "/v1/recoverable/resume", body=body)
        return msgspec.json.decode(response.content, type=_BulkResumed).sessions

    async def list_workers(
        self, limit: int | None = None, cursor: str | None = None
    ) -> Page[WorkerView]:
        """The workers, live ones first (every one unless ``limit``)."""
        return await self._all_pages("/v1/workers", _WorkerList, "workers", limit, cursor)

    # --- catalog ------------------------------------------------------------------------------

    async def list_daemons(self) -> list[DaemonView]:
        """The live daemons on the daemon's NATS, the one answering first."""
        return (await self._get("/v1/daemons", _DaemonList)).daemons

    async def drain_daemon(self, daemon_id: str) -> None:
        """Ask a daemon to drain: its sessions move to the live peers at node boundaries."""
        await self._send("POST", f"/v1/daemons/{quote(daemon_id, safe='')}/drain")

    async def put_skill(self, name: str, body: str) -> SkillView:
        response = await self._send(
            "PUT", f"/v1/skills/{quote(name, safe='')}", body={"body": body}
        )
        return msgspec.json.decode(response.content, type=SkillView)

    async def get_skill(self, name: str) -> SkillView:
        return await self._get(f"/v1/skills/{quote(name, safe='')}", SkillView)

    async def list_skills(self) -> list[SkillView]:
        return (await self._get("/v1/skills", _SkillList)).skills

    async def skill_history(self, name: str) -> list[SkillView]:
        """The kept revisions of a skill, oldest first (also after it was deleted)."""
        return (await self._get(f"/v1/skills/{quote(name, safe='')}/history", _SkillList)).skills

    async def delete_skill(self, name: str) -> None:
        await self._send("DELETE", f"/v1/skills/{quote(name, safe='')}")

    async def publish_agent(self, definition: dict[str, Any]) -> Published:
        response = await self._send("POST", "/v1/agents", body=definition)
        agent = msgspec.json.decode(response.content, type=AgentRecordView)
        return Published(created=response.status_code == 201, agent=agent)

    async def list_agents(self) -> list[AgentRecordView]:
        return (await self._get("/v1/agents", _AgentList)).agents

    async def get_agent(self, name: str, version: str | None = None) -> AgentRecordView:
        params = {"version": version} if version is not None else None
        return await self._get(f"/v1/agents/{quote(name, safe='')}", AgentRecordView, params)

    # --- operations ---------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        """The daemon's health report (``ok`` and details); raises ``ServerUnavailable`` on 503."""
        return await self._get("/healthz", dict[str, Any])

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics")).text


# --- the blocking client ----------------------------------------------------------------------


class SyncClient:
    """``Client`` for code without an event loop: the same methods, blocking. Each call runs on a
    private event loop in a background thread; ``close()`` (or ``with``) stops it."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="apomesh-sdk", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> Client:
            return Client(url, token, **options)

        self._client = self._run(make())

    @property
    def url(self) -> str:
        return self._client.url

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            work.close()
            raise RuntimeError("this SyncClient is closed")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start_session(
        self,
        goal: str,
        agent: str | None = None,
        definition: dict[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> str:
        return self._run(
            self._client.start_session(goal, agent, definition, idempotency_key=idempotency_key)
        )

    def get_session(self, session_id: str) -> SessionView:
        return self._run(self._client.get_session(session_id))

    def agent_conversation(self, session_id: str, ref: str) -> AgentConversation:
        return self._run(self._client.agent_conversation(session_id, ref))

    def list_sessions(
        self,
        status: str | None = None,
        query: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[SessionSummary]:
        return self._run(self._client.list_sessions(status, query, limit, cursor))

    def purge_session(self, session_id: str) -> None:
        self._run(self._client.purge_session(session_id))

    def purge_ended(self, ended_before_seconds: float) -> list[str]:
        return self._run(self._client.purge_ended(ended_before_seconds))

    def list_hitl(
        self, limit: int | None = None, cursor: str | None = None
    ) -> Page[PendingPauseView]:
        return self._run(self._client.list_hitl(limit, cursor))

    def events(self, session_id: str, after: int = -1) -> Iterator[EventRecord]:
        stream = self._client.events(session_id, after)

        async def step() -> EventRecord | None:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

        async def close() -> None:
            closer = getattr(stream, "aclose", None)
            if closer is not None:
                await closer()

        try:
            while (record := self._run(step())) is not None:
                yield record
        finally:
            if not self._closed:
                self._run(close())

    def wait(self, session_id: str, timeout: float | None = None) -> SessionView:
        return self._run(self._client.wait(session_id, timeout))

    def verify_session(self, session_id: str) -> dict[str, Any]:
        return self._run(self._client.verify_session(session_id))

    def answer_hitl(self, session_id: str, pause_id: str, answer: str) -> None:
        self._run(self._client.answer_hitl(session_id, pause_id, answer))

    def cancel(self, session_id: str) -> None:
        self._run(self._client.cancel(session_id))

    def list_recoverable(
        self, limit: int | None = None, cursor: str | None = None
    ) -> Page[RecoverableView]:
        return self._run(self._client.list_recoverable(limit, cursor))

    def recovery_preview(
        self, session_id: str, migrate_pins: dict[str, str] | None = None
    ) -> RecoverableView:
        return self._run(self._client.recovery_preview(session_id, migrate_pins))

    def resume(
        self, session_id: str, migrate_pins: dict[str, str] | None = None, confirm: bool = True
    ) -> None:
        self._run(self._client.resume(session_id, migrate_pins, confirm))

    def resume_matching(
        self,
        *,
        category: str | None = None,
        reason: str | None = None,
        goal: str | None = None,
        session_ids: list[str] | None = None,
    ) -> list[ResumeOutcome]:
        return self._run(
            self._client.resume_matching(
                category=category, reason=reason, goal=goal, session_ids=session_ids
            )
        )

    def list_workers(self, limit: int | None = None, cursor: str | None = None) -> Page[WorkerView]:
        return self._run(self._client.list_workers(limit, cursor))

    def list_daemons(self) -> list[DaemonView]:
        return self._run(self._client.list_daemons())

    def drain_daemon(self, daemon_id: str) -> None:
        self._run(self._client.drain_daemon(daemon_id))

    def put_skill(self, name: str, body: str) -> SkillView:
        return self._run(self._client.put_skill(name, body))

    def get_skill(self, name: str) -> SkillView:
        return self._run(self._client.get_skill(name))

    def list_skills(self) -> list[SkillView]:
        return self._run(self._client.list_skills())

    def skill_history(self, name: str) -> list[SkillView]:
        return self._run(self._client.skill_history(name))

    def delete_skill(self, name: str) -> None:
        self._run(self._client.delete_skill(name))

    def publish_agent(self, definition: dict[str, Any]) -> Published:
        return self._run(self._client.publish_agent(definition))

    def list_agents(self) -> list[AgentRecordView]:
        return self._run(self._client.list_agents())

    def get_agent(self, name: str, version: str | None = None) -> AgentRecordView:
        return self._run(self._client.get_agent(name, version))

    def health(self) -> dict[str, Any]:
        return self._run(self._client.health())

    def metrics(self) -> str:
        return self._run(self._client.metrics())
