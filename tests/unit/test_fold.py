"""The fold, event by event: what each handler records, what it derives, and what it refuses."""

from __future__ import annotations

import pytest
from tests.strategies import born, session_started, state_summary, to_envelopes

from apomesh.core.errors import DuplicateIndex, FoldError, IndexGap, InvalidLog
from apomesh.core.events import (
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
    OperatorAction,
    SessionEnded,
    SessionRecovered,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import SessionState, apply, bootstrap_view, fold, new_state

SID = "s-fold"


def folded(*events: Event) -> SessionState:
    return fold(to_envelopes(events, SID))


def started_with_root(*more: Event) -> list[Event]:
    return [session_started(), born("root"), *more]


def apply_next(state: SessionState, event: Event) -> SessionState:
    (env,) = to_envelopes([event], SID, start_index=state.last_index + 1)
    return apply(state, env)


def refused(events: list[Event], bad: Event, match: str) -> InvalidLog:
    """Fold ``events``, then check ``bad`` is refused and leaves the state exactly as it was."""
    state = folded(*events)
    before = state_summary(state)
    with pytest.raises(InvalidLog, match=match) as info:
        apply_next(state, bad)
    assert state_summary(state) == before
    assert info.value.session_id == SID and info.value.index == len(events)
    return info.value


# --- handlers -----------------------------------------------------------------------------------


def test_session_started_is_the_bootstrap() -> None:
    started = session_started(goal="write a haiku", coordination="fanout")
    state = folded(started)
    view = bootstrap_view(state)
    assert view is not None
    assert (view.session_id, view.goal, view.root, view.shape) == (
        SID,
        "write a haiku",
        "root",
        started.shape,
    )
    assert (state.goal, state.root, state.status, state.terminal) == (
        "write a haiku",
        "root",
        "running",
        False,
    )
    assert state.started_ts == to_envelopes([started], SID)[0].ts
    assert state.last_index == 0


def test_a_log_without_bootstrap_still_folds() -> None:
    state = folded(born("root"))
    assert state.bootstrap is None and bootstrap_view(state) is None
    assert state.goal == "" and state.root is None and list(state.agents) == ["root"]


def test_birth_records_config_parent_task_and_batch() -> None:
    child = AgentLifecycle(
        agent="root/0",
        phase="born",
        parent="root",
        config=born("x", "root").config,
        task="first",
        task_index=0,
        batch="b-1",
    )
    state = folded(*started_with_root(child))
    view = state.agents["root/0"]
    assert (view.parent, view.phase, view.task, view.task_index, view.batch) == (
        "root",
        "born",
        "first",
        0,
        "b-1",
    )
    assert view.config == child.config and view.born_index == 2
    assert state.agents["root"].parent is None and state.agents["root"].born_index == 1


def test_lifecycle_updates_only_what_it_carries() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle(agent="root", phase="dispatched", worker="w-1", epoch=2),
            AgentLifecycle(agent="root", phase="planned", plan=["a", "b"]),
            AgentLifecycle(agent="root", phase="running"),
        )
    )
    root = state.agents["root"]
    assert (root.phase, root.worker, root.epoch, root.plan) == ("running", "w-1", 2, ["a", "b"])
    assert not root.terminal
    state = apply_next(
        state, AgentLifecycle(agent="root", phase="failed", reason="budget exhausted")
    )
    assert state.agents["root"].terminal and state.agents["root"].reason == "budget exhausted"


def test_checkpoint_keeps_the_latest() -> None:
    first = CoordinatorCheckpoint(position="p1", state=b"1")
    second = CoordinatorCheckpoint(position="p2", state=b"2")
    state = folded(*started_with_root(first, AgentLifecycle(agent="root", phase="running"), second))
    assert state.checkpoint == second and state.checkpoint_index == 4


def test_snapshot_pointer_lands_on_its_agent() -> None:
    state = folded(*started_with_root(AgentSnapshotted("root", 9, "explicit", 4, size=10)))
    root = state.agents["root"]
    assert (root.snapshot_id, root.snapshot_source, root.step) == (9, "explicit", 4)


def test_intent_then_result_is_one_recorded_side_effect() -> None:
    state = folded(
        *started_with_root(
            ToolCallIntent("root", "k1", "fs.append", {"line": "x"}),
            ToolCallRecorded("root", "k1", "fs.append", "ok", "appended"),
        )
    )
    entry = state.journal[("root", "k1")]
    assert (entry.tool, entry.args, entry.intent_index) == ("fs.append", {"line": "x"}, 2)
    assert (entry.outcome, entry.result) == ("ok", "appended")
    assert state.side_effects == 1 and state.has_side_effects
    assert state.unknown_outcomes == []


def test_an_intent_without_a_result_is_an_unknown_outcome() -> None:
    state = folded(*started_with_root(ToolCallIntent("root", "k1", "fs.append", {})))
    assert [e.key for e in state.unknown_outcomes] == ["k1"]
    assert state.journal[("root", "k1")].outcome is None


def test_a_result_recorded_as_unknown_stays_unknown() -> None:
    state = folded(
        *started_with_root(
            ToolCallIntent("root", "k1", "fs.append", {}),
            ToolCallRecorded("root", "k1", "fs.append", "unknown", "worker lost"),
        )
    )
    assert [e.outcome for e in state.unknown_outcomes] == ["unknown"]


def test_an_intent_repeated_before_its_result_counts_once() -> None:
    state = folded(
        *started_with_root(
            ToolCallIntent("root", "k1", "fs.write", {}, idempotent=True),
            ToolCallIntent("root", "k1", "fs.write", {}, idempotent=True),
            ToolCallRecorded("root", "k1", "fs.write", "ok", "written"),
        )
    )
    assert state.side_effects == 1 and state.journal[("root", "k1")].intent_index == 3


def test_the_same_call_by_two_agents_is_two_side_effects() -> None:
    state = folded(
        *started_with_root(
            born("root/0", "root"),
            ToolCallIntent("root", "k1", "fs.append", {}),
            ToolCallIntent("root/0", "k1", "fs.append", {}),
        )
    )
    assert state.side_effects == 2 and len(state.unknown_outcomes) == 2


def test_jobs_in_flight_are_started_minus_finished() -> None:
    state = folded(
        *started_with_root(
            AsyncJobStarted("root", "j1", "shell.run", {}),
            AsyncJobStarted("root", "j2", "shell.run", {}),
            AsyncJobFinished("root", "j1", True, "done"),
        )
    )
    assert list(state.jobs_in_flight) == [("root", "j2")]
    assert state.jobs_in_flight[("root", "j2")].tool == "shell.run"


def test_a_finished_job_id_may_be_started_again() -> None:
    state = folded(
        *started_with_root(
            AsyncJobStarted("root", "j1", "shell.run", {}),
            AsyncJobFinished("root", "j1", False, "boom"),
            AsyncJobStarted("root", "j1", "shell.run", {}),
        )
    )
    assert list(state.jobs_in_flight) == [("root", "j1")]


def test_two_agents_making_the_same_job_call_each_have_their_own_job() -> None:
    state = folded(
        *started_with_root(
            born("root/0", "root", task="a", task_index=0),
            born("root/1", "root", task="b", task_index=1),
            AsyncJobStarted("root/0", "j", "jobs.sleep", {"seconds": 2}),
            AsyncJobStarted("root/1", "j", "jobs.sleep", {"seconds": 2}),
            AsyncJobFinished("root/0", "j", True, "slept for root/0"),
        )
    )
    assert list(state.jobs_in_flight) == [("root/1", "j")]
    assert state.jobs_done[("root/0", "j")].result == "slept for root/0"
    assert ("root/1", "j") not in state.jobs_done
    assert state.side_effects == 0 and state.unknown_outcomes == []


def test_a_side_effecting_job_is_a_journaled_effect_unknown_until_it_finishes() -> None:
    deploy = AsyncJobStarted("root", "j", "deploy", {"v": 2}, side_effect=True)
    running = folded(*started_with_root(deploy))
    assert running.side_effects == 1
    ((entry),) = running.unknown_outcomes
    assert (entry.agent, entry.key, entry.tool, entry.job) == ("root", "j", "deploy", True)
    done = folded(*started_with_root(deploy, AsyncJobFinished("root", "j", True, "deployed")))
    assert done.side_effects == 1 and done.unknown_outcomes == []
    assert done.journal[("root", "j")].outcome == "ok"
    cut_short = folded(
        *started_with_root(
            deploy, AsyncJobFinished("root", "j", False, "outcome unknown", unknown=True)
        )
    )
    assert [e.key for e in cut_short.unknown_outcomes] == ["j"]
    assert cut_short.journal[("root", "j")].outcome == "unknown"
    assert not cut_short.jobs_in_flight


def test_a_job_finished_by_another_agent_is_refused() -> None:
    events = started_with_root(
        born("root/0", "root", task="a", task_index=0),
        AsyncJobStarted("root", "j", "jobs.sleep", {}),
    )
    refused(events, AsyncJobFinished("root/0", "j", True, ""), "never started")


def test_pause_and_answer() -> None:
    state = folded(*started_with_root(HitlPaused("root", "p1", "Proceed?")))
    assert state.status == "paused" and list(state.hitl_pending) == ["p1"]
    state = apply_next(state, HitlAnswered("p1", "yes", by="alice"))
    assert state.status == "running" and state.hitl_pending == {}
    assert state.hitl_answers == {"p1": "yes"}


def test_resuming_and_resumed() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle(agent="root", phase="dispatched", worker="w-1", epoch=1),
            AgentResuming("root", "worker lost", worker="w-2", snapshot_id=3, epoch=2),
        )
    )
    root = state.agents["root"]
    assert (root.resuming, root.resumes, root.epoch, state.resumes) == (True, 1, 2, 1)
    state = apply_next(state, AgentResumed("root", epoch=2))
    assert state.agents["root"].resuming is False and state.agents["root"].resumes == 1


def test_recoveries_and_operator_actions_are_counted() -> None:
    action = OperatorAction(action="resume", by="bob")
    state = folded(
        *started_with_root(SessionRecovered("auto"), action, SessionRecovered("operator"))
    )
    assert state.recoveries == 2 and state.operator_actions == [action]


# --- terminal state, status and output ----------------------------------------------------------


def test_completed_session_takes_the_root_output() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle(agent="root", phase="completed", output="a poem"),
            SessionEnded(status="completed"),
        )
    )
    assert (state.terminal, state.status, state.output) == (True, "completed", "a poem")


def test_the_terminal_event_output_wins() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle(agent="root", phase="completed", output="draft"),
            SessionEnded(status="completed", output="final"),
        )
    )
    assert state.output == "final"


def test_output_is_the_root_output_once_the_root_completes() -> None:
    state = folded(*started_with_root(AgentLifecycle(agent="root", phase="failed", output="half")))
    assert state.output is None and state.status == "running"
    state = folded(*started_with_root(AgentLifecycle(agent="root", phase="completed", output="o")))
    assert state.output == "o" and not state.terminal


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_failed_and_cancelled_sessions(status: str) -> None:
    state = folded(*started_with_root(SessionEnded(status=status, reason="why")))  # type: ignore[arg-type]
    assert (state.terminal, state.status, state.output) == (True, status, None)


def test_the_terminal_status_wins_over_an_open_pause() -> None:
    state = folded(*started_with_root(HitlPaused("root", "p1", "?"), SessionEnded("cancelled")))
    assert state.status == "cancelled"


@pytest.mark.parametrize(
    "after",
    [
        SessionEnded("completed"),
        AgentLifecycle(agent="root", phase="running"),
        SessionRecovered("auto"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_nothing_applies_after_the_terminal_event(after: Event) -> None:
    refused(started_with_root(SessionEnded("completed")), after, "after the terminal event")


# --- index discipline ---------------------------------------------------------------------------


def test_an_index_gap_is_refused() -> None:
    envs = to_envelopes(started_with_root(), SID)
    gap = to_envelopes([AgentLifecycle(agent="root", phase="running")], SID, start_index=3)
    with pytest.raises(IndexGap, match="expected index 2, got 3") as info:
        fold([*envs, *gap])
    assert info.value.index == 3 and info.value.session_id == SID


def test_a_log_must_start_at_zero() -> None:
    with pytest.raises(IndexGap):
        fold(to_envelopes([session_started()], SID, start_index=1))


@pytest.mark.parametrize("index", [0, 1])
def test_a_duplicate_or_backward_index_is_refused(index: int) -> None:
    envs = to_envelopes(started_with_root(), SID)
    again = to_envelopes([AgentLifecycle(agent="root", phase="running")], SID, start_index=index)
    state = fold(envs)
    before = state_summary(state)
    with pytest.raises(DuplicateIndex) as info:
        apply(state, again[0])
    assert info.value.index == index and state_summary(state) == before


def test_an_envelope_of_another_session_is_refused() -> None:
    state = folded(session_started())
    (other,) = to_envelopes([born("root")], "s-other", start_index=1)
    with pytest.raises(InvalidLog, match="s-other"):
        apply(state, other)


def test_an_empty_log_is_refused() -> None:
    with pytest.raises(InvalidLog, match="empty log"):
        fold([])


def test_fold_errors_share_a_base() -> None:
    assert all(issubclass(e, FoldError) for e in (IndexGap, DuplicateIndex, InvalidLog))


def test_fold_with_a_known_session_id_and_apply_one_by_one_agree() -> None:
    events = started_with_root(AgentLifecycle(agent="root", phase="running"))
    state = new_state(SID)
    for env in to_envelopes(events, SID):
        apply(state, env)
    assert state_summary(state) == state_summary(fold(to_envelopes(events, SID), SID))


# --- contradictions -----------------------------------------------------------------------------


def test_a_second_session_started_is_refused() -> None:
    refused(started_with_root(), session_started(), "second SessionStarted")


def test_an_unknown_agent_is_refused_by_every_event_naming_one() -> None:
    naming_ghost: list[Event] = [
        AgentLifecycle(agent="ghost", phase="running"),
        AgentSnapshotted("ghost", 1, "node", 1),
        ToolCallIntent("ghost", "k", "fs.append", {}),
        AsyncJobStarted("ghost", "j", "t", {}),
        HitlPaused("ghost", "p", "?"),
        AgentResuming("ghost", "lost"),
        AgentResumed("ghost"),
    ]
    for event in naming_ghost:
        refused(started_with_root(), event, "unknown agent 'ghost'")


def test_an_agent_born_twice_is_refused() -> None:
    refused(started_with_root(born("root/0", "root")), born("root/0", "root"), "born twice")
    refused(started_with_root(), born("root"), "born twice")


def test_a_child_of_an_unknown_parent_is_refused() -> None:
    refused(started_with_root(), born("nobody/0", "nobody"), "unknown parent 'nobody'")


def test_a_second_parentless_agent_is_refused() -> None:
    refused(started_with_root(), born("stray"), "no parent and is not the root")


def test_a_result_without_an_intent_is_refused() -> None:
    refused(started_with_root(), ToolCallRecorded("root", "k", "fs.append", "ok", ""), "no intent")


def test_a_result_under_another_agent_is_refused() -> None:
    events = started_with_root(born("root/0", "root"), ToolCallIntent("root", "k", "t", {}))
    refused(events, ToolCallRecorded("root/0", "k", "t", "ok", ""), "no intent")


def test_an_intent_after_its_result_is_refused() -> None:
    events = started_with_root(
        ToolCallIntent("root", "k", "fs.append", {}),
        ToolCallRecorded("root", "k", "fs.append", "ok", "done"),
    )
    refused(events, ToolCallIntent("root", "k", "fs.append", {}), "after its result")


def test_finishing_a_job_that_never_started_is_refused() -> None:
    refused(started_with_root(), AsyncJobFinished("root", "j", True, ""), "never started")


def test_starting_a_job_twice_is_refused() -> None:
    events = started_with_root(AsyncJobStarted("root", "j", "t", {}))
    refused(events, AsyncJobStarted("root", "j", "t", {}), "started twice")


def test_answering_a_pause_that_is_not_open_is_refused() -> None:
    refused(started_with_root(), HitlAnswered("p1", "yes"), "not open")
    events = started_with_root(HitlPaused("root", "p1", "?"), HitlAnswered("p1", "yes"))
    refused(events, HitlAnswered("p1", "again"), "not open")


def test_pausing_twice_is_refused_open_or_answered() -> None:
    events = started_with_root(HitlPaused("root", "p1", "?"))
    refused(events, HitlPaused("root", "p1", "?"), "paused twice")
    refused([*events, HitlAnswered("p1", "yes")], HitlPaused("root", "p1", "?"), "paused twice")


# --- derived facts ------------------------------------------------------------------------------


def test_the_spawn_tree_is_derived_from_parents() -> None:
    state = folded(
        *started_with_root(
            born("root/0", "root"),
            born("root/1", "root"),
            born("root/0/0", "root/0"),
            born("root/2", "root"),
        )
    )
    assert state.children == {
        "root": ["root/0", "root/1", "root/2"],
        "root/0": ["root/0/0"],
    }
    assert state.children_of("root/1") == [] and state.children_of("nobody") == []


def test_a_busy_session_summarised() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle(agent="root", phase="planned", plan=["a", "b"]),
            born("root/0", "root", task="a", task_index=0),
            born("root/1", "root", task="b", task_index=1),
            ToolCallIntent("root/0", "k0", "fs.append", {"line": "a"}),
            ToolCallRecorded("root/0", "k0", "fs.append", "ok", "done"),
            ToolCallIntent("root/1", "k1", "fs.append", {"line": "b"}),
            AsyncJobStarted("root/1", "j1", "shell.run", {}),
            HitlPaused("root/1", "p1", "Keep going?"),
            AgentLifecycle(agent="root/0", phase="completed", output="a done"),
        )
    )
    assert state.status == "paused" and state.output is None
    assert state.side_effects == 2
    assert [(e.agent, e.key) for e in state.unknown_outcomes] == [("root/1", "k1")]
    assert list(state.jobs_in_flight) == [("root/1", "j1")] and list(state.hitl_pending) == ["p1"]
    assert {ref: a.phase for ref, a in state.agents.items()} == {
        "root": "planned",
        "root/0": "completed",
        "root/1": "born",
    }
    assert state.last_index == 10


def test_root_answers_are_kept_by_their_loop_position() -> None:
    state = folded(
        *started_with_root(
            AgentLifecycle("root", "dispatched", epoch=1, purpose="plan", ask="-1:1"),
            AgentLifecycle("root", "planned", plan=["a"], purpose="plan"),
            CoordinatorCheckpoint(position="planned@1", state=b"{}"),
            AgentLifecycle("root", "dispatched", epoch=2, purpose="critique", ask="3:1"),
            AgentLifecycle("root", "completed", output="done", purpose="critique"),
        )
    )
    assert state.answers["-1:1"].plan == ["a"] and state.answers["-1:1"].purpose == "plan"
    assert state.answers["3:1"].final == "done" and state.answers["3:1"].purpose == "critique"
    assert [(i, c.position) for i, c in state.checkpoints] == [(4, "planned@1")]


def test_a_dispatch_without_a_loop_position_records_no_answer() -> None:
    # Logs written before asks carried their position fold as before.
    state = folded(
        *started_with_root(
            AgentLifecycle("root", "dispatched", epoch=1, purpose="plan"),
            AgentLifecycle("root", "planned", plan=["a"], purpose="plan"),
        )
    )
    assert state.answers == {} and state.agents["root"].plan == ["a"]


def test_an_agent_counts_the_pauses_it_opened() -> None:
    state = folded(*started_with_root(HitlPaused("root", "p1", "ok?"), HitlAnswered("p1", "yes")))
    assert state.agents["root"].pauses == 1
