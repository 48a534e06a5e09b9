"""Session state: the fold of a session's log, and the narrower bootstrap view.

``apply(state, envelope)`` folds one envelope into ``state`` in place and returns it; ``fold``
folds a whole log; ``check(state, envelopes)`` folds a step into a trial copy and raises what the
fold would raise, leaving ``state`` untouched (a session's writer checks a step before appending it). Folding is O(events): each event touches only the entries it names. The index of
every envelope must be exactly the next one (``IndexGap``/``DuplicateIndex`` otherwise), and facts
that contradict the log so far raise ``InvalidLog``, so a log is never folded from a partial or
inconsistent picture. Everything here is derived: spawn-tree edges from lifecycle parents,
terminal-ness from the terminal event, in-flight jobs and pauses from unmatched start/finish pairs
(jobs are named by their agent and job id: two agents making the same call run two jobs; a job
whose tool declares a side effect is also a journal entry, counted as a side effect, and unknown
until it finishes),
and the effective shape and plugin pins: ``SessionStarted``'s, with every ``migrate_pin`` operator
action applied over them (an agent-version migration embeds the new pinned shape, which replaces
the started one from then on; the ``BootstrapView`` always stays the record of the start).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, TypeVar, cast

import msgspec

from apomesh.core.definition import AgentConfig
from apomesh.core.envelope import Envelope
from apomesh.core.errors import DuplicateIndex, IndexGap, InvalidLog
from apomesh.core.events import (
    TERMINAL_PHASES,
    TURN_SOURCE,
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    AsyncJobFinished,
    AsyncJobStarted,
    CoordinatorCheckpoint,
    HitlAnswered,
    HitlPaused,
    ModelRetrying,
    OperatorAction,
    PluginPin,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    SessionStarted,
    SessionSuspended,
    ToolCallIntent,
    ToolCallRecorded,
)


class BootstrapView(msgspec.Struct, frozen=True):
    """What a session was started with: enough to rebuild it with no catalog read."""

    session_id: str
    goal: str
    root: str
    shape: SessionShape


class AgentView(msgspec.Struct):
    """One agent as the log describes it."""

    ref: str
    parent: str | None
    config: AgentConfig | None
    phase: str = "born"
    task: str | None = None
    task_index: int | None = None
    worker: str | None = None
    epoch: int = 0
    output: str | None = None
    plan: list[str] | None = None
    reason: str | None = None
    snapshot_id: int | None = None
    snapshot_source: str | None = None
    step: int = 0
    resumes: int = 0
    resuming: bool = False
    """Between ``AgentResuming`` and the new dispatch's first report (its ``running``) or
    ``AgentResumed``, whichever comes first."""
    born_index: int = 0
    batch: str | None = None
    purpose: str | None = None
    migrated_config: AgentConfig | None = None
    """The config a later lifecycle event moved the agent to (an agent-version migration)."""
    ask: str | None = None
    """The coordinator-loop position its latest dispatch answers (the root's asks)."""
    prompt_digest: str | None = None
    pauses: int = 0
    """How many HITL pauses it opened (a paused agent keeps its ref across an auto-resume)."""
    turn_step: int = 0
    """The step of the agent's latest recorded model turn (snapshot source ``turn``)."""
    answered_step: int = 0
    """``turn_step`` when the agent last answered (``planned`` or ``completed``): a recorded plan
    or final answer at or before it was taken as an answer, so it is never replayed."""
    prompt_tokens: int = 0
    """Prompt tokens of every model call its snapshots recorded."""
    completion_tokens: int = 0
    """Completion tokens of those calls."""
    model_calls: int = 0
    """How many model calls its snapshots recorded."""
    retrying: ModelRetrying | None = None
    """The failed model call it waits to try again, until its next snapshot or phase."""
    retrying_ts: float = 0.0
    """The log's timestamp of ``retrying``."""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def current_config(self) -> AgentConfig | None:
        """The config the agent runs with now: its migrated config, else its birth config."""
        return self.migrated_config if self.migrated_config is not None else self.config


class RootAnswer(msgspec.Struct, frozen=True):
    """The root's answer to one ``ask_root``, by its place in the coordinator loop (``ask``)."""

    ask: str
    purpose: str | None
    prompt_digest: str | None
    plan: list[str] | None
    final: str | None


class JournalEntry(msgspec.Struct):
    """A side-effecting call as the log records it; ``outcome`` is None while unmatched."""

    agent: str
    key: str
    tool: str
    args: dict[str, Any]
    idempotent: bool
    intent_index: int
    outcome: str | None = None
    result: str | None = None
    job: bool = False
    """An async job with a side effect (its ``key`` is the job id), not a tool call."""


class SessionState(msgspec.Struct):
    """The folded state of one session. Mutated in place by ``apply``; read it, don't write it."""

    session_id: str
    last_index: int = -1
    last_ts: float = 0.0
    started_ts: float = 0.0
    bootstrap: BootstrapView | None = None
    agents: dict[str, AgentView] = msgspec.field(default_factory=dict)
    children: dict[str, list[str]] = msgspec.field(default_factory=dict)
    checkpoint: CoordinatorCheckpoint | None = None
    checkpoint_index: int | None = None
    checkpoints: list[tuple[int, CoordinatorCheckpoint]] = msgspec.field(default_factory=list)
    """Every coordinator checkpoint with its index, in log order (a replayed loop re-saving one
    walks back to it instead of logging it again)."""
    answers: dict[str, RootAnswer] = msgspec.field(default_factory=dict)
    """The root's answers by coordinator-loop position (``AgentLifecycle.ask``)."""
    jobs_in_flight: dict[tuple[str, str], AsyncJobStarted] = msgspec.field(default_factory=dict)
    """Started jobs without a finish, by (agent, job id)."""
    jobs_done: dict[tuple[str, str], AsyncJobFinished] = msgspec.field(default_factory=dict)
    hitl_pending: dict[str, HitlPaused] = msgspec.field(default_factory=dict)
    hitl_answers: dict[str, str] = msgspec.field(default_factory=dict)
    journal: dict[tuple[str, str], JournalEntry] = msgspec.field(default_factory=dict)
    side_effects: int = 0
    terminal: bool = False
    ended: SessionEnded | None = None
    operator_actions: list[OperatorAction] = msgspec.field(default_factory=list)
    acknowledged_unknown: set[tuple[str, str]] = msgspec.field(default_factory=set)
    """(agent, key) of every unknown outcome an operator's resume was shown and resumed past."""
    suspended_index: int | None = None
    """The index of the last ``SessionSuspended`` (a drained daemon's clean stop), if any."""
    pin_overrides: dict[str, str] = msgspec.field(default_factory=dict)
    migrated_shape: SessionShape | None = None
    """The pinned shape of the agent version an operator migrated the session to, if any."""
    recoveries: int = 0
    resumes: int = 0

    @property
    def goal(self) -> str:
        return self.bootstrap.goal if self.bootstrap else ""

    @property
    def root(self) -> str | None:
        return self.bootstrap.root if self.bootstrap else None

    @property
    def output(self) -> str | None:
        """The root's terminal output (or the terminal event's)."""
        if self.ended is not None and self.ended.output is not None:
            return self.ended.output
        root = self.agents.get(self.root) if self.root else None
        return root.output if root and root.phase == "completed" else None

    @property
    def effective_shape(self) -> SessionShape | None:
        """The shape the session composes agents from now: the last migrated agent version's
        shape, else the one ``SessionStarted`` pinned."""
        if self.migrated_shape is not None:
            return self.migrated_shape
        return self.bootstrap.shape if self.bootstrap is not None else None

    @property
    def plugin_pins(self) -> list[PluginPin]:
        """The plugins this session runs on now: the pins of the effective shape, each moved to
        the version an operator migrated it to (``OperatorAction(action="migrate_pin")``)."""
        shape = self.effective_shape
        if shape is None:
            return []
        return [
            PluginPin(pin.name, self.pin_overrides.get(pin.name, pin.version))
            for pin in shape.plugins
        ]

    @property
    def has_side_effects(self) -> bool:
        return self.side_effects > 0

    @property
    def status(self) -> str:
        """``completed``/``failed``/``cancelled`` once terminal, ``paused`` on an open pause."""
        if self.ended is not None:
            return self.ended.status
        if self.hitl_pending:
            return "paused"
        return "running"

    @property
    def unknown_outcomes(self) -> list[JournalEntry]:
        """Side effects with an intent and no recorded result, or recorded as ``unknown``."""
        return [e for e in self.journal.values() if e.outcome in (None, "unknown")]

    @property
    def cleanly_suspended(self) -> bool:
        """The log ends with a drained daemon's ``SessionSuspended`` and no side effect is in
        flight (no intent without its result)."""
        return self.suspended_index == self.last_index and all(
            e.outcome is not None for e in self.journal.values()
        )

    def children_of(self, ref: str) -> list[str]:
        return self.children.get(ref, [])


def new_state(session_id: str) -> SessionState:
    return SessionState(session_id=session_id)


def fold(envelopes: Iterable[Envelope], session_id: str | None = None) -> SessionState:
    """Fold a whole log (in index order, starting at 0) into a fresh state."""
    state: SessionState | None = None if session_id is None else new_state(session_id)
    for env in envelopes:
        if state is None:
            state = new_state(env.session_id)
        apply(state, env)
    if state is None:
        raise InvalidLog("an empty log has no session", session_id=session_id, index=None)
    return state


def check(state: SessionState, envelopes: Iterable[Envelope]) -> None:
    """Raise the error folding ``envelopes`` into ``state`` would raise; ``state`` is untouched."""
    trial = trial_copy(state)
    for env in envelopes:
        apply(trial, env)


def trial_copy(state: SessionState) -> SessionState:
    """A copy of ``state`` that ``apply`` can mutate without touching the original. Its maps are
    overlays (``_TrialMap``) that copy an entry (an agent, a journal entry, a child list) the first
    time the trial reads it, so checking a step costs what the step touches, not the session's
    size; the short lists and sets are copied whole. Events, configs and shapes are immutable and
    shared."""
    trial: SessionState = _copy_state(state)
    trial.agents = _overlay(state.agents, _copy_agent)
    trial.children = _overlay(state.children, list)
    trial.checkpoints = list(state.checkpoints)
    trial.answers = _overlay(state.answers)
    trial.jobs_in_flight = _overlay(state.jobs_in_flight)
    trial.jobs_done = _overlay(state.jobs_done)
    trial.hitl_pending = _overlay(state.hitl_pending)
    trial.hitl_answers = _overlay(state.hitl_answers)
    trial.journal = _overlay(state.journal, _copy_entry)
    trial.operator_actions = list(state.operator_actions)
    trial.acknowledged_unknown = set(state.acknowledged_unknown)
    trial.pin_overrides = dict(state.pin_overrides)
    return trial


# Shallow copies (a Struct copies itself in C; ``dataclasses.replace``-style copies through
# ``__init__`` cost some twenty times more, on every fold check).
_copy_state: Callable[[SessionState], SessionState] = copy.copy
_copy_agent: Callable[[AgentView], AgentView] = copy.copy
_copy_entry: Callable[[JournalEntry], JournalEntry] = copy.copy


K = TypeVar("K")
V = TypeVar("V")


def _same(value: V) -> V:
    return value


def _overlay(base: dict[K, V], copy: Callable[[V], V] = _same) -> dict[K, V]:
    # Typed as the dict it stands in for: ``apply`` uses only the mapping methods.
    return cast(dict[K, V], _TrialMap(base, copy))


class _TrialMap(MutableMapping[K, V]):
    """A map over ``base`` for a trial fold: an entry read is copied here first (``copy``; the
    identity for immutable values), writes and deletes stay here; ``base`` is never changed."""

    __slots__ = ("_base", "_copy", "_gone", "_mine")

    def __init__(self, base: dict[K, V], copy: Callable[[V], V]) -> None:
        self._base = base
        self._copy = copy
        self._mine: dict[K, V] = {}
        self._gone: set[K] = set()

    def __getitem__(self, key: K) -> V:
        try:
            return self._mine[key]
        except KeyError:
            pass
        if key in self._gone:
            raise KeyError(key)
        value = self._copy(self._base[key])
        self._mine[key] = value
        return value

    def get(self, key: K, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: K, value: V) -> None:
        self._mine[key] = value
        self._gone.discard(key)

    def __delitem__(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        self._mine.pop(key, None)
        self._gone.add(key)

    def __contains__(self, key: object) -> bool:
        if key in self._mine:
            return True
        return key not in self._gone and key in self._base

    def __iter__(self) -> Iterator[K]:
        yield from self._mine
        for key in self._base:
            if key not in self._mine and key not in self._gone:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


def bootstrap_view(state: SessionState) -> BootstrapView | None:
    return state.bootstrap


def apply(state: SessionState, env: Envelope) -> SessionState:
    """Fold one envelope into ``state`` (in place) and return it."""
    expected = state.last_index + 1
    if env.index != expected:
        error = DuplicateIndex if env.index < expected else IndexGap
        raise error(
            f"expected index {expected}, got {env.index}",
            session_id=state.session_id,
            index=env.index,
        )
    if env.session_id != state.session_id:
        raise InvalidLog(
            f"envelope belongs to session {env.session_id!r}",
            session_id=state.session_id,
            index=env.index,
        )
    if state.terminal:
        raise InvalidLog(
            "an event after the terminal event", session_id=state.session_id, index=env.index
        )
    handler = _HANDLERS[type(env.event)]
    handler(state, env)
    state.last_index = env.index
    state.last_ts = env.ts
    return state


def _invalid(state: SessionState, env: Envelope, message: str) -> InvalidLog:
    return InvalidLog(message, session_id=state.session_id, index=env.index)


def _agent(state: SessionState, env: Envelope, ref: str) -> AgentView:
    agent = state.agents.get(ref)
    if agent is None:
        raise _invalid(state, env, f"event names unknown agent {ref!r}")
    return agent


def _on_started(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, SessionStarted)
    if state.bootstrap is not None:
        raise _invalid(state, env, "a second SessionStarted")
    state.bootstrap = BootstrapView(state.session_id, ev.goal, ev.root, ev.shape)
    state.started_ts = env.ts


def _pinned_config(
    state: SessionState, parent: str | None, config: AgentConfig | None
) -> AgentConfig | None:
    """``config``, or the equal one the session's shape pins for that agent's role: a session's
    agents then share its shape's (frozen) configs instead of holding copies of them."""
    if config is None or state.bootstrap is None:
        return config
    shape = state.bootstrap.shape
    pinned = shape.root if parent is None else shape.roles.get(config.role)
    return pinned if pinned is not None and pinned == config else config


def _on_lifecycle(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AgentLifecycle)
    agent = state.agents.get(ev.agent)
    if ev.phase == "born":
        if agent is not None:
            raise _invalid(state, env, f"agent {ev.agent!r} is born twice")
        if ev.parent is not None and ev.parent not in state.agents:
            raise _invalid(state, env, f"agent {ev.agent!r} has unknown parent {ev.parent!r}")
        if ev.parent is None and state.root is not None and ev.agent != state.root:
            raise _invalid(state, env, f"agent {ev.agent!r} has no parent and is not the root")
        state.agents[ev.agent] = AgentView(
            ref=ev.agent,
            parent=ev.parent,
            config=_pinned_config(state, ev.parent, ev.config),
            task=ev.task,
            task_index=ev.task_index,
            born_index=env.index,
            batch=ev.batch,
        )
        if ev.parent is not None:
            state.children.setdefault(ev.parent, []).append(ev.agent)
        return
    if agent is None:
        raise _invalid(state, env, f"event names unknown agent {ev.agent!r}")
    agent.phase = ev.phase
    agent.retrying = None
    if ev.phase == "running":
        agent.resuming = False  # the resumed dispatch reported: it runs again
    if ev.worker is not None:
        agent.worker = ev.worker
    if ev.epoch is not None:
        agent.epoch = ev.epoch
    if ev.output is not None:
        agent.output = ev.output
    if ev.plan is not None:
        agent.plan = list(ev.plan)
    if ev.reason is not None:
        agent.reason = ev.reason
    if ev.purpose is not None:
        agent.purpose = ev.purpose
    if ev.config is not None:
        agent.migrated_config = ev.config
    if ev.ask is not None:
        agent.ask = ev.ask
        agent.prompt_digest = ev.prompt_digest
    if ev.phase in ("planned", "completed") and agent.ask is not None:
        # The first answer at a position is the one a replay gets back.
        state.answers.setdefault(
            agent.ask,
            RootAnswer(
                agent.ask,
                agent.purpose,
                agent.prompt_digest,
                list(ev.plan or []) if ev.phase == "planned" else None,
                (ev.output or "") if ev.phase == "completed" else None,
            ),
        )
    if ev.phase in ("planned", "completed"):
        agent.answered_step = agent.turn_step


def _on_checkpoint(state: SessionState, env: Envelope) -> None:
    assert isinstance(env.event, CoordinatorCheckpoint)
    state.checkpoint = env.event
    state.checkpoint_index = env.index
    state.checkpoints.append((env.index, env.event))


def _on_snapshot(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AgentSnapshotted)
    agent = _agent(state, env, ev.agent)
    agent.snapshot_id = ev.snapshot_id
    agent.snapshot_source = ev.source
    agent.step = ev.step
    agent.retrying = None
    agent.model_calls += ev.model_calls
    agent.prompt_tokens += ev.prompt_tokens
    agent.completion_tokens += ev.completion_tokens
    if ev.source == TURN_SOURCE:
        agent.turn_step = ev.step


def _on_model_retrying(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, ModelRetrying)
    agent = _agent(state, env, ev.agent)
    agent.retrying = ev
    agent.retrying_ts = env.ts


def _on_intent(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, ToolCallIntent)
    _agent(state, env, ev.agent)
    key = (ev.agent, ev.key)
    entry = state.journal.get(key)
    if entry is not None and entry.outcome not in (None, "unknown"):
        raise _invalid(state, env, f"intent for {ev.tool} {ev.key[:12]} after its result")
    if entry is None:
        state.side_effects += 1
    state.journal[key] = JournalEntry(ev.agent, ev.key, ev.tool, ev.args, ev.idempotent, env.index)


def _on_recorded(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, ToolCallRecorded)
    entry = state.journal.get((ev.agent, ev.key))
    if entry is None:
        raise _invalid(state, env, f"result for {ev.tool} {ev.key[:12]} with no intent")
    entry.outcome = ev.outcome
    entry.result = ev.result


def _on_job_started(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AsyncJobStarted)
    _agent(state, env, ev.agent)
    key = (ev.agent, ev.job_id)
    if key in state.jobs_in_flight:
        raise _invalid(state, env, f"job {ev.job_id!r} of agent {ev.agent!r} started twice")
    state.jobs_in_flight[key] = ev
    if ev.side_effect:
        if key not in state.journal:
            state.side_effects += 1
        state.journal[key] = JournalEntry(
            ev.agent, ev.job_id, ev.tool, ev.args, ev.idempotent, env.index, job=True
        )


def _on_job_finished(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AsyncJobFinished)
    key = (ev.agent, ev.job_id)
    if state.jobs_in_flight.pop(key, None) is None:
        raise _invalid(
            state, env, f"job {ev.job_id!r} of agent {ev.agent!r} finished but never started"
        )
    state.jobs_done[key] = ev
    entry = state.journal.get(key)
    if entry is not None and entry.job:
        entry.outcome = "unknown" if ev.unknown else ("ok" if ev.ok else "error")
        entry.result = ev.result


def _on_paused(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, HitlPaused)
    agent = _agent(state, env, ev.agent)
    if ev.pause_id in state.hitl_answers or ev.pause_id in state.hitl_pending:
        raise _invalid(state, env, f"pause {ev.pause_id!r} paused twice")
    agent.pauses += 1
    state.hitl_pending[ev.pause_id] = ev


def _on_answered(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, HitlAnswered)
    if state.hitl_pending.pop(ev.pause_id, None) is None:
        raise _invalid(state, env, f"answer to pause {ev.pause_id!r} that is not open")
    state.hitl_answers[ev.pause_id] = ev.answer


def _on_resuming(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AgentResuming)
    agent = _agent(state, env, ev.agent)
    agent.resuming = True
    agent.resumes += 1
    agent.epoch = ev.epoch
    state.resumes += 1


def _on_resumed(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, AgentResumed)
    _agent(state, env, ev.agent).resuming = False


def _on_recovered(state: SessionState, env: Envelope) -> None:
    assert isinstance(env.event, SessionRecovered)
    state.recoveries += 1


def _on_suspended(state: SessionState, env: Envelope) -> None:
    assert isinstance(env.event, SessionSuspended)
    state.suspended_index = env.index


def _on_operator(state: SessionState, env: Envelope) -> None:
    ev = env.event
    assert isinstance(ev, OperatorAction)
    if ev.action == "migrate_pin":
        pins = ev.detail.get("pins")
        if not isinstance(pins, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in pins.items()
        ):
            raise _invalid(state, env, "a pin migration needs `pins`: a map of name to version")
        if "shape" in ev.detail:
            if state.bootstrap is None:
                raise _invalid(state, env, "an agent migration before SessionStarted")
            try:
                shape = msgspec.convert(ev.detail["shape"], SessionShape)
            except msgspec.ValidationError as exc:
                message = f"an agent migration with an invalid shape: {exc}"
                raise _invalid(state, env, message) from None
            # The new version was sealed with its own plugin pins; earlier moves do not carry over.
            state.migrated_shape = shape
            state.pin_overrides.clear()
        state.pin_overrides.update(pins)
    if ev.action == "resume":
        state.acknowledged_unknown.update(_acknowledged(state, env, ev))
    state.operator_actions.append(ev)


def _acknowledged(state: SessionState, env: Envelope, ev: OperatorAction) -> set[tuple[str, str]]:
    """The unknown outcomes a resume acknowledges: those its ``acknowledged`` detail names
    (``[agent, key]`` pairs: what the operator was shown), or, on a log written before resumes
    named them, every unknown outcome the log held at that point."""
    named = ev.detail.get("acknowledged")
    if named is None:
        return {(e.agent, e.key) for e in state.unknown_outcomes}
    if not isinstance(named, list) or not all(
        isinstance(pair, list | tuple)
        and len(pair) == 2
        and all(isinstance(part, str) for part in pair)
        for pair in named
    ):
        raise _invalid(state, env, "a resume's `acknowledged` must be [agent, key] pairs")
    return {(agent, key) for agent, key in named}


def _on_ended(state: SessionState, env: Envelope) -> None:
    assert isinstance(env.event, SessionEnded)
    state.ended = env.event
    state.terminal = True


_HANDLERS: dict[type, Any] = {
    SessionStarted: _on_started,
    AgentLifecycle: _on_lifecycle,
    CoordinatorCheckpoint: _on_checkpoint,
    AgentSnapshotted: _on_snapshot,
    ModelRetrying: _on_model_retrying,
    ToolCallIntent: _on_intent,
    ToolCallRecorded: _on_recorded,
    AsyncJobStarted: _on_job_started,
    AsyncJobFinished: _on_job_finished,
    HitlPaused: _on_paused,
    HitlAnswered: _on_answered,
    AgentResuming: _on_resuming,
    AgentResumed: _on_resumed,
    SessionRecovered: _on_recovered,
    SessionSuspended: _on_suspended,
    OperatorAction: _on_operator,
    SessionEnded: _on_ended,
}
