"""Replays the recorded session logs in ``tests/golden/`` and checks what each one says.

The files are made by ``python tests/golden/make_golden.py`` (its docstring describes the format:
a msgpack array of envelope bytes per session). They are committed on purpose: they are logs an
earlier build wrote, so a change to the event schema that cannot read them fails here. Keep them;
regenerate only when the recorded sessions themselves change, and add an upcaster instead when the
schema moves on. The broken logs must raise their typed error, never yield a partial state.
"""

from __future__ import annotations

import pytest
from tests.golden.make_golden import GAP_AT, GOLDEN_DIR, TORN_AT, build_logs, read_log

from apomesh.core import envelope
from apomesh.core.errors import IndexGap, MalformedEnvelope
from apomesh.core.events import AgentResumed, AgentResuming, SessionEnded
from apomesh.core.state import SessionState, fold

GOOD = ["solo_completed", "fanout_resumed", "hitl_answered"]


def replay(stem: str) -> SessionState:
    records = read_log(GOLDEN_DIR / f"{stem}.msgpack")
    return fold(envelope.decode(r, index=i) for i, r in enumerate(records))


def test_every_golden_file_is_known() -> None:
    on_disk = {p.stem for p in GOLDEN_DIR.glob("*.msgpack")}
    assert on_disk == set(build_logs()) == {*GOOD, "broken_index_gap", "broken_torn_record"}


@pytest.mark.parametrize("stem", GOOD)
def test_committed_logs_decode_to_what_the_generator_builds_today(stem: str) -> None:
    # Compares decoded events, not bytes: a field added with a default keeps old files equal.
    committed = [envelope.decode(r) for r in read_log(GOLDEN_DIR / f"{stem}.msgpack")]
    assert committed == [envelope.decode(r) for r in build_logs()[stem]]


def test_solo_completed() -> None:
    state = replay("solo_completed")
    assert (state.session_id, state.last_index, state.terminal) == ("golden-solo", 8, True)
    assert (state.status, state.output) == ("completed", "wrote poem.txt")
    assert state.goal == "write a two-line poem about the sea"
    assert state.bootstrap is not None and state.bootstrap.shape.coordination == "solo"
    assert state.bootstrap.shape.agent == "writer@1.0.0"
    assert [s.name for s in state.bootstrap.shape.skills] == ["house-style"]
    assert {ref: a.phase for ref, a in state.agents.items()} == {"root": "completed"}
    assert state.side_effects == 1 and state.unknown_outcomes == []
    (entry,) = state.journal.values()
    assert (entry.tool, entry.args, entry.outcome) == (
        "fs.append",
        {"path": "poem.txt", "line": "the sea at dawn"},
        "ok",
    )


def test_fanout_resumed() -> None:
    state = replay("fanout_resumed")
    assert (state.status, state.output) == ("completed", "report: 2 sections")
    assert state.children == {"root": ["root/0", "root/1"]}
    assert {ref: a.phase for ref, a in state.agents.items()} == {
        "root": "completed",
        "root/0": "completed",
        "root/1": "completed",
    }
    assert [state.agents[r].task for r in ("root/0", "root/1")] == ["introduction", "results"]
    assert [state.agents[r].output for r in ("root/0", "root/1")] == [
        "done: introduction",
        "done: results",
    ]
    resumed = state.agents["root/1"]
    assert (resumed.resumes, resumed.resuming, resumed.epoch, resumed.worker) == (
        1,
        False,
        2,
        "w-c",
    )
    assert (resumed.snapshot_id, resumed.step) == (2, 2)
    assert state.agents["root/0"].resumes == 0 and state.resumes == 1
    assert state.side_effects == 3 and state.unknown_outcomes == []
    assert sorted((e.agent, e.tool) for e in state.journal.values()) == [
        ("root/0", "fs.append"),
        ("root/1", "fs.append"),
        ("root/1", "fs.write"),
    ]
    assert state.checkpoint is not None and state.checkpoint.position == "joined"
    assert state.bootstrap is not None
    assert state.bootstrap.shape.coordination_params == {"max_parallel": 2}
    assert state.bootstrap.shape.roles["worker"].tools == ["fs.read", "fs.append", "fs.write"]


def test_fanout_resume_is_bracketed_in_the_log() -> None:
    events = [envelope.decode(r).event for r in read_log(GOLDEN_DIR / "fanout_resumed.msgpack")]
    kinds = [type(e) for e in events]
    assert kinds.count(AgentResuming) == 1 and kinds.count(AgentResumed) == 1
    assert kinds.index(AgentResuming) < kinds.index(AgentResumed)
    assert isinstance(events[-1], SessionEnded)


def test_hitl_answered() -> None:
    state = replay("hitl_answered")
    assert (state.status, state.output) == ("completed", "published post.md")
    assert state.hitl_pending == {}
    (pause_id,) = state.hitl_answers
    assert state.hitl_answers[pause_id] == "yes, publish it"
    root = state.agents["root"]
    assert (root.phase, root.epoch, root.worker) == ("completed", 2, "w-local-1")
    assert state.side_effects == 1
    (entry,) = state.journal.values()
    assert (entry.tool, entry.idempotent, entry.outcome) == ("fs.write", True, "ok")


def test_hitl_session_is_paused_until_the_answer() -> None:
    records = read_log(GOLDEN_DIR / "hitl_answered.msgpack")
    paused = fold(envelope.decode(r) for r in records[:7])
    assert paused.status == "paused" and paused.agents["root"].phase == "paused"
    assert [p.question for p in paused.hitl_pending.values()] == ["Publish the post?"]


def test_an_index_gap_raises_not_a_partial_state() -> None:
    with pytest.raises(IndexGap) as info:
        replay("broken_index_gap")
    assert (info.value.session_id, info.value.index) == ("golden-gap", GAP_AT + 1)
    # Everything before the gap is sound: the error is the gap itself.
    records = read_log(GOLDEN_DIR / "broken_index_gap.msgpack")
    assert fold(envelope.decode(r) for r in records[:GAP_AT]).last_index == GAP_AT - 1


def test_a_torn_record_raises_not_a_partial_state() -> None:
    with pytest.raises(MalformedEnvelope) as info:
        replay("broken_torn_record")
    assert info.value.index == TORN_AT
    records = read_log(GOLDEN_DIR / "broken_torn_record.msgpack")
    assert fold(envelope.decode(r) for r in records[:TORN_AT]).last_index == TORN_AT - 1
    # The records after the torn one are intact, yet the log as a whole is refused.
    assert all(envelope.decode(r).index == i for i, r in enumerate(records) if i != TORN_AT)
