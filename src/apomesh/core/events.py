"""The event catalogue: every fact a session's log can hold, as frozen msgspec Structs.

All events form one tagged union, ``Event`` (the tag field is ``kind`` and its value is the class
name). Event names are contract: operators, the SDK and the console see them. Adding a field with a
default is compatible; anything else goes through an upcaster (``apomesh.core.envelope``).
Derived facts (spawn-tree edges, terminal-ness, the in-flight sets) are never events: the fold
computes them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from apomesh.core.definition import AgentConfig, PinnedSkill

AgentRef = str
"""An agent's identity inside its session: ``root`` or ``<parent>/<n>``. Kept across resumes."""

Phase = Literal[
    "born",
    "dispatched",
    "running",
    "planned",
    "paused",
    "waiting",
    "completed",
    "failed",
    "cancelled",
]
TERMINAL_PHASES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})

SessionStatus = Literal["completed", "failed", "cancelled"]


class PluginPin(msgspec.Struct, frozen=True):
    """A plugin that shaped a session, by distribution name and version."""

    name: str
    version: str


class SessionShape(msgspec.Struct, frozen=True):
    """Everything a session was built from, resolved and pinned at start."""

    coordination: str
    coordination_params: dict[str, Any]
    root: AgentConfig
    roles: dict[str, AgentConfig]
    skills: list[PinnedSkill]
    plugins: list[PluginPin]
    source: Literal["published", "catalog", "inline"] = "inline"
    agent: str | None = None  # "name@version" of a published agent
    definition_digest: str = ""


class _Event(msgspec.Struct, frozen=True, tag_field="kind", tag=lambda name: name):
    pass


class SessionStarted(_Event, frozen=True):
    """The durable bootstrap: goal, root agent and the whole pinned shape."""

    goal: str
    root: AgentRef
    shape: SessionShape


class AgentLifecycle(_Event, frozen=True):
    """An agent's phase changed. Its birth (``born``) carries its full config and its parent; a
    later phase that carries ``config`` moves the agent to that config from then on (an operator
    migrated the session to another agent version), its birth config staying on the log."""

    agent: AgentRef
    phase: Phase
    parent: AgentRef | None = None
    config: AgentConfig | None = None
    task: str | None = None
    task_index: int | None = None
    worker: str | None = None
    epoch: int | None = None
    output: str | None = None
    plan: list[str] | None = None
    reason: str | None = None
    batch: str | None = None
    purpose: str | None = None
    ask: str | None = None
    """On the root's ``dispatched``: the place in the coordinator loop this dispatch answers
    (``<checkpoint index>:<n>``, the n-th ``ask_root`` since that checkpoint; ``-1`` before the
    first), so a replayed loop gets each answer back by its position, never another one's."""
    prompt_digest: str | None = None
    """With ``ask``: the sha256 (hex, 16 digits) of the prompt asked there."""


class CoordinatorCheckpoint(_Event, frozen=True):
    """Opaque coordinator loop state (position only; sub-task outputs come from the children)."""

    position: str
    state: bytes


TURN_SOURCE = "turn"
"""The snapshot source of a model turn recorded before it is acted on."""


class AgentSnapshotted(_Event, frozen=True):
    """A pointer to snapshot bytes in the daemon's LMDB store (never the bytes themselves).
    ``source`` is one of the registered checkpoint sources; ``turn`` (``TURN_SOURCE``) points to a
    model turn recorded before it was acted on."""

    agent: AgentRef
    snapshot_id: int
    source: str
    step: int
    size: int = 0
    model_calls: int = 0
    """The model calls this snapshot is the first to record (1 for a node or turn that asked the
    model, 0 for one that replays a recorded turn), with their token usage below."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ModelRetrying(_Event, frozen=True):
    """An agent's model call failed with an error worth trying again: the worker waits ``delay``
    seconds (the API's ``Retry-After`` when it named one) before attempt ``attempt + 1``.
    ``reason`` is the provider's short message. Logged only when a call fails, so a session shows
    what it is waiting for; the agent's next snapshot or phase clears it."""

    agent: AgentRef
    attempt: int
    delay: float
    reason: str
    status: int | None = None


class ToolCallIntent(_Event, frozen=True):
    """A side-effecting tool call is about to run (journal key = content hash of tool + args).
    A second intent for the same key after an unknown outcome says why the call runs again:
    ``resolution="not_happened"`` when the tool's probe found the earlier attempt had no effect
    (empty for an idempotent re-run)."""

    agent: AgentRef
    key: str
    tool: str
    args: dict[str, Any]
    idempotent: bool = False
    resolution: str = ""


class ToolCallRecorded(_Event, frozen=True):
    """The result of a journaled call; ``outcome`` is ``ok``, ``error`` or ``unknown``.
    ``resolved_by="probe"`` when the outcome was unknown and the tool's probe found that the
    effect happened (the result is the probe's); an ``unknown`` one's ``result`` says why it
    stays unresolved."""

    agent: AgentRef
    key: str
    tool: str
    outcome: Literal["ok", "error", "unknown"]
    result: str
    resolved_by: str = ""


class AsyncJobStarted(_Event, frozen=True):
    """The daemon started an agent's async job. ``job_id`` is the call's journal key, unique
    within its agent only (jobs are named by agent and job id). A job whose tool declares a side
    effect is a journaled effect: ``side_effect`` counts it as one, and while it has no result its
    outcome is unknown."""

    agent: AgentRef
    job_id: str
    tool: str
    args: dict[str, Any]
    side_effect: bool = False
    idempotent: bool = False


class AsyncJobFinished(_Event, frozen=True):
    """An async job ended. ``unknown``: it did not run to an answer (a crash cut it short) and was
    not run again; ``result`` says why."""

    agent: AgentRef
    job_id: str
    ok: bool
    result: str
    unknown: bool = False


class HitlPaused(_Event, frozen=True):
    """An agent asked a human; ``pause_id`` is derived from the call so a re-run never re-asks."""

    agent: AgentRef
    pause_id: str
    question: str


class HitlAnswered(_Event, frozen=True):
    pause_id: str
    answer: str
    by: str = "operator"


class AgentResuming(_Event, frozen=True):
    """An agent is being re-dispatched (lost worker, restart, operator) from a snapshot."""

    agent: AgentRef
    reason: str
    worker: str | None = None
    snapshot_id: int | None = None
    epoch: int = 0


class AgentResumed(_Event, frozen=True):
    """The re-dispatched agent's dispatch completed."""

    agent: AgentRef
    epoch: int = 0


class SessionRecovered(_Event, frozen=True):
    """A daemon took a session up again after a restart (``path``: ``auto`` or ``operator``)."""

    path: Literal["auto", "operator"]
    checkpoint_index: int | None = None
    incarnation: str = ""


class SessionSuspended(_Event, frozen=True):
    """A daemon shutting down (``SIGTERM``) stopped driving the session with every in-flight agent
    at a node boundary and no side effect in flight: the next daemon resumes it by itself, under
    the same agent refs. Written only as the last event a daemon appends to the session."""

    reason: str = "daemon shutdown"
    incarnation: str = ""


class OperatorAction(_Event, frozen=True):
    """A deliberate operator act: ``resume``, ``cancel`` or ``migrate_pin``."""

    action: Literal["resume", "cancel", "migrate_pin"]
    by: str = "operator"
    detail: dict[str, Any] = {}


class SessionEnded(_Event, frozen=True):
    """The terminal event of a session."""

    status: SessionStatus
    output: str | None = None
    reason: str | None = None


Event = (
    SessionStarted
    | AgentLifecycle
    | CoordinatorCheckpoint
    | AgentSnapshotted
    | ModelRetrying
    | ToolCallIntent
    | ToolCallRecorded
    | AsyncJobStarted
    | AsyncJobFinished
    | HitlPaused
    | HitlAnswered
    | AgentResuming
    | AgentResumed
    | SessionRecovered
    | SessionSuspended
    | OperatorAction
    | SessionEnded
)

EVENT_TYPES: tuple[type[_Event], ...] = (
    SessionStarted,
    AgentLifecycle,
    CoordinatorCheckpoint,
    AgentSnapshotted,
    ModelRetrying,
    ToolCallIntent,
    ToolCallRecorded,
    AsyncJobStarted,
    AsyncJobFinished,
    HitlPaused,
    HitlAnswered,
    AgentResuming,
    AgentResumed,
    SessionRecovered,
    SessionSuspended,
    OperatorAction,
    SessionEnded,
)
EVENT_NAMES: frozenset[str] = frozenset(t.__name__ for t in EVENT_TYPES)


def event_name(event: Event) -> str:
    return type(event).__name__
