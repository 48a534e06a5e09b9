"""An agent's conversation, rebuilt from its snapshot and the session's log: what it was asked,
what the model said, the tools it called with their arguments and results, the questions it put
to a human and their answers, the side effects whose outcome is unknown, and how it ended
(``GET /v1/sessions/{id}/agents/{ref}``).

The messages come from the agent's latest logged snapshot (the working memory a new dispatch
would continue from, so since its last supervisor reset), plus the model turn recorded there and
not yet completed by a node. The log adds what the messages cannot say: which calls were
journaled (their idempotency key, the index and time of their intent and result), each
question's pause and who answered it, calls whose intent is logged with no result, and the
agent's end. A logged call is tied to a message's tool call by tool name and arguments, in order;
a logged call no message holds (cut short, or made before a supervisor reset started the
conversation over) is listed after the messages, with its log index.
``conversation`` is pure; ``load_conversation`` reads the log and the store.
"""

from __future__ import annotations

from typing import Any

import msgspec

from apomesh.adapters.lmdb_store import AsyncStore
from apomesh.core.envelope import Envelope
from apomesh.core.errors import NotFound
from apomesh.core.events import (
    AsyncJobFinished,
    AsyncJobStarted,
    HitlAnswered,
    HitlPaused,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.ports import EventLog
from apomesh.core.state import SessionState, fold
from apomesh.core.views import (
    AgentConversation,
    ConversationEntry,
    agent_summary,
    unknown_outcomes,
)
from apomesh.plugins.api import Message
from apomesh.runtime.protocol import AgentMemory
from apomesh.runtime.snapshots import SnapshotStore

HUMAN_TOOL = "ask_human"
ENDED_PHASES = frozenset({"failed", "cancelled"})


class _LoggedCall(msgspec.Struct):
    """A journaled tool call or async job of the agent, as the log tells it."""

    tool: str
    args: dict[str, Any]
    key: str
    index: int
    at: float
    outcome: str = ""
    result: str = ""
    result_index: int = -1
    result_at: float = 0.0
    used: bool = False


class _LoggedPause(msgspec.Struct):
    """A human question of the agent and, once given, its answer."""

    pause_id: str
    question: str
    index: int
    at: float
    answer: str | None = None
    by: str = ""
    answer_index: int = -1
    answer_at: float = 0.0
    used: bool = False


def _logged(envelopes: list[Envelope], ref: str) -> tuple[list[_LoggedCall], list[_LoggedPause]]:
    calls: dict[str, _LoggedCall] = {}
    pauses: dict[str, _LoggedPause] = {}
    for env in envelopes:
        ev = env.event
        if isinstance(ev, ToolCallIntent) and ev.agent == ref:
            calls.setdefault(ev.key, _LoggedCall(ev.tool, dict(ev.args), ev.key, env.index, env.ts))
        elif isinstance(ev, AsyncJobStarted) and ev.agent == ref:
            calls.setdefault(
                ev.job_id, _LoggedCall(ev.tool, dict(ev.args), ev.job_id, env.index, env.ts)
            )
        elif isinstance(ev, ToolCallRecorded) and ev.agent == ref and ev.key in calls:
            call = calls[ev.key]
            call.outcome, call.result = ev.outcome, ev.result
            call.result_index, call.result_at = env.index, env.ts
        elif isinstance(ev, AsyncJobFinished) and ev.agent == ref and ev.job_id in calls:
            call = calls[ev.job_id]
            call.outcome = "unknown" if ev.unknown else ("ok" if ev.ok else "error")
            call.result, call.result_index, call.result_at = ev.result, env.index, env.ts
        elif isinstance(ev, HitlPaused) and ev.agent == ref:
            pauses.setdefault(
                ev.pause_id, _LoggedPause(ev.pause_id, ev.question, env.index, env.ts)
            )
        elif isinstance(ev, HitlAnswered) and ev.pause_id in pauses:
            pause = pauses[ev.pause_id]
            pause.answer, pause.by = ev.answer, ev.by
            pause.answer_index, pause.answer_at = env.index, env.ts
    return list(calls.values()), list(pauses.values())


class _Builder:
    """Walks the model's turns in order, tying each tool call to what the log recorded of it."""

    def __init__(
        self, calls: list[_LoggedCall], pauses: list[_LoggedPause], unknown: set[str]
    ) -> None:
        self.calls = calls
        self.pauses = pauses
        self.unknown = unknown
        self.entries: list[ConversationEntry] = []

    def turn(
        self, text: str, calls: list[tuple[str, dict[str, Any], str]], results: list[Message]
    ) -> None:
        """One model turn: its ``text``, its ``calls`` (tool, arguments, call id) and the tool
        messages that answered them (fewer when the turn was cut short)."""
        if text:
            self.entries.append(ConversationEntry(kind="model", text=text))
        for i, (tool, args, call_id) in enumerate(calls):
            logged = self._call(tool, args, call_id)
            if i < len(results):
                self._result(results[i], logged)
            elif isinstance(logged, _LoggedPause):
                if logged.answer is not None:
                    self._answer(logged)
            elif logged is not None:
                self._logged_result(logged)

    def _call(
        self, tool: str, args: dict[str, Any], call_id: str
    ) -> _LoggedCall | _LoggedPause | None:
        if tool == HUMAN_TOOL:
            question = str(args.get("question", ""))
            pause = next((p for p in self.pauses if not p.used and p.question == question), None)
            if pause is None:
                self.entries.append(
                    ConversationEntry(kind="question", text=question, call_id=call_id)
                )
                return None
            pause.used = True
            self._question(pause, call_id)
            return pause
        logged = next(
            (c for c in self.calls if not c.used and c.tool == tool and c.args == args), None
        )
        if logged is not None:
            logged.used = True
        self.entries.append(
            ConversationEntry(
                kind="tool_call",
                tool=tool,
                args=dict(args),
                call_id=call_id,
                key=logged.key if logged else "",
                index=logged.index if logged else -1,
                at=logged.at if logged else 0.0,
            )
        )
        return logged

    def _result(self, message: Message, logged: _LoggedCall | _LoggedPause | None) -> None:
        if isinstance(logged, _LoggedPause):
            self._answer(logged, message.content, message.tool_call_id)
            return
        if message.name == HUMAN_TOOL:
            self.entries.append(
                ConversationEntry(kind="answer", text=message.content, call_id=message.tool_call_id)
            )
            return
        if logged is not None and logged.outcome:
            outcome = logged.outcome
        else:
            outcome = "error" if message.content.startswith("error:") else "ok"
        self.entries.append(
            ConversationEntry(
                kind="tool_result",
                tool=message.name,
                text=message.content,
                call_id=message.tool_call_id,
                key=logged.key if logged else "",
                outcome=outcome,
                index=logged.result_index if logged else -1,
                at=logged.result_at if logged else 0.0,
            )
        )

    def _logged_result(self, call: _LoggedCall) -> None:
        """A journaled call no tool message answers: its logged result, or its unknown outcome."""
        if call.key in self.unknown:
            self.entries.append(
                ConversationEntry(
                    kind="unknown_outcome",
                    tool=call.tool,
                    args=call.args,
                    key=call.key,
                    text="its intent is logged and its result is not: it may or may not "
                    "have taken effect",
                    outcome="unknown",
                )
            )
        elif call.outcome:
            self.entries.append(
                ConversationEntry(
                    kind="tool_result",
                    tool=call.tool,
                    text=call.result,
                    key=call.key,
                    outcome=call.outcome,
                    index=call.result_index,
                    at=call.result_at,
                )
            )

    def _question(self, pause: _LoggedPause, call_id: str = "") -> None:
        self.entries.append(
            ConversationEntry(
                kind="question",
                text=pause.question,
                call_id=call_id,
                pause_id=pause.pause_id,
                index=pause.index,
                at=pause.at,
            )
        )

    def _answer(self, pause: _LoggedPause, text: str | None = None, call_id: str = "") -> None:
        self.entries.append(
            ConversationEntry(
                kind="answer",
                text=pause.answer if pause.answer is not None else (text or ""),
                call_id=call_id,
                pause_id=pause.pause_id,
                by=pause.by,
                index=pause.answer_index,
                at=pause.answer_at,
            )
        )

    def leftovers(self) -> None:
        """What the log holds and no message does: calls cut short (their intent logged, their
        node never reported), questions asked or answered since the last snapshot."""
        for call in self.calls:
            if call.used:
                continue
            self.entries.append(
                ConversationEntry(
                    kind="tool_call",
                    tool=call.tool,
                    args=call.args,
                    key=call.key,
                    index=call.index,
                    at=call.at,
                )
            )
            self._logged_result(call)
        for pause in self.pauses:
            if pause.used:
                continue
            self._question(pause)
            if pause.answer is not None:
                self._answer(pause)


def _groups(messages: list[Message]) -> list[tuple[Message, list[Message]]]:
    """Each message with the tool messages that follow it (an assistant turn's results)."""
    groups: list[tuple[Message, list[Message]]] = []
    for message in messages:
        if message.role == "tool" and groups:
            groups[-1][1].append(message)
        else:
            groups.append((message, []))
    return groups


def conversation(
    state: SessionState,
    envelopes: list[Envelope],
    ref: str,
    memory: AgentMemory | None,
    snapshot_id: int | None,
) -> AgentConversation:
    """Agent ``ref``'s conversation from the folded ``state`` of the session, its log
    ``envelopes`` and the ``memory`` its logged snapshot ``snapshot_id`` holds (None: none yet)."""
    agent = state.agents.get(ref)
    if agent is None:
        raise NotFound(f"agent {ref[:80]!r} in session {state.session_id}")
    calls, pauses = _logged(envelopes, ref)
    unknown = [u for u in unknown_outcomes(state) if u.agent == ref]
    builder = _Builder(calls, pauses, {u.key for u in unknown})
    messages = list(memory.messages) if memory is not None else []
    if not any(m.role == "user" for m in messages) and agent.task:
        builder.entries.append(ConversationEntry(kind="prompt", text=agent.task))
    for message, results in _groups(messages):
        if message.role != "assistant":
            if message.content:
                builder.entries.append(ConversationEntry(kind="prompt", text=message.content))
            continue
        ids = [r.tool_call_id for r in results]
        turn_calls = [
            (spec.tool, dict(spec.args), ids[i] if i < len(ids) else "")
            for i, spec in enumerate(message.tool_calls)
        ]
        builder.turn(message.content, turn_calls, results)
    answered = False
    turn = memory.turn if memory is not None else None
    if turn is not None:
        response = turn.response
        if response.plan is not None:
            builder.entries.append(ConversationEntry(kind="plan", text="\n".join(response.plan)))
            answered = True
        elif response.final is not None:
            builder.entries.append(ConversationEntry(kind="output", text=response.final))
            answered = True
        else:
            turn_calls = [
                (spec.tool, dict(spec.args), f"{turn.step}.{i}")
                for i, spec in enumerate(response.tool_calls)
            ]
            builder.turn(response.text, turn_calls, [])
    builder.leftovers()
    if not answered and agent.phase == "planned" and agent.plan is not None:
        builder.entries.append(ConversationEntry(kind="plan", text="\n".join(agent.plan)))
    elif not answered and agent.phase == "completed" and agent.output is not None:
        builder.entries.append(ConversationEntry(kind="output", text=agent.output))
    if agent.phase in ENDED_PHASES:
        builder.entries.append(
            ConversationEntry(kind="ended", outcome=agent.phase, text=agent.reason or "")
        )
    config = agent.current_config
    return AgentConversation(
        session_id=state.session_id,
        agent=agent_summary(agent),
        instructions=config.instructions if config is not None else "",
        entries=builder.entries,
        unknown_outcomes=unknown,
        snapshot_id=snapshot_id,
    )


async def load_conversation(
    log: EventLog, store: AsyncStore, session_id: str, ref: str
) -> AgentConversation:
    """Read the session's log and agent ``ref``'s logged snapshot, and build its conversation."""
    envelopes = await log.read(session_id, -1)
    if not envelopes:
        raise NotFound(f"session {session_id}")
    state = fold(envelopes, session_id)
    agent = state.agents.get(ref)
    if agent is None:
        raise NotFound(f"agent {ref[:80]!r} in session {session_id}")
    memory = None
    if agent.snapshot_id is not None:
        memory = await SnapshotStore(store).load(f"{session_id}/{ref}", agent.snapshot_id)
    return conversation(state, envelopes, ref, memory, agent.snapshot_id)
