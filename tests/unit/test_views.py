"""The pure view builders: what GET /v1/sessions/{id} shows for a folded log."""

from __future__ import annotations

import msgspec

from apomesh.core.definition import parse_definition, role_config
from apomesh.core.envelope import Envelope, make
from apomesh.core.events import (
    AgentLifecycle,
    AgentResumed,
    AgentResuming,
    Event,
    HitlAnswered,
    HitlPaused,
    SessionEnded,
    SessionRecovered,
    SessionShape,
    SessionStarted,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import fold
from apomesh.core.views import (
    SESSION_STATUSES,
    RecoverableView,
    SessionView,
    session_summary,
    session_view,
    summarize,
)

DEFINITION = parse_definition(
    {
        "name": "writer",
        "version": "1.0.0",
        "coordination": "fanout",
        "roles": {"worker": {"instructions": "write one part"}},
    }
)
ROOT = role_config(DEFINITION, "root", [])
WORKER = role_config(DEFINITION, "worker", [])
SHAPE = SessionShape(
    coordination="fanout",
    coordination_params={},
    root=ROOT,
    roles={"worker": WORKER},
    skills=[],
    plugins=[],
)


def log_of(*events: Event) -> list[Envelope]:
    return [make("s1", i, 1000.0 + i, f"e{i}", event) for i, event in enumerate(events)]


def started() -> list[Event]:
    return [
        SessionStarted(goal="write a report", root="root", shape=SHAPE),
        AgentLifecycle(agent="root", phase="born", config=ROOT),
        AgentLifecycle(agent="root", phase="running", worker="w1", epoch=1),
    ]


def test_a_running_session_shows_its_spawn_tree_in_birth_order() -> None:
    view = session_view(
        fold(
            log_of(
                *started(),
                AgentLifecycle(
                    agent="root/0",
                    phase="born",
                    parent="root",
                    task="intro",
                    config=WORKER,
                    batch="b1",
                ),
                AgentLifecycle(
                    agent="root/1",
                    phase="born",
                    parent="root",
                    task="body",
                    config=WORKER,
                    batch="b1",
                ),
                AgentLifecycle(agent="root/1", phase="running", worker="w2", epoch=1),
            )
        )
    )
    assert view.status == "running"
    assert view.goal == "write a report"
    assert view.coordination == "fanout"
    assert view.last_index == 5
    assert view.started_at == 1000.0 and view.updated_at == 1005.0
    assert [(a.ref, a.parent, a.phase) for a in view.agents] == [
        ("root", None, "running"),
        ("root/0", "root", "born"),
        ("root/1", "root", "running"),
    ]
    child = view.agents[2]
    assert (child.name, child.role, child.task, child.worker, child.batch) == (
        "writer.worker",
        "worker",
        "body",
        "w2",
        "b1",
    )


def test_a_resuming_agent_is_marked_until_it_resumed() -> None:
    events = [
        *started(),
        AgentResuming(agent="root", reason="worker w1 lost", epoch=2),
    ]
    resuming = session_view(fold(log_of(*events)))
    assert resuming.agents[0].resuming is True
    assert resuming.agents[0].resumes == 1
    assert resuming.agents[0].epoch == 2
    assert resuming.resumes == 1
    resumed = session_view(fold(log_of(*events, AgentResumed(agent="root", epoch=2))))
    assert resumed.agents[0].resuming is False
    assert resumed.agents[0].resumes == 1


def test_a_resumed_agent_is_no_longer_resuming_once_its_new_dispatch_runs() -> None:
    events = [
        *started(),
        AgentResuming(agent="root", reason="worker w1 lost", epoch=2),
        AgentLifecycle(agent="root", phase="dispatched", worker="w2", epoch=2),
    ]
    assert session_view(fold(log_of(*events))).agents[0].resuming is True
    running = AgentLifecycle(agent="root", phase="running", worker="w2")
    view = session_view(fold(log_of(*events, running)))
    assert (view.agents[0].resuming, view.agents[0].resumes) == (False, 1)


def test_an_agent_shows_a_reason_only_while_its_phase_has_one() -> None:
    paused = [
        *started(),
        AgentLifecycle(agent="root", phase="paused", reason="waiting for a human answer"),
    ]
    assert session_view(fold(log_of(*paused))).agents[0].reason == "waiting for a human answer"
    for phase in ("running", "completed"):
        later = AgentLifecycle(agent="root", phase=phase)
        assert session_view(fold(log_of(*paused, later))).agents[0].reason is None
    failed = AgentLifecycle(agent="root", phase="failed", reason="budget exhausted")
    assert session_view(fold(log_of(*paused, failed))).agents[0].reason == "budget exhausted"


def test_open_pauses_and_unknown_outcomes_are_listed() -> None:
    view = session_view(
        fold(
            log_of(
                *started(),
                HitlPaused(agent="root", pause_id="p1", question="Which tone?"),
                HitlPaused(agent="root", pause_id="p2", question="How long?"),
                HitlAnswered(pause_id="p1", answer="dry"),
                ToolCallIntent(
                    agent="root", key="k1", tool="fs.append", args={"path": "a", "line": "x"}
                ),
                ToolCallIntent(agent="root", key="k2", tool="fs.write", args={"path": "b"}),
                ToolCallRecorded(
                    agent="root", key="k2", tool="fs.write", outcome="ok", result="ok"
                ),
            )
        )
    )
    assert view.status == "paused"
    assert [(p.pause_id, p.agent, p.question) for p in view.hitl_pending] == [
        ("p2", "root", "How long?")
    ]
    assert view.side_effects == 2
    assert [(u.agent, u.tool, u.key, u.args) for u in view.unknown_outcomes] == [
        ("root", "fs.append", "k1", {"path": "a", "line": "x"})
    ]


def test_a_terminal_session_carries_its_output_and_reason() -> None:
    done = session_view(
        fold(log_of(*started(), SessionEnded(status="completed", output="the report")))
    )
    assert (done.status, done.output, done.reason, done.terminal) == (
        "completed",
        "the report",
        None,
        True,
    )
    failed = session_view(fold(log_of(*started(), SessionEnded(status="failed", reason="budget"))))
    assert (failed.status, failed.reason, failed.terminal) == ("failed", "budget", True)


def test_the_daemon_can_override_status_and_reason() -> None:
    state = fold(log_of(*started(), SessionRecovered(path="auto")))
    view = session_view(state, "recoverable", "side effects logged (1)")
    assert (view.status, view.reason, view.recoveries, view.terminal) == (
        "recoverable",
        "side effects logged (1)",
        1,
        False,
    )
    assert session_summary(state, "recoverable").status == "recoverable"
    assert summarize(view) == session_summary(state, "recoverable")


def test_a_session_without_bootstrap_still_has_a_view() -> None:
    envelopes = [make("s1", 0, 5.0, "e0", AgentLifecycle(agent="root", phase="born"))]
    view = session_view(fold(envelopes))
    assert (view.goal, view.coordination, view.agents[0].name, view.agents[0].role) == (
        "",
        "",
        "root",
        "",
    )


def test_views_round_trip_through_json_and_tolerate_new_fields() -> None:
    view = session_view(
        fold(log_of(*started(), HitlPaused(agent="root", pause_id="p", question="?")))
    )
    assert msgspec.json.decode(msgspec.json.encode(view), type=SessionView) == view
    newer = msgspec.json.encode({**msgspec.to_builtins(view), "added_later": {"x": 1}})
    assert msgspec.json.decode(newer, type=SessionView) == view
    minimal = msgspec.json.decode(
        b'{"session_id":"s","goal":"g","reason":"r"}', type=RecoverableView
    )
    assert minimal.unknown_outcomes == [] and minimal.pin_diff == []
    assert set(SESSION_STATUSES) >= {view.status, "recoverable"}
