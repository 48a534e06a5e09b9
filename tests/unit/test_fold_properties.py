"""Properties of the fold over generated valid sessions (``tests.strategies.valid_sessions``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.strategies import GeneratedSession, state_summary, to_envelopes, valid_sessions

from apomesh.core import envelope
from apomesh.core.errors import InvalidLog
from apomesh.core.events import (
    AgentLifecycle,
    AsyncJobFinished,
    AsyncJobStarted,
    HitlAnswered,
    HitlPaused,
    SessionEnded,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import apply, fold, new_state

EXAMPLES = settings(max_examples=100, deadline=None)


@EXAMPLES
@given(valid_sessions(), st.data())
def test_folding_a_prefix_then_the_rest_equals_folding_the_whole(
    session: GeneratedSession, data: st.DataObject
) -> None:
    envs = session.envelopes
    split = data.draw(st.integers(0, len(envs)), label="split")
    state = fold(envs[:split], session.session_id) if split else new_state(session.session_id)
    for env in envs[split:]:
        apply(state, env)
    assert state_summary(state) == state_summary(fold(envs))


@EXAMPLES
@given(valid_sessions(end=True), valid_sessions(end=False, session_id="s-1"))
def test_terminal_is_stable(session: GeneratedSession, other: GeneratedSession) -> None:
    state = fold(session.envelopes)
    assert state.terminal
    before = state_summary(state)
    # Whatever follows, valid elsewhere or not, is refused and changes nothing.
    for event in other.events[:5]:
        (env,) = to_envelopes([event], session.session_id, start_index=state.last_index + 1)
        with pytest.raises(InvalidLog, match="after the terminal event"):
            apply(state, env)
        assert state_summary(state) == before


@EXAMPLES
@given(valid_sessions())
def test_every_agent_has_a_parent_chain_to_the_root(session: GeneratedSession) -> None:
    state = fold(session.envelopes)
    for ref in state.agents:
        seen = {ref}
        while (parent := state.agents[ref].parent) is not None:
            assert parent not in seen and parent in state.agents
            assert ref in state.children_of(parent)
            seen.add(parent)
            ref = parent
        assert ref == state.root
    assert sum(len(kids) for kids in state.children.values()) == len(state.agents) - 1


@EXAMPLES
@given(valid_sessions())
def test_side_effects_count_distinct_intents(session: GeneratedSession) -> None:
    state = fold(session.envelopes)
    intents = {(e.agent, e.key) for e in session.events if isinstance(e, ToolCallIntent)}
    assert state.side_effects == len(intents) == len(state.journal)
    assert state.has_side_effects == bool(intents)


@EXAMPLES
@given(valid_sessions())
def test_unknown_outcomes_are_intents_whose_last_word_is_not_a_result(
    session: GeneratedSession,
) -> None:
    last: dict[tuple[str, str], str | None] = {}
    for e in session.events:
        if isinstance(e, ToolCallIntent):
            last[(e.agent, e.key)] = None
        elif isinstance(e, ToolCallRecorded):
            last[(e.agent, e.key)] = e.outcome
    expected = {k for k, outcome in last.items() if outcome in (None, "unknown")}
    state = fold(session.envelopes)
    assert {(e.agent, e.key) for e in state.unknown_outcomes} == expected


@EXAMPLES
@given(valid_sessions())
def test_jobs_in_flight_are_started_minus_finished(session: GeneratedSession) -> None:
    started = [(e.agent, e.job_id) for e in session.events if isinstance(e, AsyncJobStarted)]
    finished = [(e.agent, e.job_id) for e in session.events if isinstance(e, AsyncJobFinished)]
    state = fold(session.envelopes)
    assert set(state.jobs_in_flight) == set(started) - set(finished)
    assert len(state.jobs_in_flight) == len(started) - len(finished)


@EXAMPLES
@given(valid_sessions())
def test_pending_pauses_are_paused_minus_answered(session: GeneratedSession) -> None:
    paused = {e.pause_id for e in session.events if isinstance(e, HitlPaused)}
    answered = {e.pause_id for e in session.events if isinstance(e, HitlAnswered)}
    state = fold(session.envelopes)
    assert set(state.hitl_pending) == paused - answered
    assert set(state.hitl_answers) == answered
    if not state.terminal:
        assert state.status == ("paused" if paused - answered else "running")


@EXAMPLES
@given(valid_sessions())
def test_status_output_and_last_index(session: GeneratedSession) -> None:
    root_phase, root_output = "born", None
    for e in session.events:
        if isinstance(e, AgentLifecycle) and e.agent == "root":
            root_phase = e.phase
            root_output = e.output if e.output is not None else root_output
    ended = session.events[-1] if session.ended else None
    assert ended is None or isinstance(ended, SessionEnded)
    state = fold(session.envelopes)
    assert state.last_index == len(session.events) - 1
    assert state.terminal == (ended is not None)
    if ended is not None:
        assert state.status == ended.status
    if ended is not None and ended.output is not None:
        assert state.output == ended.output
    else:
        assert state.output == (root_output if root_phase == "completed" else None)


@EXAMPLES
@given(valid_sessions())
def test_reencoding_through_the_envelope_gives_the_same_fold(session: GeneratedSession) -> None:
    envs = session.envelopes
    records = [envelope.encode(env) for env in envs]
    decoded = [
        envelope.decode(r, session_id=session.session_id, index=i) for i, r in enumerate(records)
    ]
    assert state_summary(fold(decoded)) == state_summary(fold(envs))
