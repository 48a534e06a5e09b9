"""The debate coordination kind, loaded through its entry point and run on a real system.

The kind is taken from a plugin host that loads only this distribution, so what is tested is what
a daemon loads. The end-to-end tests use apomesh's ``mesh`` fixture: a real nats-server, an
``apomesh serve`` process and two worker processes.
"""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

import pytest

from apomesh.core.errors import DefinitionError
from apomesh.core.events import PluginPin
from apomesh.plugins.api import CoordinationKind
from apomesh.plugins.manager import PluginHost
from apomesh.sdk.client import SyncClient
from apomesh.testing import Mesh

DIST = "apomesh-debate"


def debate_definition(rounds: int, delay: float = 0.0) -> dict[str, Any]:
    def side(stance: str) -> dict[str, Any]:
        return {
            "instructions": f"Argue {stance} the motion.",
            "model": {
                "provider": "scripted",
                "turns": [{"delay": delay, "final": f"{stance}: reason"}],
            },
        }

    return {
        "name": "debate-club",
        "version": "1.0.0",
        "coordination": "debate",
        "coordination_params": {"rounds": rounds},
        "instructions": "You are the judge.",
        "model": {"provider": "scripted", "turns": [{"final": "verdict: pro wins"}]},
        "roles": {"pro": side("for"), "con": side("against")},
    }


@pytest.fixture
def debate() -> CoordinationKind:
    host = PluginHost(allow=[DIST], environ={})
    return host.coordination_kinds()["debate"]


def test_the_entry_point_registers_debate_pinned_by_distribution_and_version() -> None:
    host = PluginHost(allow=[DIST], environ={})
    assert "debate" in host.coordination_kinds()
    assert host.owner_of("coordination", "debate") == PluginPin(DIST, metadata.version(DIST))
    assert host.coordination_kinds()["debate"].roles == ("pro", "con")


def test_parameters_fold_to_defaults_and_bad_ones_name_the_key(debate: CoordinationKind) -> None:
    assert debate.fold_params({}) == {"rounds": 2}
    assert debate.fold_params({"rounds": 5}) == {"rounds": 5}
    for bad in (0, 21, "3", True, 2.5):
        with pytest.raises(DefinitionError, match=r"coordination_params\.rounds"):
            debate.fold_params({"rounds": bad})
    with pytest.raises(DefinitionError, match="unknown parameter"):
        debate.fold_params({"rounds": 2, "judge": "me"})


def wait_status(client: SyncClient, session_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    view = client.get_session(session_id)
    while view.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.1)
        view = client.get_session(session_id)
    return view


def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)


def test_a_debate_runs_its_rounds_in_turns_and_the_judge_decides(mesh: Mesh) -> None:
    client = SyncClient(mesh.url)
    session_id = client.start_session(
        "tabs are better than spaces", definition=debate_definition(2)
    )
    view = wait_status(client, session_id)
    assert view.status == "completed", view
    assert view.output == "verdict: pro wins"

    turns = sorted(
        (a for a in view.agents if a.parent == "root"), key=lambda a: int(a.ref.split("/")[1])
    )
    assert [a.batch for a in turns] == ["round-1-pro", "round-1-con", "round-2-pro", "round-2-con"]
    assert [a.role for a in turns] == ["pro", "con", "pro", "con"]
    assert all(a.phase == "completed" for a in turns)
    # Each side sees the debate so far: the second con turn has all three earlier arguments.
    last = turns[-1].task or ""
    assert "Motion: tabs are better than spaces" in last
    assert "[round 1] pro: for: reason" in last and "[round 1] con: against: reason" in last
    assert "[round 2] pro: for: reason" in last and "[round 2] con" not in last

    started = next(iter(client.events(session_id)))
    assert started.kind == "SessionStarted"
    shape = started.event["shape"]
    assert shape["coordination"] == "debate"
    assert shape["coordination_params"] == {"rounds": 2}
    assert {"name": DIST, "version": metadata.version(DIST)} in shape["plugins"]


def test_a_debate_resumed_after_a_daemon_kill_does_not_argue_a_finished_turn_again(
    mesh: Mesh,
) -> None:
    client = SyncClient(mesh.url)
    session_id = client.start_session("remote work", definition=debate_definition(3, delay=0.3))

    def done_turns() -> list[str]:
        agents = client.get_session(session_id).agents
        return [a.batch or "" for a in agents if a.parent == "root" and a.phase == "completed"]

    wait_until(lambda: len(done_turns()) >= 2)
    finished_before = done_turns()
    mesh.daemon.kill()
    mesh.daemon.start()

    view = wait_status(client, session_id)
    assert view.status == "completed", view
    assert view.recoveries >= 1
    children = [a for a in view.agents if a.parent == "root"]
    for batch in finished_before:
        assert [a.phase for a in children if a.batch == batch] == ["completed"], batch
    completed = [a.batch for a in children if a.phase == "completed"]
    assert sorted(completed) == sorted(f"round-{r}-{s}" for r in (1, 2, 3) for s in ("pro", "con"))
