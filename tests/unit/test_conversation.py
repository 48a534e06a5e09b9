"""An agent's conversation from a folded log and its snapshot's memory (``runtime.conversation``,
pure): tool calls tied to their journal entries by tool and arguments, in order; a question tied to
its pause and answer; calls cut short and unknown outcomes from the log; the agent's end."""

from __future__ import annotations

import pytest
from tests.unit.test_views import ROOT, log_of, started

from apomesh.core.definition import ToolCallSpec
from apomesh.core.errors import NotFound
from apomesh.core.events import (
    AgentLifecycle,
    HitlAnswered,
    HitlPaused,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import fold
from apomesh.plugins.api import Message, ModelResponse
from apomesh.runtime.conversation import conversation
from apomesh.runtime.protocol import AgentMemory, RecordedTurn

A1 = {"path": "a.txt", "line": "one"}
A2 = {"path": "a.txt", "line": "two"}


def talk(events: list, memory: AgentMemory | None) -> list[tuple[str, ...]]:
    envelopes = log_of(*events)
    view = conversation(fold(envelopes), envelopes, "root", memory, 1)
    return [(e.kind, e.tool or e.text, e.key, e.outcome, str(e.index)) for e in view.entries]


def test_messages_are_tied_to_the_log_in_order() -> None:
    events = [
        *started(),
        ToolCallIntent("root", "k1", "fs.append", A1),  # 3
        ToolCallRecorded("root", "k1", "fs.append", "ok", "appended"),  # 4
        ToolCallIntent("root", "k2", "fs.append", A2),  # 5
        ToolCallRecorded("root", "k2", "fs.append", "error", "disk full"),  # 6
        HitlPaused("root", "p1", "Go on?"),  # 7
        HitlAnswered("p1", "yes", by="alice"),  # 8
        AgentLifecycle("root", "completed", output="done"),  # 9
    ]
    memory = AgentMemory(
        messages=[
            Message(role="user", content="write a report"),
            Message(
                role="assistant",
                content="Two lines.",
                tool_calls=[ToolCallSpec("fs.list", {}), ToolCallSpec("fs.append", A1)],
            ),
            Message(role="tool", content="a.txt", tool_call_id="1.0", name="fs.list"),
            Message(role="tool", content="appended", tool_call_id="1.1", name="fs.append"),
            Message(role="assistant", tool_calls=[ToolCallSpec("fs.append", A2)]),
            Message(role="tool", content="error: disk full", tool_call_id="2.0", name="fs.append"),
            Message(
                role="assistant", tool_calls=[ToolCallSpec("ask_human", {"question": "Go on?"})]
            ),
            Message(role="tool", content="yes", tool_call_id="3.0", name="ask_human"),
        ]
    )
    assert talk(events, memory) == [
        ("prompt", "write a report", "", "", "-1"),
        ("model", "Two lines.", "", "", "-1"),
        ("tool_call", "fs.list", "", "", "-1"),
        ("tool_result", "fs.list", "", "ok", "-1"),
        ("tool_call", "fs.append", "k1", "", "3"),
        ("tool_result", "fs.append", "k1", "ok", "4"),
        ("tool_call", "fs.append", "k2", "", "5"),
        ("tool_result", "fs.append", "k2", "error", "6"),
        ("question", "Go on?", "", "", "7"),
        ("answer", "yes", "", "", "8"),
        ("output", "done", "", "", "-1"),
    ]


def test_a_recorded_turn_cut_short_ends_with_its_unknown_outcome() -> None:
    events = [
        *started(),
        ToolCallIntent("root", "k1", "fs.append", A1),  # 3: no result, the worker died
    ]
    turn = RecordedTurn(
        1, ModelResponse(text="Appending.", tool_calls=[ToolCallSpec("fs.append", A1)])
    )
    memory = AgentMemory(messages=[Message(role="user", content="write")], turn=turn)
    assert talk(events, memory) == [
        ("prompt", "write", "", "", "-1"),
        ("model", "Appending.", "", "", "-1"),
        ("tool_call", "fs.append", "k1", "", "3"),
        ("unknown_outcome", "fs.append", "k1", "unknown", "-1"),
    ]


def test_without_a_snapshot_the_log_alone_tells_it() -> None:
    events = [
        *started(),
        ToolCallIntent("root", "k1", "fs.append", A1),
        ToolCallRecorded("root", "k1", "fs.append", "ok", "appended"),
        HitlPaused("root", "p1", "Go on?"),
        AgentLifecycle("root", "failed", reason="budget exhausted"),
    ]
    events[1] = AgentLifecycle(agent="root", phase="born", config=ROOT, task="write")
    assert [e[0] for e in talk(events, None)] == [
        "prompt",
        "tool_call",
        "tool_result",
        "question",
        "ended",
    ]
    assert talk(events, None)[-1][1] == "budget exhausted"


def test_an_unknown_agent_is_not_found() -> None:
    envelopes = log_of(*started())
    with pytest.raises(NotFound):
        conversation(fold(envelopes), envelopes, "root/9", None, None)
