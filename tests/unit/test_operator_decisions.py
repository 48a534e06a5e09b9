"""The pure rules behind operator recovery: which unknown outcomes a resume acknowledges, when a
drained session is auto-resumed, and which workers a session's pins rule out."""

from __future__ import annotations

from typing import Any

from tests.strategies import agent_config, session_shape, to_envelopes

from apomesh.core import decisions
from apomesh.core.events import (
    AgentLifecycle,
    OperatorAction,
    PluginPin,
    SessionStarted,
    SessionSuspended,
    ToolCallIntent,
    ToolCallRecorded,
)
from apomesh.core.state import SessionState, fold
from apomesh.plugins.pins import worker_pin_problem

ROOT = agent_config()
SHAPE = session_shape()


def session(*events: Any) -> SessionState:
    head = [SessionStarted("g", "root", SHAPE), AgentLifecycle("root", "born", config=ROOT)]
    return fold(to_envelopes([*head, *events], "s1"), "s1")


def intent(key: str) -> ToolCallIntent:
    return ToolCallIntent("root", key, "payments.charge", {"k": key})


def test_a_resume_acknowledges_exactly_the_unknown_outcomes_it_was_shown() -> None:
    shown = session(intent("k1"))
    resume = OperatorAction("resume", detail={"acknowledged": decisions.acknowledgement(shown)})
    state = session(intent("k1"), resume, intent("k2"))
    assert decisions.acknowledged_unknown(state, "root", "k1")
    assert not decisions.acknowledged_unknown(state, "root", "k2")  # a new one is held again


def test_an_older_resume_without_keys_acknowledges_what_was_unknown_at_that_point() -> None:
    resume = OperatorAction("resume", detail={"unknown_outcomes": 1})
    state = session(intent("k1"), resume, intent("k2"))
    assert decisions.acknowledged_unknown(state, "root", "k1")
    assert not decisions.acknowledged_unknown(state, "root", "k2")


def test_a_drained_session_is_auto_resumed_only_with_nothing_in_flight_and_nothing_after() -> None:
    done = [intent("k1"), ToolCallRecorded("root", "k1", "payments.charge", "ok", "paid")]
    assert decisions.classify(session(*done, SessionSuspended())).category == "drained"
    assert decisions.classify(session(*done, SessionSuspended()), None).verdict == "auto_resume"
    # A side effect in flight, or anything after the marker (a crash later on): an operator's.
    assert decisions.classify(session(intent("k1"), SessionSuspended())).verdict == "recoverable"
    later = session(*done, SessionSuspended(), intent("k2"))
    assert decisions.classify(later).category == "side_effects"


def test_a_worker_with_another_version_of_a_pinned_plugin_is_ruled_out() -> None:
    pins = [PluginPin("apomesh", "1.0"), PluginPin("apomesh-debate", "0.1.0")]
    assert worker_pin_problem({"apomesh": "1.0", "apomesh-debate": "0.1.0"}, pins) is None
    assert worker_pin_problem({"apomesh": "1.0"}, pins) is None  # not needed on the worker
    problem = worker_pin_problem({"apomesh": "1.1"}, pins)
    assert problem == "apomesh==1.0: the worker has version 1.1"
