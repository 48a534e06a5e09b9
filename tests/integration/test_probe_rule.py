"""The writer's rule for an unknown outcome (``SessionRuntime._on_journal_begin``) on the
in-memory log: a tool with a probe is asked first, its not-happened answer logs a second intent
under the same key and runs the call, a cannot-tell answer falls back to ``on_unknown``, a probe
answer nobody asked for is refused, and a tool without a probe gets its policy at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from tests.integration.test_session_writer import SID, writer
from tests.strategies import born, session_started

from apomesh.adapters.memory_log import MemoryLog
from apomesh.core.events import ToolCallIntent, ToolCallRecorded
from apomesh.runtime.protocol import JournalBegin, JournalFinish
from apomesh.runtime.sessions import DispatchSlot, SessionRuntime

pytestmark = pytest.mark.anyio
ARGS = {"path": "log.txt", "line": "one"}


async def open_intent(tmp_path: Path) -> tuple[MemoryLog, SessionRuntime, DispatchSlot]:
    """A session whose earlier dispatch logged an intent and died; the agent's new dispatch."""
    log = MemoryLog()
    runtime = writer(log, tmp_path, [])
    intent = ToolCallIntent("root", "k", "fs.append", ARGS)
    await runtime.append(session_started(), born("root"), intent)
    return log, runtime, DispatchSlot("root", 2, "w2", cast(Any, None))


def begin(probe: bool, probed: str = "", on_unknown: str = "fail") -> JournalBegin:
    return JournalBegin(
        "w2", SID, "root", 2, "k", "fs.append", ARGS, False, on_unknown, probe, probed, "busy"
    )


async def events(log: MemoryLog) -> list[Any]:
    return [e.event for e in await log.read(SID)][3:]


async def test_a_probe_is_asked_first_and_its_not_happened_runs_the_call(tmp_path: Path) -> None:
    log, runtime, slot = await open_intent(tmp_path)
    assert (await runtime._on_journal_begin(slot, begin(True))).decision == "probe"
    assert await events(log) == []  # asking writes nothing
    assert (await runtime._on_journal_begin(slot, begin(True, "not_happened"))).decision == "run"
    again = ToolCallIntent("root", "k", "fs.append", ARGS, resolution="not_happened")
    assert await events(log) == [again]
    # The same dispatch asking again after a lost reply: run, nothing more logged.
    assert (await runtime._on_journal_begin(slot, begin(True, "not_happened"))).decision == "run"
    assert await events(log) == [again]


async def test_a_probe_that_cannot_tell_falls_back_to_on_unknown(tmp_path: Path) -> None:
    log, runtime, slot = await open_intent(tmp_path)
    await runtime._on_journal_begin(slot, begin(True))
    reply = await runtime._on_journal_begin(slot, begin(True, "cannot_tell"))
    assert reply.decision == "failed"
    [recorded] = await events(log)
    assert isinstance(recorded, ToolCallRecorded) and recorded.outcome == "unknown"
    assert "its probe cannot tell: busy" in recorded.result


async def test_a_tool_without_a_probe_gets_its_policy_at_once(tmp_path: Path) -> None:
    log, runtime, slot = await open_intent(tmp_path)
    assert (await runtime._on_journal_begin(slot, begin(False))).decision == "failed"
    [recorded] = await events(log)
    assert isinstance(recorded, ToolCallRecorded) and recorded.outcome == "unknown"


async def test_answers_nobody_asked_for_are_refused(tmp_path: Path) -> None:
    log, runtime, slot = await open_intent(tmp_path)
    finish = JournalFinish("w2", SID, "root", 2, "k", "fs.append", "ok", "done", "probe")
    assert (await runtime._on_journal_finish(slot, finish)).status == "error"
    # A not-happened answer without the question is no licence to run: the policy decides.
    assert (await runtime._on_journal_begin(slot, begin(True, "not_happened"))).decision == "failed"
    assert [type(e).__name__ for e in await events(log)] == ["ToolCallRecorded"]
