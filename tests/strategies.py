"""Builders and hypothesis strategies for session logs, shared by every test suite.

``valid_sessions()`` generates whole, valid sessions: a ``SessionStarted``, the root's birth, then a
random walk over what a real session does (children born under existing agents, lifecycle phases,
snapshot pointers, journaled intents and their results, async jobs, HITL pauses and answers,
coordinator checkpoints, resumes, recoveries and operator actions), optionally closed by a
``SessionEnded``. Every generated log folds without error. The plain builders (``agent_config``,
``session_started``, ``born``, ``to_envelopes``) make hand-written logs short, and
``state_summary`` turns a folded state into plain data so two folds can be compared for equality.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from hypothesis import strategies as st

from apomesh.core import envelope
from apomesh.core.definition import (
    AgentConfig,
    Budget,
    ModelSpec,
    PinnedSkill,
    ScriptTurn,
    ToolCallSpec,
)
from apomesh.core.envelope import Envelope
from apomesh.core.events import (
    TERMINAL_PHASES,
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    AgentSnapshotted,
    AsyncJobFinished,
    AsyncJobStarted,
    CoordinatorCheckpoint,
    Event,
    HitlAnswered,
    HitlPaused,
    ModelRetrying,
    OperatorAction,
    Phase,
    PluginPin,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    SessionStarted,
    SessionStatus,
    SessionSuspended,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.journal import call_key, pause_key
from apomesh.core.state import SessionState

ROOT = "root"
Outcome = Literal["ok", "error", "unknown"]
BASE_TS = 1_700_000_000.0
NON_BIRTH_PHASES: tuple[Phase, ...] = (
    "dispatched",
    "running",
    "planned",
    "paused",
    "waiting",
    "completed",
    "failed",
    "cancelled",
)
SIDE_EFFECT_TOOLS = ("fs.append", "fs.write")
SESSION_STATUSES: tuple[SessionStatus, ...] = ("completed", "failed", "cancelled")
OUTCOMES: tuple[Outcome, ...] = ("ok", "ok", "error", "unknown")

# --- builders -----------------------------------------------------------------------------------


def agent_config(role: str = "root", name: str = "writer") -> AgentConfig:
    """A small, fully resolved agent config (one pinned skill, an inline two-turn script)."""
    return AgentConfig(
        name=name,
        version="1.0.0",
        role=role,
        instructions="Write what you are asked.",
        model=ModelSpec(
            provider="scripted",
            turns=[
                ScriptTurn(tool_calls=[ToolCallSpec("fs.append", {"path": "out.txt"})]),
                ScriptTurn(final="done: {task}"),
            ],
        ),
        tools=["fs.read", "fs.append"],
        skills=[PinnedSkill("house-style", "Write plainly.", "ab" * 32, "catalog")],
        budget=Budget(max_steps=20),
    )


def session_shape(coordination: str = "solo") -> SessionShape:
    root = agent_config()
    return SessionShape(
        coordination=coordination,
        coordination_params={"max_parallel": 4} if coordination == "fanout" else {},
        root=root,
        roles={"worker": agent_config("worker", "writer.worker")},
        skills=list(root.skills),
        plugins=[PluginPin("apomesh", "0.1.0")],
    )


def session_started(
    goal: str = "write a short poem", root: str = ROOT, coordination: str = "solo"
) -> SessionStarted:
    return SessionStarted(goal=goal, root=root, shape=session_shape(coordination))


def born(
    agent: str,
    parent: str | None = None,
    *,
    task: str | None = None,
    task_index: int | None = None,
) -> AgentLifecycle:
    """The birth of ``agent`` (the root when ``parent`` is None) with a full config."""
    config = agent_config() if parent is None else agent_config("worker", "writer.worker")
    return AgentLifecycle(
        agent=agent, phase="born", parent=parent, config=config, task=task, task_index=task_index
    )


def to_envelopes(
    events: Iterable[Event],
    session_id: str = "s-test",
    *,
    start_index: int = 0,
    start_ts: float = BASE_TS,
) -> list[Envelope]:
    """Wrap events in envelopes with dense indexes, rising timestamps and stable event ids."""
    return [
        envelope.make(session_id, i, start_ts + i * 0.25, f"{session_id}:{i}", event)
        for i, event in enumerate(events, start=start_index)
    ]


def state_summary(state: SessionState) -> dict[str, Any]:
    """Every field of a folded state and its derived views, as plain builtins for equality checks.

    Fields are read generically, so a field added to ``SessionState`` is compared without a change
    here. Tuple keys (the journal's ``(agent, key)``) become their JSON text.
    """
    summary: dict[str, Any] = {}
    for f in msgspec.structs.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, dict):
            value = {
                k if isinstance(k, str) else msgspec.json.encode(k).decode(): v
                for k, v in value.items()
            }
        if isinstance(value, (set, frozenset)):
            value = sorted(value, key=repr)  # a set's order is not part of the state
        summary[f.name] = msgspec.to_builtins(value)
    summary["status"] = state.status
    summary["output"] = state.output
    summary["unknown_outcomes"] = msgspec.to_builtins(state.unknown_outcomes)
    return summary


# --- strategies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratedSession:
    """A generated valid log: its session id and its events in order."""

    session_id: str
    events: tuple[Event, ...]

    @property
    def envelopes(self) -> list[Envelope]:
        return to_envelopes(self.events, self.session_id)

    @property
    def ended(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], SessionEnded)


_texts = st.text(alphabet="abcdefghij klmnop", max_size=12)
_arg_values = st.one_of(
    st.integers(-3, 3), st.sampled_from([0.5, 1.0, -0.0, 2.25]), _texts, st.booleans()
)
tool_args = st.dictionaries(st.sampled_from(["path", "line", "n", "mode"]), _arg_values, max_size=3)


@dataclass
class _Walk:
    """What the generator has emitted so far, so each next step is valid."""

    agents: list[str]
    children: dict[str, int]
    open_intents: list[tuple[str, str, str]]
    jobs: list[tuple[str, str]]
    pauses: list[str]
    pause_count: int = 0
    job_count: int = 0
    snapshot_id: int = 0
    step: int = 0


@st.composite
def valid_sessions(
    draw: st.DrawFn,
    *,
    max_steps: int = 60,
    end: bool | None = None,
    session_id: str | None = None,
) -> GeneratedSession:
    """A valid session log; ``end`` True/False forces or forbids a closing ``SessionEnded``."""
    sid = session_id or draw(st.sampled_from(["s-1", "s-alpha", "s-0f3a"]))
    coordination = draw(st.sampled_from(["solo", "fanout"]))
    events: list[Event] = [session_started(coordination=coordination), born(ROOT)]
    walk = _Walk(agents=[ROOT], children={}, open_intents=[], jobs=[], pauses=[])
    steps = draw(st.integers(0, max_steps))
    for _ in range(steps):
        walk.step += 1
        moves = ["birth", "phase", "snapshot", "intent", "checkpoint", "job", "pause"]
        moves += ["resume", "recovered", "operator"]
        if walk.open_intents:
            moves += ["result", "result"]
        if walk.jobs:
            moves.append("finish")
        if walk.pauses:
            moves.append("answer")
        move = draw(st.sampled_from(moves))
        events.extend(_step(draw, walk, move))
    if end is None:
        end = draw(st.booleans())
    if end:
        status = draw(st.sampled_from(SESSION_STATUSES))
        output = draw(st.none() | _texts) if status == "completed" else None
        events.append(SessionEnded(status=status, output=output))
    return GeneratedSession(sid, tuple(events))


def _step(draw: st.DrawFn, walk: _Walk, move: str) -> list[Event]:
    agent = draw(st.sampled_from(walk.agents))
    if move == "birth":
        n = walk.children.get(agent, 0)
        walk.children[agent] = n + 1
        ref = f"{agent}/{n}"
        walk.agents.append(ref)
        return [born(ref, agent, task=f"sub-task {n}", task_index=n)]
    if move == "phase":
        phase = draw(st.sampled_from(NON_BIRTH_PHASES))
        return [
            AgentLifecycle(
                agent=agent,
                phase=phase,
                worker=f"w-{walk.step % 3}" if phase == "dispatched" else None,
                epoch=walk.step if phase == "dispatched" else None,
                output=draw(_texts) if phase == "completed" else None,
                plan=draw(st.lists(_texts, max_size=3)) if phase == "planned" else None,
                reason="budget" if phase in TERMINAL_PHASES - {"completed"} else None,
            )
        ]
    if move == "snapshot":
        walk.snapshot_id += 1
        source = draw(st.sampled_from(["node", "reset", "explicit", "affinity"]))
        return [AgentSnapshotted(agent, walk.snapshot_id, source, walk.step, size=128)]
    if move == "intent":
        reopen = [i for i in walk.open_intents if i[0] == agent]
        again = draw(st.booleans())
        if reopen and again:
            # A re-run after a crash logs the same intent again: still one side effect.
            _, key, tool = draw(st.sampled_from(reopen))
            args: dict[str, Any] = {"again": True}
        else:
            tool = draw(st.sampled_from(SIDE_EFFECT_TOOLS))
            args = draw(tool_args)
            args["step"] = walk.step  # a fresh call, never one already closed
            key = call_key(tool, args)
            walk.open_intents.append((agent, key, tool))
        return [ToolCallIntent(agent, key, tool, args, idempotent=tool == "fs.write")]
    if move == "result":
        agent, key, tool = draw(st.sampled_from(walk.open_intents))
        outcome = draw(st.sampled_from(OUTCOMES))
        if outcome != "unknown":
            walk.open_intents.remove((agent, key, tool))
        return [ToolCallRecorded(agent, key, tool, outcome, result=f"{outcome} {walk.step}")]
    if move == "checkpoint":
        state = msgspec.msgpack.encode({"step": walk.step, "next": draw(st.integers(0, 9))})
        return [CoordinatorCheckpoint(position=f"p{walk.step}", state=state)]
    if move == "job":
        walk.job_count += 1
        job_id = f"job-{walk.job_count}"
        walk.jobs.append((agent, job_id))
        return [AsyncJobStarted(agent, job_id, "shell.run", {"cmd": "make"})]
    if move == "finish":
        owner, job_id = draw(st.sampled_from(walk.jobs))
        walk.jobs.remove((owner, job_id))
        return [AsyncJobFinished(owner, job_id, ok=draw(st.booleans()), result="out")]
    if move == "pause":
        walk.pause_count += 1
        question = f"question {walk.pause_count}?"
        pause_id = pause_key(agent, walk.step, question)
        walk.pauses.append(pause_id)
        return [HitlPaused(agent, pause_id, question)]
    if move == "answer":
        pause_id = draw(st.sampled_from(walk.pauses))
        walk.pauses.remove(pause_id)
        return [HitlAnswered(pause_id, answer=draw(_texts))]
    if move == "resume":
        events: list[Event] = [
            AgentResuming(agent, "worker lost", worker=f"w-{walk.step}", epoch=walk.step + 1)
        ]
        if draw(st.booleans()):
            events.append(AgentResumed(agent, epoch=walk.step + 1))
        return events
    if move == "recovered":
        return [SessionRecovered(path=draw(st.sampled_from(["auto", "operator"])))]
    if move == "operator":
        return [OperatorAction(action="resume", detail={"step": walk.step})]
    raise AssertionError(f"unknown move {move}")


def event_kinds(events: Sequence[Event]) -> set[str]:
    return {type(event).__name__ for event in events}


def example_events() -> list[Event]:
    """One realistic instance of every event type, every optional field filled in."""
    key = call_key("fs.append", {"path": "log.txt", "line": "step 1"})
    return [
        session_started(coordination="fanout"),
        AgentLifecycle(
            agent="root/0",
            phase="completed",
            parent="root",
            config=agent_config("worker", "writer.worker"),
            task="first sub-task",
            task_index=0,
            worker="w-1",
            epoch=3,
            output="done: first sub-task",
            plan=["a", "b"],
            reason="finished",
            batch="b-1",
        ),
        CoordinatorCheckpoint(position="fanout:2", state=b"\x00\x01\xfe\xff"),
        AgentSnapshotted(
            agent="root/0",
            snapshot_id=7,
            source="node",
            step=4,
            size=2048,
            model_calls=1,
            prompt_tokens=120,
            completion_tokens=30,
        ),
        ModelRetrying(
            agent="root/0", attempt=2, delay=1.5, reason="the endpoint answered 429", status=429
        ),
        ToolCallIntent(
            agent="root/0",
            key=key,
            tool="fs.append",
            args={"path": "log.txt", "line": "step 1", "nested": {"n": [1, 2.5, None]}},
            idempotent=False,
        ),
        ToolCallRecorded(agent="root/0", key=key, tool="fs.append", outcome="ok", result="1 line"),
        AsyncJobStarted(agent="root", job_id="job-1", tool="shell.run", args={"cmd": "make"}),
        AsyncJobFinished(agent="root", job_id="job-1", ok=False, result="exit 2"),
        HitlPaused(agent="root", pause_id=pause_key("root", 3, "Proceed?"), question="Proceed?"),
        HitlAnswered(pause_id=pause_key("root", 3, "Proceed?"), answer="yes", by="alice"),
        AgentResuming(agent="root/0", reason="worker lost", worker="w-2", snapshot_id=7, epoch=4),
        AgentResumed(agent="root/0", epoch=4),
        SessionRecovered(path="operator", checkpoint_index=2, incarnation="daemon-2"),
        SessionSuspended(reason="daemon shutdown", incarnation="daemon-2"),
        OperatorAction(action="migrate_pin", by="bob", detail={"pins": {"x": "2.0"}}),
        SessionEnded(status="failed", output=None, reason="budget exhausted"),
    ]
