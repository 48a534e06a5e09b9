"""The HTTP contract in one place: the request and response bodies, the route table (method, path,
role, bodies, statuses) the app is built from, and the OpenAPI 3.1 document generated from both.

Schemas come from the msgspec Structs themselves (``msgspec.json.schema_components``), so the
document cannot drift from what the API decodes and encodes. Each route names the role it needs
(``read``, ``operator``, or none for open routes) and the statuses it may answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from apomesh._version import __version__
from apomesh.api.tokens import Role
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
    VerificationView,
    WorkerView,
)

# --- request bodies ---------------------------------------------------------------------------


class AgentChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A published agent by name, and version (the highest when omitted)."""

    name: str
    version: str | None = None


class CreateSessionBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/sessions``: a goal and either a published agent or an inline definition.

    ``agent`` may also be the string ``"name"`` or ``"name@version"``."""

    goal: str
    agent: AgentChoice | str | None = None
    definition: dict[str, Any] | None = None


class HitlAnswerBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    answer: str


class ResumeBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/sessions/{id}/resume``. Without ``confirm: true`` the API answers 409
    ``confirm_required`` with the preview the operator must see first."""

    migrate_pins: dict[str, str] = {}
    confirm: bool = False


class BulkResumeBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/recoverable/resume``: resume every recoverable session ``filter`` matches (all
    of them with an empty filter). Without ``confirm: true`` the API answers 409
    ``confirm_required`` with the sessions it would resume and what each faces."""

    filter: RecoverableFilter = RecoverableFilter()
    confirm: bool = False


class CancelBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/sessions/{id}/cancel`` takes no fields (an empty body is fine too)."""


class SkillBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    body: str


AgentDefinitionBody = dict[str, Any]
"""``POST /v1/agents``: an agent definition (the TOML form, as JSON), validated by the daemon."""

# --- response bodies --------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error answer: a stable machine code and a message for people."""

    error: str
    message: str


class ConfirmRequired(msgspec.Struct, frozen=True):
    """The 409 answer to a resume without ``confirm: true``: what resuming would face."""

    preview: RecoverableView
    error: str = "confirm_required"
    message: str = (
        "resuming needs confirm=true after the unknown outcomes and pin differences are seen"
    )


class BulkConfirmRequired(msgspec.Struct, frozen=True):
    """The 409 answer to a bulk resume without ``confirm: true``: the sessions it would resume."""

    sessions: list[RecoverableView]
    error: str = "confirm_required"
    message: str = "resuming needs confirm=true after these sessions' previews are seen"


class BulkResumed(msgspec.Struct, frozen=True):
    """One outcome per matching session, in the order they were resumed."""

    sessions: list[ResumeOutcome]


class SessionCreated(msgspec.Struct, frozen=True):
    session_id: str


class ActionAccepted(msgspec.Struct, frozen=True):
    """An operator action was logged; its effects arrive as events."""

    session_id: str
    action: str


class SessionList(msgspec.Struct, frozen=True):
    sessions: list[SessionSummary]
    next_cursor: str | None = None
    """Pass it as ``cursor`` for the next page; null on the last one (``api.pagination``)."""


class RecoverableList(msgspec.Struct, frozen=True):
    sessions: list[RecoverableView]
    next_cursor: str | None = None


class WorkerList(msgspec.Struct, frozen=True):
    workers: list[WorkerView]
    next_cursor: str | None = None


class PauseList(msgspec.Struct, frozen=True):
    pauses: list[PendingPauseView]
    next_cursor: str | None = None


class PurgeBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/sessions/purge``: purge every session that ended more than
    ``ended_before_seconds`` ago."""

    ended_before_seconds: float


class Purged(msgspec.Struct, frozen=True):
    sessions: list[str]
    """The ids of the sessions purged."""


class DaemonList(msgspec.Struct, frozen=True):
    daemons: list[DaemonView]


class DrainAccepted(msgspec.Struct, frozen=True):
    """A daemon was asked to drain: its sessions move to the live peers at node boundaries."""

    daemon_id: str
    action: str = "drain"


class SkillList(msgspec.Struct, frozen=True):
    skills: list[SkillView]


class AgentList(msgspec.Struct, frozen=True):
    agents: list[AgentRecordView]


HealthBody = dict[str, Any]

# --- the route table --------------------------------------------------------------------------


class Media(msgspec.Struct, frozen=True):
    """A non-JSON answer: its content type and what it holds."""

    content_type: str
    description: str


class QueryParam(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "string" | "integer" | "boolean"
    description: str


class RouteSpec(msgspec.Struct, frozen=True):
    """One route: the app registers ``operation`` as its handler and the document describes it."""

    method: str
    path: str
    operation: str
    summary: str
    role: Role | None
    responses: Mapping[int, Any]
    request: Any = None
    query: tuple[QueryParam, ...] = ()
    errors: tuple[int, ...] = ()
    tags: tuple[str, ...] = msgspec.field(default_factory=tuple)
    request_optional: bool = False
    greedy: tuple[str, ...] = ()
    """Path parameters whose value may hold ``/`` (an agent ref such as ``root/0``)."""

    @property
    def route_path(self) -> str:
        """The path as the router matches it: a greedy parameter takes the rest of the path."""
        path = self.path
        for name in self.greedy:
            path = path.replace(f"{{{name}}}", f"{{{name}:path}}")
        return path


_SSE = Media(
    "text/event-stream",
    "Server-sent events: `id: <index>`, `event: <EventName>`, "
    "`data: <envelope JSON>`; ends after SessionEnded. With `deltas=true`, also "
    "`event: ModelDelta` frames without an id while a streaming model writes",
)
_TEXT_METRICS = Media("text/plain; version=0.0.4", "Prometheus text exposition")
_HTML = Media("text/html", "The operator console")
_ASSET = Media("application/octet-stream", "A console asset (JavaScript, CSS)")
_ICON = Media("image/x-icon", "The console's icon")

_PAGE = (
    QueryParam("limit", "integer", "at most this many (1..1000, default 100)"),
    QueryParam("cursor", "string", "the `next_cursor` of the page before"),
)

ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec(
        "POST",
        "/v1/sessions",
        "create_session",
        "Start a session",
        "operator",
        {201: SessionCreated},
        request=CreateSessionBody,
        errors=(400, 404, 409, 413),
        tags=("sessions",),
    ),
    RouteSpec(
        "POST",
        "/v1/sessions/purge",
        "purge_ended",
        "Purge every session that ended more than ended_before_seconds ago: its log subject "
        "and records",
        "operator",
        {200: Purged},
        request=PurgeBody,
        errors=(400, 413),
        tags=("sessions",),
    ),
    RouteSpec(
        "GET",
        "/v1/sessions",
        "list_sessions",
        "List live and historical sessions",
        "read",
        {200: SessionList},
        errors=(400,),
        tags=("sessions",),
        query=(
            QueryParam(
                "status",
                "string",
                "keep one status: running, paused, completed, failed, cancelled, recoverable",
            ),
            QueryParam("q", "string", "keep sessions whose goal or id contains this text"),
            *_PAGE,
        ),
    ),
    RouteSpec(
        "GET",
        "/v1/sessions/{session_id}",
        "get_session",
        "A session's folded state",
        "read",
        {200: SessionView},
        errors=(404, 409),
        tags=("sessions",),
    ),
    RouteSpec(
        "GET",
        "/v1/sessions/{session_id}/agents/{ref}",
        "agent_conversation",
        "One agent and its conversation: model text, tool calls with arguments and results, "
        "human questions and answers, unknown outcomes (the ref may hold `/`, e.g. root/0)",
        "read",
        {200: AgentConversation},
        errors=(404, 409),
        tags=("sessions",),
        greedy=("ref",),
    ),
    RouteSpec(
        "GET",
        "/v1/sessions/{session_id}/events",
        "session_events",
        "A session's events as server-sent events (replay, then live)",
        "read",
        {200: _SSE},
        errors=(400, 404),
        tags=("sessions",),
        query=(
            QueryParam(
                "after",
                "integer",
                "start after this index (the Last-Event-ID "
                "header wins when both are given); -1 replays everything",
            ),
            QueryParam(
                "deltas",
                "boolean",
                "true: the live part also carries the pieces of model turns as streaming models "
                "write them (`event: ModelDelta` frames without an id, never replayed)",
            ),
        ),
    ),
    RouteSpec(
        "GET",
        "/v1/sessions/{session_id}/verify",
        "verify_session",
        "Fold a session's log from its start and check it against the stored snapshots, "
        "journal and completed record",
        "read",
        {200: VerificationView},
        errors=(404,),
        tags=("sessions",),
    ),
    RouteSpec(
        "POST",
        "/v1/sessions/{session_id}/hitl/{pause_id}",
        "answer_hitl",
        "Answer an open human-in-the-loop pause",
        "operator",
        {202: ActionAccepted},
        request=HitlAnswerBody,
        errors=(400, 404, 409, 413),
        tags=("sessions",),
    ),
    RouteSpec(
        "POST",
        "/v1/sessions/{session_id}/resume",
        "resume_session",
        "Resume a recoverable session (needs confirm=true; 409 confirm_required shows the "
        "preview otherwise)",
        "operator",
        {202: ActionAccepted, 409: ConfirmRequired},
        request=ResumeBody,
        errors=(400, 404, 413),
        tags=("recovery",),
    ),
    RouteSpec(
        "POST",
        "/v1/sessions/{session_id}/cancel",
        "cancel_session",
        "Cancel a session",
        "operator",
        {202: ActionAccepted},
        request=CancelBody,
        request_optional=True,
        errors=(400, 404, 409, 413),
        tags=("sessions",),
    ),
    RouteSpec(
        "DELETE",
        "/v1/sessions/{session_id}",
        "purge_session",
        "Purge an ended session: its log subject and every record of it (409 when it has not "
        "ended)",
        "operator",
        {204: None},
        errors=(404, 409),
        tags=("sessions",),
    ),
    RouteSpec(
        "GET",
        "/v1/hitl",
        "list_hitl",
        "Open human-in-the-loop pauses: which session and agent asks what",
        "read",
        {200: PauseList},
        query=_PAGE,
        errors=(400,),
        tags=("sessions",),
    ),
    RouteSpec(
        "GET",
        "/v1/recoverable",
        "list_recoverable",
        "Sessions waiting for an operator to resume them",
        "read",
        {200: RecoverableList},
        query=_PAGE,
        errors=(400,),
        tags=("recovery",),
    ),
    RouteSpec(
        "POST",
        "/v1/recoverable/resume",
        "resume_matching",
        "Resume every recoverable session a filter matches (needs confirm=true; 409 "
        "confirm_required lists them otherwise); one outcome per session",
        "operator",
        {200: BulkResumed, 409: BulkConfirmRequired},
        request=BulkResumeBody,
        request_optional=True,
        errors=(400, 413),
        tags=("recovery",),
    ),
    RouteSpec(
        "GET",
        "/v1/recoverable/{session_id}",
        "recovery_preview",
        "What resuming a session would face: unknown outcomes and pin differences",
        "read",
        {200: RecoverableView},
        query=(
            QueryParam(
                "migrate_pin",
                "string",
                "NAME=VERSION, repeatable; `agent=VERSION` adds agent_diff: what moving the "
                "session to that published version of its agent changes",
            ),
        ),
        errors=(400, 404, 409),
        tags=("recovery",),
    ),
    RouteSpec(
        "GET",
        "/v1/workers",
        "list_workers",
        "Workers and the agents they run",
        "read",
        {200: WorkerList},
        query=_PAGE,
        errors=(400,),
        tags=("workers",),
    ),
    RouteSpec(
        "GET",
        "/v1/daemons",
        "list_daemons",
        "The live daemons on this NATS: sessions owned, load, lease age",
        "read",
        {200: DaemonList},
        tags=("daemons",),
    ),
    RouteSpec(
        "POST",
        "/v1/daemons/{daemon_id}/drain",
        "drain_daemon",
        "Drain a daemon for maintenance: its sessions stop at node boundaries and move to the "
        "live peers; it places no new session",
        "operator",
        {202: DrainAccepted},
        errors=(404, 503),
        tags=("daemons",),
    ),
    RouteSpec(
        "GET",
        "/v1/skills",
        "list_skills",
        "The skill catalog",
        "read",
        {200: SkillList},
        tags=("catalog",),
    ),
    RouteSpec(
        "PUT",
        "/v1/skills/{name}",
        "put_skill",
        "Create or replace a skill",
        "operator",
        {200: SkillView},
        request=SkillBody,
        errors=(400, 413),
        tags=("catalog",),
    ),
    RouteSpec(
        "GET",
        "/v1/skills/{name}",
        "get_skill",
        "One skill",
        "read",
        {200: SkillView},
        errors=(404,),
        tags=("catalog",),
    ),
    RouteSpec(
        "GET",
        "/v1/skills/{name}/history",
        "skill_history",
        "A skill's kept revisions, oldest first (also after it was deleted)",
        "read",
        {200: SkillList},
        errors=(404,),
        tags=("catalog",),
    ),
    RouteSpec(
        "DELETE",
        "/v1/skills/{name}",
        "delete_skill",
        "Delete a skill",
        "operator",
        {204: None},
        errors=(404,),
        tags=("catalog",),
    ),
    RouteSpec(
        "POST",
        "/v1/agents",
        "publish_agent",
        "Publish an agent (201 new, 200 same content again, 409 other content)",
        "operator",
        {201: AgentRecordView, 200: AgentRecordView},
        request=AgentDefinitionBody,
        errors=(400, 404, 409, 413),
        tags=("catalog",),
    ),
    RouteSpec(
        "GET",
        "/v1/agents",
        "list_agents",
        "Published agents",
        "read",
        {200: AgentList},
        tags=("catalog",),
    ),
    RouteSpec(
        "GET",
        "/v1/agents/{name}",
        "get_agent",
        "A published agent (highest version unless ?version=)",
        "read",
        {200: AgentRecordView},
        errors=(404,),
        tags=("catalog",),
        query=(QueryParam("version", "string", "an exact version"),),
    ),
    RouteSpec(
        "GET",
        "/healthz",
        "health",
        "Liveness and readiness (open)",
        None,
        {200: HealthBody, 503: HealthBody},
        tags=("operations",),
    ),
    RouteSpec(
        "GET",
        "/metrics",
        "metrics",
        "Prometheus metrics",
        "read",
        {200: _TEXT_METRICS},
        tags=("operations",),
    ),
    RouteSpec(
        "GET",
        "/openapi.json",
        "openapi",
        "This document (open)",
        None,
        {200: dict[str, Any]},
        tags=("operations",),
    ),
    RouteSpec(
        "GET",
        "/",
        "console",
        "The operator console (open; its API calls need a token)",
        None,
        {200: _HTML},
        tags=("console",),
    ),
    RouteSpec(
        "GET",
        "/favicon.ico",
        "favicon",
        "The console's icon (open)",
        None,
        {200: _ICON},
        tags=("console",),
    ),
    RouteSpec(
        "GET",
        "/static/{path}",
        "static",
        "Console assets (open)",
        None,
        {200: _ASSET},
        errors=(404,),
        tags=("console",),
    ),
)

_ERROR_TEXT = {
    400: "invalid body, query or definition, or a Host this daemon does not answer for",
    401: "no valid bearer token",
    403: "the token's role is too small, or a write from a page of another origin",
    404: "unknown session, pause, skill or agent",
    409: "the request conflicts with the current state",
    413: "body over the size limit",
    415: "a write that is not Content-Type: application/json",
    429: "too many failed authentications from this address",
    500: "unexpected server error",
    503: "the daemon cannot reach its log right now",
}

_PATH_PARAM = re.compile(r"{([a-z_]+)}")


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route in ``ROUTES``."""
    types: list[Any] = [ErrorBody]
    for route in ROUTES:
        if route.request is not None:
            types.append(route.request)
        types.extend(
            r for r in route.responses.values() if r is not None and not isinstance(r, Media)
        )
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip(map(_type_key, types), schemas, strict=True))
    error_schema = schema_of[_type_key(ErrorBody)]
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        operation: dict[str, Any] = {
            "operationId": route.operation,
            "summary": route.summary,
            "tags": list(route.tags),
            "x-apomesh-role": route.role,
        }
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PATH_PARAM.findall(route.path)
        ]
        parameters += [
            {
                "name": q.name,
                "in": "query",
                "required": False,
                "description": q.description,
                "schema": {"type": q.kind},
            }
            for q in route.query
        ]
        if route.operation == "create_session":
            parameters.append(
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "description": "the same key sent again answers the session its first request"
                    " started (201 again, the same id), also after a daemon restart; with another body, 409"
                    " idempotency_conflict",
                    "schema": {"type": "string", "maxLength": 255},
                }
            )
        if route.operation == "session_events":
            parameters.append(
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "description": "resume exactly after this index",
                    "schema": {"type": "string"},
                }
            )
        if parameters:
            operation["parameters"] = parameters
        if route.request is not None:
            operation["requestBody"] = {
                "required": not route.request_optional,
                "content": {"application/json": {"schema": schema_of[_type_key(route.request)]}},
            }
        responses: dict[str, Any] = {}
        for status, answer in route.responses.items():
            responses[str(status)] = _response(answer, schema_of)
        errors = set(route.errors) | {400, 500}  # 400: a foreign Host (api.guards)
        if route.method in ("POST", "PUT", "PATCH", "DELETE"):
            errors |= {403, 415}  # cross-origin or non-JSON writes (api.guards)
        if route.role is not None:
            operation["security"] = [{"bearer": []}]
            errors |= {401, 403, 429}
        for status in sorted(errors):
            responses.setdefault(
                str(status),
                {
                    "description": _ERROR_TEXT[status],
                    "content": {"application/json": {"schema": error_schema}},
                },
            )
        operation["responses"] = dict(sorted(responses.items()))
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "apomesh",
            "version": __version__,
            "description": "Durable agent sessions: REST + server-sent events. See docs/api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _type_key(kind: Any) -> str:
    return repr(kind)


def _response(answer: Any, schema_of: dict[str, Any]) -> dict[str, Any]:
    if answer is None:
        return {"description": "no content"}
    if isinstance(answer, Media):
        return {
            "description": answer.description,
            "content": {answer.content_type: {"schema": {"type": "string"}}},
        }
    name = getattr(answer, "__name__", "JSON")
    return {
        "description": name,
        "content": {"application/json": {"schema": schema_of[_type_key(answer)]}},
    }
