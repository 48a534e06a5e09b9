"""The HTTP application: REST endpoints, the SSE event stream, the console and its assets, built
from the route table in ``apomesh.api.openapi`` over a ``DaemonService``.

Every endpoint goes through one wrapper that checks the route's role, turns bad bodies into 400
``invalid_body``, maps the daemon's typed errors to statuses (see ``apomesh.api.service``) and
turns anything unexpected into a logged 500 with a generic message. Bodies are decoded and encoded
with msgspec; a raw body over ``max_body_bytes`` is refused with 413 before it is parsed, and one
nesting deeper than ``MAX_BODY_DEPTH`` with 400 before it is decoded. In front of the routes,
``apomesh.api.guards.BrowserGuard`` refuses foreign ``Host`` headers and cross-origin or non-JSON
writes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from apomesh.api.auth import ANONYMOUS_OPERATOR, Authenticator, AuthFailure, AuthSettings, Identity
from apomesh.api.guards import BrowserGuard
from apomesh.api.openapi import (
    ROUTES,
    ActionAccepted,
    AgentChoice,
    AgentList,
    BulkConfirmRequired,
    BulkResumeBody,
    BulkResumed,
    CancelBody,
    ConfirmRequired,
    CreateSessionBody,
    DaemonList,
    DrainAccepted,
    ErrorBody,
    HitlAnswerBody,
    PauseList,
    PurgeBody,
    Purged,
    RecoverableList,
    ResumeBody,
    RouteSpec,
    SessionCreated,
    SessionList,
    SkillBody,
    SkillList,
    WorkerList,
    openapi_document,
)
from apomesh.api.pagination import InvalidCursor, SortKey, page
from apomesh.api.service import DaemonService
from apomesh.api.sse import (
    DEFAULT_KEEPALIVE_SECONDS,
    EventStreamResponse,
    EventStreams,
    InvalidStart,
    session_frames,
    start_after,
)
from apomesh.core.errors import (
    ApomeshError,
    AppendConflict,
    CatalogError,
    CodecError,
    CommandRefused,
    DefinitionError,
    Fenced,
    FoldError,
    IdempotencyConflict,
    NotFound,
    PayloadTooLarge,
    PinError,
    PluginError,
    PublishConflict,
    StoreError,
)
from apomesh.core.views import SESSION_STATUSES

log = logging.getLogger("apomesh.api")

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
MAX_BODY_DEPTH = 64
"""Deepest nesting of a request body's arrays and objects; deeper is 400 ``invalid_body``."""
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000
MAX_IDEMPOTENCY_KEY = 255
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CONSOLE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

# Order matters: the first matching class wins (PublishConflict before CatalogError).
ERROR_STATUS: tuple[tuple[type[ApomeshError], int], ...] = (
    (NotFound, 404),
    (PublishConflict, 409),
    (PayloadTooLarge, 413),
    (DefinitionError, 400),
    (CatalogError, 400),
    (PinError, 409),
    (IdempotencyConflict, 409),
    (CommandRefused, 409),
    (Fenced, 409),
    (AppendConflict, 409),
    (CodecError, 409),
    (FoldError, 409),
    (StoreError, 503),
    (PluginError, 500),
)

T = TypeVar("T")
Handler = Callable[[Request, Identity], Awaitable[Response]]


class JSONResponse(Response):
    """A response whose content is encoded with msgspec."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


class BadRequest(Exception):
    """A body, query or path the API refuses before asking the daemon (400)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    return JSONResponse(ErrorBody(error=code, message=message), status_code=status, headers=headers)


def error_status(exc: ApomeshError) -> int:
    """The HTTP status of a typed daemon error."""
    for kind, status in ERROR_STATUS:
        if isinstance(exc, kind):
            return status
    return 503 if exc.retryable else 409


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


class _Api:
    """The endpoint handlers, bound to one service and one set of settings."""

    def __init__(
        self,
        service: DaemonService,
        authenticator: Authenticator,
        *,
        max_body_bytes: int,
        keepalive_seconds: float,
        streams: EventStreams,
    ) -> None:
        self.service = service
        self.streams = streams
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes
        self.keepalive_seconds = keepalive_seconds
        self._openapi: bytes | None = None

    # --- the wrapper every endpoint goes through ---------------------------------------------

    def endpoint(
        self, spec: RouteSpec, handler: Handler
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                if spec.role is None:
                    identity = Identity(ANONYMOUS_OPERATOR, "operator")
                else:
                    identity = self.authenticator.check(
                        client_address(request), request.headers.get("authorization"), spec.role
                    )
                session_id = request.path_params.get("session_id")
                if session_id is not None and not _plausible_session_id(session_id):
                    # No session can have such an id: answer as for any unknown one.
                    raise NotFound(f"session {session_id[:80]!r}")
                return await handler(request, identity)
            except AuthFailure as exc:
                headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
                if exc.retry_after is not None:
                    headers["Retry-After"] = str(exc.retry_after)
                return error_response(exc.status, exc.code, exc.message, headers)
            except BadRequest as exc:
                return error_response(400, exc.code, exc.message)
            except ApomeshError as exc:
                status = error_status(exc)
                if status >= 500:
                    log.error(
                        "%s %s failed: %s (%s)", spec.method, spec.path, exc.code, exc.message
                    )
                return error_response(status, exc.code, exc.message)
            except Exception:
                log.exception("unexpected error in %s %s", spec.method, spec.path)
                return error_response(500, "internal", "internal server error")

        run.__name__ = spec.operation
        return run

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise BadRequest("invalid_body", "Content-Length is not a number") from None
            if size > self.max_body_bytes:
                raise PayloadTooLarge("request body", size, self.max_body_bytes)
        chunks: list[bytes] = []
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > self.max_body_bytes:
                raise PayloadTooLarge("request body", received, self.max_body_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    async def decode_body(self, request: Request, kind: type[T], *, optional: bool = False) -> T:
        raw = await self.read_body(request)
        if not raw.strip():
            if optional:
                return msgspec.json.decode(b"{}", type=kind)
            raise BadRequest("invalid_body", "a JSON body is required")
        if json_depth(raw) > MAX_BODY_DEPTH:
            raise BadRequest(
                "invalid_body", f"the JSON body nests deeper than {MAX_BODY_DEPTH} levels"
            )
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError as exc:
            raise BadRequest("invalid_body", str(exc)) from None

    # --- sessions -----------------------------------------------------------------------------

    async def create_session(self, request: Request, who: Identity) -> Response:
        body = await self.decode_body(request, CreateSessionBody)
        if not body.goal.strip():
            raise BadRequest("invalid_body", "`goal` must not be empty")
        if body.agent is not None and body.definition is not None:
            raise BadRequest("invalid_body", "give either `agent` or `definition`, not both")
        agent = _agent_choice(body.agent) if body.agent is not None else None
        key = request.headers.get("idempotency-key")
        if key is not None and not (
            0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isascii() and key.isprintable()
        ):
            raise BadRequest(
                "invalid_header",
                f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
            )
        # A retry with the same key is answered as the first request was: 201, the same id.
        session_id = await self.service.create_session(
            body.goal, agent=agent, definition=body.definition, by=who.name, idempotency_key=key
        )
        return JSONResponse(SessionCreated(session_id=session_id), status_code=201)

    async def list_sessions(self, request: Request, who: Identity) -> Response:
        query = request.query_params
        status = query.get("status") or None
        if status is not None and status not in SESSION_STATUSES:
            raise BadRequest(
                "invalid_query", f"status must be one of {', '.join(SESSION_STATUSES)}"
            )
        text = (query.get("q") or "").strip() or None
        sessions = await self.service.list_sessions(status=status, query=text)
        rows, cursor = _page(request, sessions, lambda r: (-r.updated_at, r.session_id))
        return JSONResponse(SessionList(sessions=rows, next_cursor=cursor))

    async def purge_session(self, request: Request, who: Identity) -> Response:
        await self.service.purge(request.path_params["session_id"])
        return Response(status_code=204)

    async def purge_ended(self, request: Request, who: Identity) -> Response:
        body = await self.decode_body(request, PurgeBody)
        if not body.ended_before_seconds >= 0:
            raise BadRequest("invalid_body", "`ended_before_seconds` must be 0 or more")
        purged = await self.service.purge_ended(time.time() - body.ended_before_seconds)
        return JSONResponse(Purged(sessions=purged))

    async def list_hitl(self, request: Request, who: Identity) -> Response:
        pauses = await self.service.list_hitl()
        rows, cursor = _page(request, pauses, lambda p: (p.session_id, p.pause_id))
        return JSONResponse(PauseList(pauses=rows, next_cursor=cursor))

    async def get_session(self, request: Request, who: Identity) -> Response:
        view = await self.service.get_session(request.path_params["session_id"])
        return JSONResponse(view)

    async def agent_conversation(self, request: Request, who: Identity) -> Response:
        session_id, ref = request.path_params["session_id"], request.path_params["ref"]
        return JSONResponse(await self.service.agent_conversation(session_id, ref))

    async def session_events(self, request: Request, who: Identity) -> Response:
        session_id = request.path_params["session_id"]
        try:
            after = start_after(request.headers, request.query_params)
        except InvalidStart as exc:
            raise BadRequest("invalid_query", str(exc)) from None
        deltas = request.query_params.get("deltas", "false")
        if deltas not in ("true", "false"):
            raise BadRequest("invalid_query", "deltas must be true or false")
        # Read before answering, so an unknown session is a plain 404 rather than a broken stream.
        replay = await self.service.read_events(session_id, after)
        frames = session_frames(self.service, session_id, after, replay, deltas=deltas == "true")
        authorization = request.headers.get("authorization")
        return EventStreamResponse(
            frames,
            keepalive=self.keepalive_seconds,
            streams=self.streams,
            still_authorized=(
                (lambda: self.authenticator.still_valid(authorization, "read"))
                if self.authenticator.settings.enabled
                else None
            ),
        )

    async def verify_session(self, request: Request, who: Identity) -> Response:
        return JSONResponse(await self.service.verify_session(request.path_params["session_id"]))

    async def answer_hitl(self, request: Request, who: Identity) -> Response:
        session_id = request.path_params["session_id"]
        body = await self.decode_body(request, HitlAnswerBody)
        await self.service.answer_hitl(
            session_id, request.path_params["pause_id"], body.answer, by=who.name
        )
        return JSONResponse(
            ActionAccepted(session_id=session_id, action="answer_hitl"), status_code=202
        )

    async def resume_session(self, request: Request, who: Identity) -> Response:
        session_id = request.path_params["session_id"]
        body = await self.decode_body(request, ResumeBody, optional=True)
        if not body.confirm:
            preview = await self.service.recovery_preview(
                session_id, migrate_pins=dict(body.migrate_pins)
            )
            return JSONResponse(ConfirmRequired(preview=preview), status_code=409)
        await self.service.resume(session_id, migrate_pins=dict(body.migrate_pins), by=who.name)
        return JSONResponse(ActionAccepted(session_id=session_id, action="resume"), status_code=202)

    async def cancel_session(self, request: Request, who: Identity) -> Response:
        session_id = request.path_params["session_id"]
        await self.decode_body(request, CancelBody, optional=True)
        await self.service.cancel(session_id, by=who.name)
        return JSONResponse(ActionAccepted(session_id=session_id, action="cancel"), status_code=202)

    # --- recovery and workers -----------------------------------------------------------------

    async def list_recoverable(self, request: Request, who: Identity) -> Response:
        views = await self.service.list_recoverable()
        rows, cursor = _page(request, views, lambda r: (-r.last_event_at, r.session_id))
        return JSONResponse(RecoverableList(sessions=rows, next_cursor=cursor))

    async def resume_matching(self, request: Request, who: Identity) -> Response:
        body = await self.decode_body(request, BulkResumeBody, optional=True)
        if not body.confirm:
            previews = [
                view for view in await self.service.list_recoverable() if body.filter.matches(view)
            ]
            return JSONResponse(BulkConfirmRequired(sessions=previews), status_code=409)
        outcomes = await self.service.resume_matching(body.filter, by=who.name)
        return JSONResponse(BulkResumed(sessions=outcomes))

    async def recovery_preview(self, request: Request, who: Identity) -> Response:
        migrate: dict[str, str] = {}
        for pin in request.query_params.getlist("migrate_pin"):
            name, sep, version = pin.partition("=")
            if not sep or not name.strip() or not version.strip():
                raise BadRequest("invalid_query", f"migrate_pin wants NAME=VERSION, not {pin!r}")
            migrate[name.strip()] = version.strip()
        session_id = request.path_params["session_id"]
        return JSONResponse(await self.service.recovery_preview(session_id, migrate_pins=migrate))

    async def list_workers(self, request: Request, who: Identity) -> Response:
        workers = await self.service.list_workers()
        rows, cursor = _page(request, workers, lambda w: (0 if w.alive else 1, w.id))
        return JSONResponse(WorkerList(workers=rows, next_cursor=cursor))

    # --- daemons ------------------------------------------------------------------------------

    async def list_daemons(self, request: Request, who: Identity) -> Response:
        return JSONResponse(DaemonList(daemons=await self.service.list_daemons()))

    async def drain_daemon(self, request: Request, who: Identity) -> Response:
        daemon_id = request.path_params["daemon_id"]
        await self.service.drain_daemon(daemon_id)
        return JSONResponse(DrainAccepted(daemon_id=daemon_id), status_code=202)

    # --- catalog ------------------------------------------------------------------------------

    async def list_skills(self, request: Request, who: Identity) -> Response:
        return JSONResponse(SkillList(skills=await self.service.list_skills()))

    async def put_skill(self, request: Request, who: Identity) -> Response:
        body = await self.decode_body(request, SkillBody)
        return JSONResponse(await self.service.put_skill(request.path_params["name"], body.body))

    async def get_skill(self, request: Request, who: Identity) -> Response:
        return JSONResponse(await self.service.get_skill(request.path_params["name"]))

    async def skill_history(self, request: Request, who: Identity) -> Response:
        return JSONResponse(
            SkillList(skills=await self.service.skill_history(request.path_params["name"]))
        )

    async def delete_skill(self, request: Request, who: Identity) -> Response:
        await self.service.delete_skill(request.path_params["name"])
        return Response(status_code=204)

    async def publish_agent(self, request: Request, who: Identity) -> Response:
        definition = await self.decode_body(request, dict[str, Any])
        created, record = await self.service.publish_agent(definition)
        return JSONResponse(record, status_code=201 if created else 200)

    async def list_agents(self, request: Request, who: Identity) -> Response:
        return JSONResponse(AgentList(agents=await self.service.list_agents()))

    async def get_agent(self, request: Request, who: Identity) -> Response:
        version = request.query_params.get("version") or None
        return JSONResponse(await self.service.get_agent(request.path_params["name"], version))

    # --- operations and console ---------------------------------------------------------------

    async def health(self, request: Request, who: Identity) -> Response:
        try:
            report = await self.service.health()
        except Exception as exc:
            log.error("health check failed: %s", type(exc).__name__)
            return JSONResponse({"ok": False, "error": type(exc).__name__}, status_code=503)
        # Degraded (no live worker) still answers 200: the daemon serves, a restart would not help.
        return JSONResponse(report, status_code=200 if report.get("ok", True) else 503)

    async def metrics(self, request: Request, who: Identity) -> Response:
        text = await self.service.metrics_text()
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    async def openapi(self, request: Request, who: Identity) -> Response:
        if self._openapi is None:
            self._openapi = msgspec.json.encode(openapi_document())
        return Response(self._openapi, media_type="application/json")

    async def console(self, request: Request, who: Identity) -> Response:
        return FileResponse(
            STATIC_DIR / "index.html", media_type="text/html", headers=CONSOLE_HEADERS
        )

    async def favicon(self, request: Request, who: Identity) -> Response:
        return FileResponse(
            STATIC_DIR / "favicon.ico",
            media_type="image/x-icon",
            headers={"Cache-Control": "public, max-age=86400"},
        )


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not
    count), found without decoding it: the decoder and everything after it recurse."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        depth += _BRACKET_STEP[byte]
        deepest = max(deepest, depth)
    return deepest


def _agent_choice(choice: AgentChoice | str) -> tuple[str, str | None]:
    if isinstance(choice, AgentChoice):
        name, version = choice.name, choice.version
    else:
        name, sep, version_text = choice.partition("@")
        version = version_text if sep else None
    if not name.strip() or (version is not None and not version.strip()):
        raise BadRequest("invalid_body", "`agent` needs a name and, if given, a non-empty version")
    return name, version


def _plausible_session_id(session_id: str) -> bool:
    """Whether ``session_id`` could name a session: one NATS subject token (no ``.``, ``*``,
    ``>``, spaces or control characters) of at most 256 characters."""
    return (
        0 < len(session_id) <= 256
        and session_id.isprintable()
        and not any(c in session_id for c in ".*> \t")
    )


def _page(
    request: Request, rows: Sequence[T], key: Callable[[T], SortKey]
) -> tuple[list[T], str | None]:
    """The page of ``rows`` the request's ``limit`` and ``cursor`` ask for (``api.pagination``)."""
    query = request.query_params
    limit = _int_param(query.get("limit"), "limit", DEFAULT_LIST_LIMIT, 1, MAX_LIST_LIMIT)
    try:
        return page(rows, key, limit=limit, cursor=query.get("cursor") or None)
    except InvalidCursor as exc:
        raise BadRequest("invalid_query", str(exc)) from None


def _int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest("invalid_query", f"{name} must be an integer") from None
    if not low <= value <= high:
        raise BadRequest("invalid_query", f"{name} must be between {low} and {high}")
    return value


async def _http_error(request: Request, exc: Exception) -> Response:
    """Router misses (unknown path, wrong method) answer JSON like every other error."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))


def create_app(
    service: DaemonService,
    *,
    auth: AuthSettings,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The ASGI app serving ``service``. ``keepalive_seconds`` spaces the SSE keep-alive comments;
    ``allowed_hosts`` are the ``Host`` names it answers (None: any; ``apomesh serve`` always
    gives ``[http]``'s). Every app refuses cross-origin and non-JSON writes (``api.guards``)."""
    streams = EventStreams()
    api = _Api(
        service,
        Authenticator(auth),
        max_body_bytes=max_body_bytes,
        keepalive_seconds=keepalive_seconds,
        streams=streams,
    )
    routes: list[BaseRoute] = []
    for spec in ROUTES:
        if spec.operation == "static":
            routes.append(Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"))
            continue
        handler: Handler = getattr(api, spec.operation)
        routes.append(
            Route(
                spec.route_path,
                endpoint=api.endpoint(spec, handler),
                methods=[spec.method],
                name=spec.operation,
            )
        )
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error},
        middleware=[Middleware(BrowserGuard, allowed_hosts=allowed_hosts)],
    )
    app.state.service = service
    app.state.auth = auth
    app.state.event_streams = streams
    return app


def close_event_streams(app: Starlette) -> None:
    """End the app's open SSE streams (and refuse new ones): call it before stopping the server,
    so shutdown does not wait on them. Clients resume with ``Last-Event-ID`` elsewhere or later."""
    streams: EventStreams = app.state.event_streams
    streams.close_all()


class ApiServer(uvicorn.Server):
    """uvicorn serving the API app, ending the app's open event streams as it shuts down.

    Use it like ``uvicorn.Server``: ``await server.serve()`` and ``server.should_exit = True``."""

    def __init__(
        self, app: Starlette, *, host: str = "127.0.0.1", port: int = 8750, **options: Any
    ) -> None:
        options.setdefault("timeout_graceful_shutdown", 5)
        options.setdefault("lifespan", "off")
        # httptools' C parser: uvicorn's h11 protocol compiled some forty regular expressions as
        # it was imported at every start (8 ms of a restart); no websockets are served.
        options.setdefault("http", "httptools")
        options.setdefault("ws", "none")
        super().__init__(uvicorn.Config(app, host=host, port=port, **options))
        self.api_app = app
        self.listening = asyncio.Event()
        """Set once the server listens (``startup`` done)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.listening.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        close_event_streams(self.api_app)
        await super().shutdown(sockets=sockets)
