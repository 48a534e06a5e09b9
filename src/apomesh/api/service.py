"""The daemon as the HTTP API sees it: one ``DaemonService`` Protocol of async methods.

The daemon (``apomesh.runtime``) implements it; the API (``apomesh.api.app``) only calls it, so the
API can be built and tested against an in-memory fake. Methods raise ``apomesh.core.errors`` types
on purpose and the API maps them to HTTP statuses (see ``docs/api.md``):

    NotFound -> 404, DefinitionError / CatalogError -> 400, PayloadTooLarge -> 413,
    PublishConflict / PinError / Fenced / AppendConflict / a log that cannot be read -> 409,
    OwnedElsewhere (a write for a session another daemon owns) -> 409 ``owned_by_another_daemon``,
    DaemonDraining -> 503,
    a retryable error (LogUnavailable) -> 503, any other ApomeshError -> 409 (the request is
    well formed but the session's state does not allow it, e.g. resuming a session that is not on
    the recoverable list, or cancelling one that already ended).

Anything else that escapes is a bug: the API answers 500 with a generic message and logs it.
``by`` names who asked (a token's name, or ``operator`` when auth is off) for ``OperatorAction``
and ``HitlAnswered`` events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from apomesh.core.envelope import Envelope
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
from apomesh.runtime.protocol import TurnDelta


class DaemonService(Protocol):
    """Everything the REST API, the SSE stream and the console need from the daemon."""

    async def create_session(
        self,
        goal: str,
        *,
        agent: tuple[str, str | None] | None,
        definition: dict[str, Any] | None,
        by: str,
        idempotency_key: str | None = None,
    ) -> str:
        """Start a session and return its id once ``SessionStarted`` is durable.

        With ``idempotency_key`` the same key sent again (also after a daemon restart) answers
        the session its first request started, starting nothing; the same key with
        another goal, agent or definition raises ``IdempotencyConflict``.

        ``agent`` is a published agent's (name, version or None for the latest); ``definition`` an
        inline agent definition (a decoded TOML/JSON mapping, not yet validated). The API never
        passes both; when it passes neither the daemon uses its default agent or raises
        ``DefinitionError``. Raises ``NotFound`` for an unknown agent, ``DefinitionError`` for an
        invalid definition, ``PayloadTooLarge`` for one over the limits, ``PinError`` when it
        needs plugins that are not installed."""
        ...

    async def list_sessions(self, *, status: str | None, query: str | None) -> list[SessionSummary]:
        """Live and historical sessions, most recently updated first (ties by id); the API
        pages them.

        ``status`` keeps one status (``running``, ``paused``, ``completed``, ``failed``,
        ``cancelled``, ``recoverable``); ``query`` keeps sessions whose goal or id contains it,
        case-insensitively."""
        ...

    async def get_session(self, session_id: str) -> SessionView:
        """The folded view. Raises ``NotFound``; a log that cannot be read whole raises its
        ``CodecError``/``FoldError``."""
        ...

    async def agent_conversation(self, session_id: str, ref: str) -> AgentConversation:
        """Agent ``ref``'s conversation, rebuilt from its logged snapshot and the log.
        Raises ``NotFound`` for an unknown session or agent."""
        ...

    async def read_events(self, session_id: str, after: int) -> list[Envelope]:
        """Every envelope with index > ``after`` now in the log, in order. Raises ``NotFound``."""
        ...

    def tail_events(self, session_id: str, after: int) -> AsyncIterator[Envelope]:
        """Every envelope with index > ``after``: those already in the log first, then live ones
        as they are appended, in order and without gaps, through resumes. It ends after the
        session's terminal event (``SessionEnded``), at once if that is at or before ``after``.
        The caller may stop early (closing the iterator). Raises ``NotFound``."""
        ...

    def live_deltas(self, session_id: str) -> AsyncIterator[TurnDelta]:
        """The pieces of the session's model turns published from now on, as streaming models
        write them (a preview, never replayed), until the caller stops."""
        ...

    async def verify_session(self, session_id: str) -> VerificationView:
        """Fold the session's log from its start and check it against the stored snapshots,
        journal and completed-session record; disagreements are reported in the answer, not
        raised. ``NotFound`` for an unknown session."""
        ...

    async def answer_hitl(self, session_id: str, pause_id: str, answer: str, *, by: str) -> None:
        """Answer an open pause (logs ``HitlAnswered``). ``NotFound`` for an unknown session or
        a pause that is not open."""
        ...

    async def resume(self, session_id: str, *, migrate_pins: dict[str, str], by: str) -> None:
        """Deliberately resume a session from the recoverable list (logs ``OperatorAction``).

        ``migrate_pins`` maps plugin names to the installed versions the operator accepts in place
        of the pinned ones; its key ``agent`` moves a session started from a published agent to
        another published version of it. ``NotFound`` for an unknown session or agent version,
        ``ApomeshError`` when it is not recoverable (``MigrationRefused`` when a migration was
        asked, or the move changes the coordination kind), ``PinError`` when its pins still
        cannot be satisfied."""
        ...

    async def resume_matching(self, which: RecoverableFilter, *, by: str) -> list[ResumeOutcome]:
        """Resume every session on the recoverable list that ``which`` matches, each as
        ``resume`` would (no pin moves), and answer one outcome per session: ``resumed``, or
        ``refused`` with the error's code and message. Nothing matching answers an empty list."""
        ...

    async def recovery_preview(
        self, session_id: str, migrate_pins: dict[str, str] | None = None
    ) -> RecoverableView:
        """What resuming would face: unknown outcomes and pin differences, and with an ``agent``
        entry in ``migrate_pins`` what moving to that agent version changes (``agent_diff``).
        ``NotFound`` for an unknown session or agent version, ``ApomeshError`` when it is not
        on the recoverable list."""
        ...

    async def cancel(self, session_id: str, *, by: str) -> None:
        """Cancel a live or recoverable session. ``ApomeshError`` when it already ended."""
        ...

    async def list_hitl(self) -> list[PendingPauseView]:
        """Every open human-in-the-loop pause, by session then pause."""
        ...

    async def purge(self, session_id: str) -> None:
        """Remove an ended session's log subject and records. ``NotFound``; ``CommandRefused``
        for a session that has not ended."""
        ...

    async def purge_ended(self, ended_before: float) -> list[str]:
        """Purge every session that ended before ``ended_before`` (unix seconds); their ids."""
        ...

    async def list_recoverable(self) -> list[RecoverableView]:
        """Sessions waiting for an operator (including undecodable ones, loudly)."""
        ...

    async def list_workers(self) -> list[WorkerView]:
        """Workers seen recently, alive or declared lost."""
        ...

    async def list_daemons(self) -> list[DaemonView]:
        """The live daemons on this NATS (their presence records), this one first."""
        ...

    async def drain_daemon(self, daemon_id: str) -> None:
        """Ask a live daemon to drain: its sessions stop at node boundaries and move to the live
        peers. ``NotFound`` for a daemon that is not alive; a retryable error when it does not
        answer."""
        ...

    async def put_skill(self, name: str, body: str) -> SkillView:
        """Create or replace a skill in the mutable catalog. ``CatalogError`` for a bad name,
        ``PayloadTooLarge`` for a body over the limit."""
        ...

    async def get_skill(self, name: str) -> SkillView:
        """``NotFound`` for an unknown skill."""
        ...

    async def list_skills(self) -> list[SkillView]: ...

    async def skill_history(self, name: str) -> list[SkillView]:
        """The kept revisions of a skill, oldest first, including those from before it was
        deleted. ``NotFound`` when the catalog never held the name."""
        ...

    async def delete_skill(self, name: str) -> None:
        """``NotFound`` for an unknown skill."""
        ...

    async def publish_agent(self, definition: dict[str, Any]) -> tuple[bool, AgentRecordView]:
        """Publish an immutable (name, version). Returns (created, record): ``created`` is False
        when the same content was already published. ``PublishConflict`` when that name and
        version exist with other content; ``DefinitionError`` for an invalid definition or one
        without a version; ``NotFound``/``MissingSkill`` when a skill it names does not exist."""
        ...

    async def list_agents(self) -> list[AgentRecordView]: ...

    async def get_agent(self, name: str, version: str | None) -> AgentRecordView:
        """A published agent; the highest version when ``version`` is None. ``NotFound``."""
        ...

    async def metrics_text(self) -> str:
        """The Prometheus text exposition of the daemon's metrics."""
        ...

    async def health(self) -> dict[str, Any]:
        """A small JSON-able mapping with at least ``ok: bool`` (False answers 503)."""
        ...
