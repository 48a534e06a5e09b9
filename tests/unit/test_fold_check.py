"""``core.state.check``: a session's writer folds a step into a trial copy before appending it; the
state it checks against is never touched, whether the step folds or not."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.strategies import GeneratedSession, state_summary, to_envelopes, valid_sessions

from apomesh.core.errors import InvalidLog
from apomesh.core.events import HitlAnswered
from apomesh.core.state import apply, check, fold, new_state

EXAMPLES = settings(max_examples=100, deadline=None)


@EXAMPLES
@given(valid_sessions(), st.data())
def test_checking_the_rest_of_a_valid_log_leaves_the_prefix_untouched(
    session: GeneratedSession, data: st.DataObject
) -> None:
    envs = session.envelopes
    split = data.draw(st.integers(0, len(envs)), label="split")
    state = fold(envs[:split], session.session_id) if split else new_state(session.session_id)
    before = copy.deepcopy(state)
    check(state, envs[split:])
    assert state == before
    assert state_summary(state) == state_summary(before)


@EXAMPLES
@given(valid_sessions(end=False), st.data())
def test_a_step_the_fold_refuses_raises_and_leaves_the_state_untouched(
    session: GeneratedSession, data: st.DataObject
) -> None:
    envs = session.envelopes
    split = data.draw(st.integers(1, len(envs)), label="split")
    state = fold(envs[:split], session.session_id)
    before = copy.deepcopy(state)
    # The valid rest of the log, then an answer to a pause that was never opened: the whole step
    # is refused, and nothing of its valid head reaches the state.
    rest = [e.event for e in envs[split:]]
    bad = HitlAnswered(pause_id="never-opened", answer="yes", by="t")
    step = to_envelopes([*rest, bad], session.session_id, start_index=split)
    with pytest.raises(InvalidLog, match="not open"):
        check(state, step)
    assert state == before


@EXAMPLES
@given(valid_sessions(end=False), st.data())
def test_the_trial_refuses_exactly_what_folding_the_state_itself_refuses(
    session: GeneratedSession, data: st.DataObject
) -> None:
    # The trial's maps copy an entry only when it is read: the verdict must still be the fold's.
    envs = session.envelopes
    split = data.draw(st.integers(1, len(envs)), label="split")
    state = fold(envs[:split], session.session_id)
    rest = data.draw(st.permutations([e.event for e in envs[split:]]), label="reordered rest")
    step = to_envelopes(rest, session.session_id, start_index=split)

    def verdict(run: Callable[[], object]) -> str | None:
        try:
            run()
        except InvalidLog as exc:
            return str(exc)
        return None

    real = copy.deepcopy(state)
    expected = verdict(lambda: [apply(real, env) for env in step])
    before = copy.deepcopy(state)
    assert verdict(lambda: check(state, step)) == expected
    assert state == before
