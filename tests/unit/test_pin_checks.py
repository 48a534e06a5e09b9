"""Pin checks without processes: the fold's effective pins after a migration, the shape checks a
resume runs, how an operator's migration is vetted, and how an undecodable ``SessionStarted`` is
explained by the pin at fault."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

import apomesh
from apomesh.core import envelope
from apomesh.core.definition import PinnedSkill, parse_definition
from apomesh.core.errors import CorruptPin, DefinitionError, InvalidLog, PluginPinMismatch
from apomesh.core.events import OperatorAction, PluginPin, SessionStarted
from apomesh.core.state import SessionState, fold
from apomesh.plugins.api import CoordinationKind, CoordinatorContext
from apomesh.plugins.hookspecs import hookimpl
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape
from apomesh.runtime.pinning import check_shape, corrupt_bootstrap, plan_migration, shape_problem

BODY = "Be terse.\r\n"


class Kind:
    name = "tabled"
    roles: tuple[str, ...] = ()

    def fold_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def run(self, ctx: CoordinatorContext) -> str:
        return ""


class KindPlugin:
    apomesh_plugin_name = "apomesh-tabled"

    def __init__(self, version: str) -> None:
        self.apomesh_plugin_version = version

    @hookimpl
    def register_coordination_kinds(self, register: Callable[[CoordinationKind], None]) -> None:
        register(Kind())


def host_with(version: str | None) -> PluginHost:
    return PluginHost.for_tests(*([KindPlugin(version)] if version else []))


def started(*, digest: str | None = None, kind_version: str = "1.0") -> SessionStarted:
    definition = parse_definition(
        {
            "name": "w",
            "coordination": "tabled",
            "skills": ["tone"],
            "model": {"provider": "scripted", "turns": [{"final": "done"}]},
        }
    )
    skill = PinnedSkill(
        "tone", BODY, digest or hashlib.sha256(BODY.encode()).hexdigest(), "catalog"
    )
    shape = compose_shape(
        definition, host=host_with(kind_version), skills=[skill], source="catalog"
    )
    return SessionStarted(goal="g", root="root", shape=shape)


def session(*events: Any) -> SessionState:
    return fold(envelope.make("s", i, 1.0, f"e{i}", ev) for i, ev in enumerate(events))


def test_the_start_pins_the_kind_and_the_builtins() -> None:
    assert started().shape.plugins == [
        PluginPin("apomesh", apomesh.__version__),
        PluginPin("apomesh-tabled", "1.0"),
    ]


def test_a_migration_moves_the_effective_pins_and_later_checks_use_them() -> None:
    state = session(started())
    assert shape_problem(host_with("2.0"), state) == (
        "pin 'apomesh-tabled==1.0': the plugin is installed at version 2.0"
    )
    migrated = session(
        started(),
        OperatorAction("migrate_pin", detail={"pins": {"apomesh-tabled": "2.0"}, "from": {}}),
    )
    assert migrated.pin_overrides == {"apomesh-tabled": "2.0"}
    assert PluginPin("apomesh-tabled", "2.0") in migrated.plugin_pins
    assert migrated.bootstrap is not None
    assert (
        PluginPin("apomesh-tabled", "1.0") in migrated.bootstrap.shape.plugins
    )  # unchanged record
    check_shape(host_with("2.0"), migrated)
    with pytest.raises(PluginPinMismatch, match=r"apomesh-tabled==2\.0"):
        check_shape(host_with("1.0"), migrated)


@pytest.mark.parametrize("detail", [{}, {"pins": "x"}, {"pins": {"a": 2}}, {"pins": {"": "1"}}])
def test_a_migration_without_a_map_of_names_to_versions_is_an_invalid_log(
    detail: dict[str, Any],
) -> None:
    with pytest.raises(InvalidLog, match="pin migration"):
        session(started(), OperatorAction("migrate_pin", detail=detail))


def test_a_migration_is_vetted_whole_before_anything_is_logged() -> None:
    state = session(started())
    assert plan_migration(host_with("2.0"), state, {"apomesh-tabled": "2.0"}) == {
        "apomesh-tabled": "1.0"
    }
    with pytest.raises(DefinitionError, match="'nope' is not pinned by this session"):
        plan_migration(host_with("2.0"), state, {"nope": "1"})
    with pytest.raises(
        PluginPinMismatch, match=r"cannot migrate to 3\.0: .* installed at version 2\.0"
    ):
        plan_migration(host_with("2.0"), state, {"apomesh-tabled": "3.0"})
    with pytest.raises(
        PluginPinMismatch, match=r"cannot migrate to 2\.0: the plugin is not installed"
    ):
        plan_migration(host_with(None), state, {"apomesh-tabled": "2.0"})


def test_a_skill_body_that_does_not_match_its_digest_is_a_corrupt_pin() -> None:
    state = session(started(digest="0" * 64))
    with pytest.raises(CorruptPin) as caught:
        check_shape(host_with("1.0"), state)
    assert caught.value.pin == "skill tone"
    # The skill pins are checked even when a migration would satisfy the plugins.
    with pytest.raises(CorruptPin):
        plan_migration(host_with("1.0"), state, {"apomesh-tabled": "1.0"})


def raw_started(change: Callable[[dict[str, Any]], None]) -> bytes:
    raw = msgspec.msgpack.decode(envelope.encode(envelope.make("s", 0, 1.0, "e", started())))
    change(raw[5]["shape"])
    return msgspec.msgpack.encode(raw)


def test_an_undecodable_session_started_is_explained_by_the_pin_at_fault() -> None:
    def version_int(shape: dict[str, Any]) -> None:
        shape["plugins"][1]["version"] = 7

    def skill_body_int(shape: dict[str, Any]) -> None:
        shape["skills"][0]["body"] = 1

    def plugins_not_list(shape: dict[str, Any]) -> None:
        shape["plugins"] = "apomesh"

    def params_not_table(shape: dict[str, Any]) -> None:
        shape["coordination_params"] = 3

    cases = [
        (version_int, "plugin apomesh-tabled"),
        (skill_body_int, "skill tone"),
        (plugins_not_list, "plugins"),
        (params_not_table, "$.coordination_params"),
    ]
    for change, pin in cases:
        found = corrupt_bootstrap(raw_started(change))
        assert found is not None and found.pin == pin, (pin, found)

    assert corrupt_bootstrap(raw_started(lambda shape: None)) is None  # nothing wrong with the pins
    assert corrupt_bootstrap(b"\xc1 not msgpack") is None
    born = envelope.encode(envelope.make("s", 0, 1.0, "e", OperatorAction("resume")))
    assert corrupt_bootstrap(born) is None  # not a SessionStarted
