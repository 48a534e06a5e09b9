"""Moving a session to another published agent version, without processes: what the fold derives
from a ``migrate_pin`` action that embeds a new shape (the effective shape and pins, each agent's
current config), how a move is vetted before anything is logged, and the difference the operator
is shown."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from apomesh.core import envelope
from apomesh.core.definition import PinnedSkill, parse_definition
from apomesh.core.errors import InvalidLog, MigrationRefused, PluginPinMismatch
from apomesh.core.events import (
    AgentLifecycle,
    OperatorAction,
    PluginPin,
    SessionShape,
    SessionStarted,
)
from apomesh.core.state import SessionState, apply, fold
from apomesh.core.views import session_view
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape
from apomesh.runtime.pinning import agent_diff, plan_agent_migration

HOST = PluginHost.for_tests()


def skill(name: str, body: str) -> PinnedSkill:
    return PinnedSkill(name, body, hashlib.sha256(body.encode()).hexdigest(), "catalog")


def shape(
    version: str,
    *,
    instructions: str = "Write your part.",
    style: str = "plain",
    coordination: str = "fanout",
    source: str = "published",
    parallel: int = 1,
) -> SessionShape:
    definition = parse_definition(
        {
            "name": "writer",
            "version": version,
            "coordination": coordination,
            "coordination_params": {"max_parallel": parallel} if coordination == "fanout" else {},
            "model": {"provider": "scripted", "turns": [{"final": "done"}]},
            "roles": {"worker": {"instructions": instructions, "skills": ["style"]}},
        }
    )
    return compose_shape(
        definition,
        host=HOST,
        skills=[skill("style", style)],
        source=source,
        agent=f"writer@{version}" if source == "published" else None,
    )


def log_of(*events: Any) -> list[envelope.Envelope]:
    return [envelope.make("s", i, 1.0, f"e{i}", ev) for i, ev in enumerate(events)]


def started_session(old: SessionShape) -> list[Any]:
    worker = old.roles["worker"]
    return [
        SessionStarted(goal="g", root="root", shape=old),
        AgentLifecycle("root", "born", config=old.root, task="g", task_index=0),
        AgentLifecycle("root", "planned", plan=["a", "b"]),
        AgentLifecycle("root/0", "born", parent="root", config=worker, task="a", task_index=0),
        AgentLifecycle("root/0", "completed", output="a done"),
        AgentLifecycle("root/1", "born", parent="root", config=worker, task="b", task_index=1),
        AgentLifecycle("root/1", "dispatched", worker="w1", epoch=1),
    ]


def migration(state: SessionState, new: SessionShape) -> OperatorAction:
    return OperatorAction(
        action="migrate_pin", detail=plan_agent_migration(HOST, state, new), by="ops"
    )


def test_the_fold_takes_the_migrated_shape_and_keeps_the_record_of_the_start() -> None:
    old, new = shape("1.0.0"), shape("1.1.0", instructions="Write it twice.", style="loud")
    events = started_session(old)
    state = fold(log_of(*events))
    assert state.effective_shape == old and state.migrated_shape is None
    action = migration(state, new)
    assert action.detail["agent"] == {"from": "writer@1.0.0", "to": "writer@1.1.0"}

    # The log carries plain data, as it is read back: the fold of the decoded log agrees.
    env = envelope.make("s", len(events), 2.0, "m", action)
    decoded = envelope.decode(envelope.encode(env))
    for state_after in (apply(fold(log_of(*events)), env), apply(fold(log_of(*events)), decoded)):
        assert state_after.effective_shape == new
        assert state_after.bootstrap is not None and state_after.bootstrap.shape == old
        assert state_after.plugin_pins == new.plugins
        assert session_view(state_after).agent == "writer@1.1.0"


def test_an_agent_dispatched_with_a_config_runs_with_it_and_keeps_its_birth_config() -> None:
    old, new = shape("1.0.0"), shape("1.1.0", instructions="Write it twice.")
    events = started_session(old)
    state = fold(log_of(*events))
    events += [
        migration(state, new),
        AgentLifecycle("root/1", "dispatched", worker="w2", epoch=2, config=new.roles["worker"]),
    ]
    state = fold(log_of(*events))
    moved, done = state.agents["root/1"], state.agents["root/0"]
    assert moved.config == old.roles["worker"]  # the birth record is unchanged
    assert moved.current_config == new.roles["worker"]
    assert done.current_config == old.roles["worker"]
    versions = {a.ref: a.version for a in session_view(state).agents}
    assert versions == {"root": "1.0.0", "root/0": "1.0.0", "root/1": "1.1.0"}


def test_a_later_plugin_move_applies_over_the_migrated_shape() -> None:
    old, new = shape("1.0.0"), shape("1.1.0")
    events = started_session(old)
    state = fold(log_of(*events))
    builtin = new.plugins[0].name
    events += [
        migration(state, new),
        OperatorAction(action="migrate_pin", detail={"pins": {builtin: "9.9"}, "from": {}}),
    ]
    state = fold(log_of(*events))
    assert PluginPin(builtin, "9.9") in state.plugin_pins
    assert state.effective_shape == new


def test_a_migration_with_an_undecodable_shape_is_an_invalid_log() -> None:
    events = started_session(shape("1.0.0"))
    bad = OperatorAction(action="migrate_pin", detail={"pins": {}, "shape": {"roles": 3}})
    with pytest.raises(InvalidLog, match="invalid shape"):
        fold(log_of(*events, bad))


@pytest.mark.parametrize(
    ("new", "message"),
    [
        (shape("1.1.0", coordination="solo"), "keeps the coordination kind"),
        (shape("1.0.0"), "runs writer@1.0.0 already"),
    ],
)
def test_a_move_that_changes_the_kind_or_nothing_is_refused(
    new: SessionShape, message: str
) -> None:
    state = fold(log_of(*started_session(shape("1.0.0"))))
    with pytest.raises(MigrationRefused, match=message):
        plan_agent_migration(HOST, state, new)
    assert agent_diff(HOST, state, new).problem is not None


def test_a_session_not_started_from_a_published_agent_cannot_move() -> None:
    state = fold(log_of(*started_session(shape("1.0.0", source="catalog"))))
    with pytest.raises(MigrationRefused, match="not started from a published agent"):
        plan_agent_migration(HOST, state, shape("1.1.0"))


def test_the_new_versions_plugin_pins_are_checked() -> None:
    state = fold(log_of(*started_session(shape("1.0.0"))))
    new = shape("1.1.0")
    unsatisfied = msgspec.structs.replace(new, plugins=[*new.plugins, PluginPin("absent", "1")])
    with pytest.raises(PluginPinMismatch, match="absent"):
        plan_agent_migration(HOST, state, unsatisfied)


def test_the_diff_shows_what_the_new_version_changes() -> None:
    old = shape("1.0.0")
    new = shape("1.1.0", instructions="Write it twice.", style="loud", parallel=2)
    state = fold(log_of(*started_session(old)))
    diff = agent_diff(HOST, state, new)
    assert (diff.old, diff.new) == ("writer@1.0.0", "writer@1.1.0")
    assert diff.old_digest == old.definition_digest != diff.new_digest
    assert [(s.name, s.old, s.new) for s in diff.skills] == [
        ("style", old.skills[0].digest, new.skills[0].digest)
    ]
    assert diff.coordination == ("fanout", "fanout")
    assert diff.coordination_params[0]["max_parallel"] == 1
    assert diff.coordination_params[1]["max_parallel"] == 2
    assert diff.roles == ["worker"]
    assert diff.plugins == [] and diff.problem is None
