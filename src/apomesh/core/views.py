"""Read-only views of sessions, workers and catalogs, as the REST API answers them and the SDK reads
them back: plain msgspec Structs shared by both sides, plus the pure builders that derive a session's
views from its folded ``SessionState``. Nothing here does I/O; times are the log's own timestamps.

Fields added later get defaults, and readers ignore fields they do not know, so a newer daemon and
an older client (or the reverse) still understand each other.
"""

from __future__ import annotations

from typing import Any

import msgspec

from apomesh.core.events import PluginPin
from apomesh.core.state import AgentView, SessionState

SESSION_STATUSES: tuple[str, ...] = (
    "running",
    "paused",
    "completed",
    "failed",
    "cancelled",
    "recoverable",
)
"""Every status a session view can carry; ``recoverable`` is decided by the daemon, not the fold."""

TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})


class AgentSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One agent of a session's spawn tree: where it hangs, what it does and how far it got."""

    ref: str
    parent: str | None
    name: str
    role: str
    phase: str
    task: str | None = None
    worker: str | None = None
    epoch: int = 0
    resumes: int = 0
    resuming: bool = False
    output: str | None = None
    reason: str | None = None
    batch: str | None = None
    version: str = ""
    """The version of the config the agent runs with now (its migrated one, if any)."""
    usage: TokenUsage | None = None
    """Token usage of the model calls its snapshots recorded (None before the first)."""
    retrying: ModelRetryView | None = None
    """The failed model call it waits to try again, while it waits."""
    waiting_for: str | None = None
    """Set by the daemon when the agent needs a worker and no live one runs it: what it waits
    for (``a capable worker; w1 was lost``). ``worker`` is then the lost one, if any."""


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens spent on model calls, as the providers reported them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0


def token_usage(prompt_tokens: int, completion_tokens: int, model_calls: int) -> TokenUsage:
    return TokenUsage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, model_calls=model_calls
    )


class ModelRetryView(msgspec.Struct, frozen=True, kw_only=True):
    """A model call that failed and will be tried again: attempt ``attempt`` failed with
    ``reason`` (HTTP ``status`` when there was one); the next one starts ``delay`` seconds after
    ``at`` (the log's timestamp)."""

    attempt: int
    delay: float
    reason: str
    status: int | None = None
    at: float = 0.0


class HitlPauseView(msgspec.Struct, frozen=True, kw_only=True):
    """An open human-in-the-loop pause: which agent asks what."""

    pause_id: str
    agent: str
    question: str


class PendingPauseView(msgspec.Struct, frozen=True, kw_only=True):
    """An open pause of a session, as ``GET /v1/hitl`` lists it: what to answer and where."""

    session_id: str
    pause_id: str
    agent: str
    question: str
    goal: str = ""


class UnknownOutcomeView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A side effect whose intent is logged but whose result never was (or was ``unknown``)."""

    agent: str
    tool: str
    key: str
    args: dict[str, Any]
    job: bool = False
    """An async job with a side effect (``key`` is its job id), not a tool call (only sent when
    true)."""


class SessionView(msgspec.Struct, frozen=True, kw_only=True):
    """The folded state of one session, as ``GET /v1/sessions/{id}`` answers it."""

    session_id: str
    status: str
    goal: str
    output: str | None = None
    side_effects: int = 0
    last_index: int = -1
    agents: list[AgentSummary] = []
    hitl_pending: list[HitlPauseView] = []
    unknown_outcomes: list[UnknownOutcomeView] = []
    started_at: float = 0.0
    updated_at: float = 0.0
    coordination: str = ""
    recoveries: int = 0
    resumes: int = 0
    reason: str | None = None
    agent: str | None = None
    """``name@version`` of the published agent the session runs now (after any migration)."""
    owner: str | None = None
    """The id of the daemon that drives the session (holds its lease), when one does."""
    usage: TokenUsage = TokenUsage()
    """Token usage of every agent's recorded model calls together."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


CONVERSATION_KINDS: tuple[str, ...] = (
    "prompt",
    "model",
    "tool_call",
    "tool_result",
    "question",
    "answer",
    "unknown_outcome",
    "plan",
    "output",
    "ended",
)
"""Every ``ConversationEntry.kind``: what the agent was asked (``prompt``), what the model said
(``model``: its text; ``plan``/``output``: its answer), the tools it called and what they
answered, the questions it put to a human and their answers, a side effect whose outcome is
unknown, and how the agent ended (``ended``: failed, cancelled, out of budget, with the reason)."""


class ConversationEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One step of an agent's conversation, in the order the agent lived it.

    ``index``/``at`` are the log index and time of the event that records it, when one does
    (model text lives in snapshots only and has neither). ``call_id`` ties a tool result to its
    call; ``key`` is a journaled call's idempotency key (side effects and async jobs only)."""

    kind: str
    text: str = ""
    tool: str = ""
    args: dict[str, Any] | None = None
    call_id: str = ""
    key: str = ""
    outcome: str = ""
    """A tool result's ``ok``, ``error`` or ``unknown``; a journaled call with no result yet:
    ``pending``."""
    pause_id: str = ""
    by: str = ""
    index: int = -1
    at: float = 0.0


class AgentConversation(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/sessions/{id}/agents/{ref}``: one agent and its conversation, rebuilt from the
    agent's latest logged snapshot (the messages) and the session's log (tool calls' journal,
    human questions and answers, unknown outcomes, how it ended)."""

    session_id: str
    agent: AgentSummary
    instructions: str = ""
    entries: list[ConversationEntry] = []
    unknown_outcomes: list[UnknownOutcomeView] = []
    snapshot_id: int | None = None
    """The snapshot the messages come from (None: the agent has none yet)."""


class DaemonView(msgspec.Struct, frozen=True, kw_only=True):
    """One live daemon, as ``GET /v1/daemons`` answers it (from its presence record)."""

    id: str
    host: str
    url: str
    incarnation: str
    state: str
    """``active``, ``draining`` or ``drained`` (it handed its sessions over)."""
    sessions: int
    stranded: int
    load: int
    """Agents it has running on workers now."""
    started_at: float
    last_seen: float
    lease_age: float
    """Seconds since it last renewed its record (and its leases)."""
    this: bool = False
    """Whether this is the daemon that answered."""


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One row of the sessions list."""

    session_id: str
    status: str
    goal: str
    last_index: int = -1
    updated_at: float = 0.0
    side_effects: int = 0


class WorkerView(msgspec.Struct, frozen=True, kw_only=True):
    """A worker the daemon knows: its last heartbeat (unix seconds) and the agents it runs."""

    id: str
    name: str
    last_heartbeat: float
    agents: list[str] = []
    tools: list[str] = []
    providers: list[str] = []
    alive: bool = True
    plugins: dict[str, str] = {}
    """The plugin versions it registered with (it runs only agents whose session pins them)."""
    max_agents: int = 0
    """How many agents it runs at once, for every daemon it serves together (``agents`` lists
    them all); 0 when not known."""


class PinDiff(msgspec.Struct, frozen=True, kw_only=True):
    """A pinned plugin whose installed version differs: ``new`` is None when it is not installed."""

    name: str
    old: str
    new: str | None


class PinChange(msgspec.Struct, frozen=True, kw_only=True):
    """A plugin pin an agent-version migration changes: None where one side does not pin it."""

    name: str
    old: str | None
    new: str | None


class SkillChange(msgspec.Struct, frozen=True, kw_only=True):
    """A pinned skill whose digest an agent-version migration changes (None: absent there)."""

    name: str
    old: str | None
    new: str | None


class AgentDiff(msgspec.Struct, frozen=True, kw_only=True):
    """What moving a session to another published agent version changes, old against new.

    ``roles`` names the configs (``root`` and each role) that differ; ``problem`` says why the
    migration would be refused (a changed coordination kind, a pin not satisfied), else None."""

    old: str
    new: str
    old_digest: str
    new_digest: str
    coordination: tuple[str, str]
    coordination_params: tuple[dict[str, Any], dict[str, Any]]
    skills: list[SkillChange] = []
    plugins: list[PinChange] = []
    roles: list[str] = []
    problem: str | None = None


class RecoverableFilter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which recoverable sessions a bulk resume takes: every field given must match (``category``
    exactly; ``reason`` and ``goal`` as case-insensitive substrings; ``session_ids``: only these,
    e.g. exactly the ones an operator was shown)."""

    category: str | None = None
    reason: str | None = None
    goal: str | None = None
    session_ids: list[str] | None = None

    def matches(self, view: RecoverableView) -> bool:
        return (
            (self.category is None or view.category == self.category)
            and (self.reason is None or self.reason.lower() in view.reason.lower())
            and (self.goal is None or self.goal.lower() in view.goal.lower())
            and (self.session_ids is None or view.session_id in self.session_ids)
        )


class ResumeOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One session of a bulk resume: ``resumed``, or ``refused`` with the error's code and
    message (its pins cannot be satisfied, another operator resumed it first, ...)."""

    session_id: str
    outcome: str
    error: str = ""
    message: str = ""


class RecoverableView(msgspec.Struct, frozen=True, kw_only=True):
    """A session waiting for an operator, with what the operator must see before resuming it."""

    session_id: str
    goal: str
    reason: str
    category: str = ""
    side_effects: int = 0
    last_event_at: float = 0.0
    unknown_outcomes: list[UnknownOutcomeView] = []
    pin_diff: list[PinDiff] = []
    agent_diff: AgentDiff | None = None
    """Shown when the preview was asked about moving to another agent version."""


class VerificationProblem(msgspec.Struct, frozen=True, kw_only=True):
    """One disagreement between a session's log and what the daemon stored about it.

    ``kind`` is a stable code: ``undecodable``, ``duplicate_event_id``, ``snapshot_missing``,
    ``snapshot_mismatch``, ``snapshot_unreadable``, ``definition_mismatch``, ``journal_mismatch``,
    ``journal_not_on_log``, ``completed_mismatch`` or ``completed_not_terminal``."""

    kind: str
    message: str
    agent: str | None = None
    index: int | None = None


class VerificationView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/sessions/{id}/verify``: the log folded from its start and checked against the
    stored snapshots, journal and completed-session record. ``ok`` when nothing disagrees;
    ``notes`` say what is unusual but not wrong (e.g. a completed record not written yet)."""

    session_id: str
    ok: bool
    status: str = ""
    events: int = 0
    last_index: int = -1
    agents: int = 0
    snapshots_checked: int = 0
    journal_checked: int = 0
    completed_record: bool = False
    problems: list[VerificationProblem] = []
    notes: list[str] = []


class SkillView(msgspec.Struct, frozen=True, kw_only=True):
    """A skill in the mutable catalog; ``revision`` grows on every put."""

    name: str
    body: str
    digest: str
    revision: int = 0


class AgentRecordView(msgspec.Struct, frozen=True, kw_only=True):
    """A published, immutable agent (name, version) and what it was sealed with."""

    name: str
    version: str
    digest: str
    definition: dict[str, Any]
    skills: list[str] = []
    plugins: list[PluginPin] = []


REASON_PHASES: frozenset[str] = frozenset({"paused", "waiting", "failed", "cancelled"})
"""The phases whose reason an agent summary shows: why it stopped or waits. A reason an agent
gave earlier (the human answer it waited for) is not shown once it runs again or completes."""


def agent_summary(agent: AgentView) -> AgentSummary:
    """The summary of one agent of a folded session."""
    return AgentSummary(
        ref=agent.ref,
        parent=agent.parent,
        name=agent.config.name if agent.config is not None else agent.ref,
        role=agent.config.role if agent.config is not None else "",
        phase=agent.phase,
        task=agent.task,
        worker=agent.worker,
        epoch=agent.epoch,
        resumes=agent.resumes,
        resuming=agent.resuming,
        output=agent.output,
        reason=agent.reason if agent.phase in REASON_PHASES else None,
        batch=agent.batch,
        version=agent.current_config.version if agent.current_config is not None else "",
        usage=token_usage(agent.prompt_tokens, agent.completion_tokens, agent.model_calls)
        if agent.model_calls
        else None,
        retrying=ModelRetryView(
            attempt=agent.retrying.attempt,
            delay=agent.retrying.delay,
            reason=agent.retrying.reason,
            status=agent.retrying.status,
            at=agent.retrying_ts,
        )
        if agent.retrying is not None
        else None,
    )


def session_view(
    state: SessionState, status: str | None = None, reason: str | None = None
) -> SessionView:
    """The view of a folded session. ``status``/``reason`` override the fold's (the daemon passes
    ``recoverable`` and why); otherwise the status is the fold's and the reason the terminal one."""
    ended_reason = state.ended.reason if state.ended is not None else None
    agents = [agent_summary(agent) for agent in state.agents.values()]
    return SessionView(
        session_id=state.session_id,
        status=status if status is not None else state.status,
        goal=state.goal,
        output=state.output,
        side_effects=state.side_effects,
        last_index=state.last_index,
        agents=agents,
        hitl_pending=[
            HitlPauseView(pause_id=p.pause_id, agent=p.agent, question=p.question)
            for p in state.hitl_pending.values()
        ],
        unknown_outcomes=unknown_outcomes(state),
        started_at=state.started_ts,
        updated_at=state.last_ts,
        coordination=state.bootstrap.shape.coordination if state.bootstrap is not None else "",
        recoveries=state.recoveries,
        resumes=state.resumes,
        reason=reason if reason is not None else ended_reason,
        agent=state.effective_shape.agent if state.effective_shape is not None else None,
        usage=token_usage(
            sum(a.prompt_tokens for a in state.agents.values()),
            sum(a.completion_tokens for a in state.agents.values()),
            sum(a.model_calls for a in state.agents.values()),
        ),
    )


def unknown_outcomes(state: SessionState) -> list[UnknownOutcomeView]:
    """The session's side effects whose outcome is unknown, in log order."""
    entries = sorted(state.unknown_outcomes, key=lambda e: e.intent_index)
    return [
        UnknownOutcomeView(agent=e.agent, tool=e.tool, key=e.key, args=dict(e.args), job=e.job)
        for e in entries
    ]


def session_summary(state: SessionState, status: str | None = None) -> SessionSummary:
    """The list row of a folded session (``status`` overrides the fold's, as in ``session_view``)."""
    return SessionSummary(
        session_id=state.session_id,
        status=status if status is not None else state.status,
        goal=state.goal,
        last_index=state.last_index,
        updated_at=state.last_ts,
        side_effects=state.side_effects,
    )


def summarize(view: SessionView) -> SessionSummary:
    """The list row of a session view."""
    return SessionSummary(
        session_id=view.session_id,
        status=view.status,
        goal=view.goal,
        last_index=view.last_index,
        updated_at=view.updated_at,
        side_effects=view.side_effects,
    )
