"""Pinning end to end: a resumed session runs the agent it started with, or fails loudly.

Real processes throughout (``mesh``: a nats-server, an ``apomesh serve`` process, two worker
processes). The proof that a resume reads no catalog is the ``probe`` model provider of the
test-only ``apomesh-pinprobe`` plugin: every model call appends the exact instructions the agent
loop built (the agent's instructions and every pinned skill body) to a file. The catalog skill is
edited and then deleted mid-session; after a worker is killed and after the daemon is killed, every
recorded call still carries the body pinned at start, byte for byte.

Plugin versions change the way an operator would change them: the ``apomesh-debate`` plugin is
blocked from loading (as good as uninstalled), or a copy built at another version is put first on
the daemon's ``PYTHONPATH`` (installed at another version), between a kill and a restart.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from tests.e2e.plane_support import (
    DEBATE,
    DEBATE_PROJECT,
    build_at_version,
    events,
    install_test_plugins,
    probe_records,
    publish_raw,
    recoverable,
    run_cli,
    session_view,
    stored_count,
    wait_terminal,
    wait_until,
)

from apomesh.core import envelope
from apomesh.core.definition import PinnedSkill, parse_definition
from apomesh.core.events import AgentLifecycle, SessionStarted
from apomesh.plugins.manager import PluginHost
from apomesh.runtime.composition import compose_shape
from apomesh.testing import Mesh

# Line endings, a non-ASCII character and trailing blanks: bytes a lax copy would change.
TONE_V1 = "Be terse.\r\nNever use exclamation marks \u2014 not once.\n  trailing blanks  \n"
TONE_V2 = "Be chatty and loud!!!\n"

JSON = {"Content-Type": "application/json"}
"""Every write says JSON (the API refuses any other with 415)."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="session", autouse=True)
def plugin_packages() -> None:
    install_test_plugins()


@pytest.fixture(scope="session")
def debate_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``apomesh-debate`` built at a lower and a higher version, each in a directory of its own."""
    into = tmp_path_factory.mktemp("debate-builds")
    return {v: build_at_version(DEBATE_PROJECT, v, into) for v in ("0.0.9", "0.2.0")}


def installed_debate_version() -> str:
    return PluginHost(allow=[DEBATE], environ={}).installed_versions()[DEBATE]


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30.0)


def restart_daemon(mesh: Mesh, **env: str | None) -> None:
    """SIGKILL the daemon and start it again with ``env`` changed (None removes a variable)."""
    mesh.daemon.kill()
    for key, value in env.items():
        if value is None:
            mesh.daemon.env.pop(key, None)
        else:
            mesh.daemon.env[key] = value
    mesh.daemon.start()


# --- resume from the record, with the catalog changing underneath ---------------------------------


def probe_agent(record: Path, turns: int = 14, delay: float = 0.25) -> dict[str, Any]:
    """A read-only root agent (no side effects: a restarted daemon resumes it by itself) on the
    ``probe`` model, with the catalog skill ``tone``."""
    return {
        "name": "pinned-writer",
        "version": "1.0.0",
        "instructions": "Write in the house tone.",
        "coordination": "solo",
        "skills": ["tone"],
        "tools": ["fs.list"],
        "model": {
            "provider": "probe",
            "record": str(record),
            "turns": [
                {"delay": delay, "tool_calls": [{"tool": "fs.list", "args": {"path": "."}}]}
                for _ in range(turns)
            ]
            + [{"final": "written tersely"}],
        },
    }


def worker_running(mesh: Mesh, session_id: str, ref: str = "root") -> Any:
    names = {w["id"]: w["name"] for w in httpx.get(f"{mesh.url}/v1/workers").json()["workers"]}
    agents = {a["ref"]: a for a in session_view(mesh.url, session_id)["agents"]}
    worker_id = agents[ref]["worker"]
    return next(w for w in mesh.workers if w.name == names[worker_id])


@pytest.mark.parametrize("source", ["published", "catalog"])
def test_a_resume_uses_the_pinned_skill_byte_for_byte_after_the_catalog_changed(
    mesh: Mesh, tmp_path: Path, source: str
) -> None:
    record = tmp_path / "calls.jsonl"
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V1}).status_code == 200
    definition = probe_agent(record)
    if source == "published":
        assert post(mesh.url, "/v1/agents", definition).status_code == 201
        start = post(
            mesh.url, "/v1/sessions", {"goal": "write", "agent": {"name": "pinned-writer"}}
        )
    else:
        start = post(mesh.url, "/v1/sessions", {"goal": "write", "definition": definition})
    assert start.status_code == 201, start.text
    session_id = start.json()["session_id"]
    wait_until(lambda: len(probe_records(record)) >= 1, what="the first model call")

    # The catalog changes underneath: edited, then deleted.
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V2}).status_code == 200
    assert httpx.delete(f"{mesh.url}/v1/skills/tone", headers=JSON).status_code == 204
    assert httpx.get(f"{mesh.url}/v1/skills/tone").status_code == 404

    # A worker dies: its agent is re-dispatched from the record onto the other worker.
    victim = worker_running(mesh, session_id)
    victim.kill()
    wait_until(
        lambda: any(r["pid"] != victim.pid for r in probe_records(record)),
        what="a model call on another worker",
    )
    assert session_view(mesh.url, session_id)["agents"][0]["resumes"] >= 1

    # The daemon dies mid-run and a new one resumes the session from the log.
    assert session_view(mesh.url, session_id)["status"] == "running"
    restarted_at = time.time()
    restart_daemon(mesh)
    view = wait_terminal(mesh.url, session_id)
    assert view["status"] == "completed", view
    assert view["output"] == "written tersely"
    assert view["recoveries"] >= 1

    calls = probe_records(record)
    assert any(c["ts"] > restarted_at for c in calls), "no model call after the daemon restart"
    for call in calls:
        assert call["instructions"].endswith(f"## Skill: tone\n{TONE_V1}"), call
        assert TONE_V2 not in call["instructions"]
    assert len({c["instructions"] for c in calls}) == 1

    started = events(mesh.url, session_id)[0]
    assert started["kind"] == "SessionStarted"
    shape = started["event"]["shape"]
    assert shape["source"] == source
    (pinned,) = shape["skills"]
    assert (pinned["body"], pinned["digest"], pinned["resolver"]) == (
        TONE_V1,
        sha256(TONE_V1),
        "catalog",
    )
    assert shape["root"]["skills"] == [pinned]


# --- corrupt pins in a hand-written SessionStarted -------------------------------------------------


def hand_written_start(*, tamper: str) -> tuple[str, list[bytes]]:
    """A new session's first entries, written as raw bytes with one pin spoiled: ``digest`` (a
    skill whose body no longer matches its digest) or ``plugin`` (a plugin pin whose version is
    not a string, so the entry cannot be decoded)."""
    session_id = uuid.uuid4().hex
    definition = parse_definition(
        {
            "name": "hand-written",
            "skills": ["tone"],
            "model": {"provider": "scripted", "turns": [{"final": "done"}]},
        }
    )
    digest = "0" * 64 if tamper == "digest" else sha256(TONE_V1)
    skills = [PinnedSkill("tone", TONE_V1, digest, "catalog")]
    shape = compose_shape(
        definition, host=PluginHost(allow=[], environ={}), skills=skills, source="catalog"
    )
    now = time.time()
    started = envelope.encode(
        envelope.make(session_id, 0, now, uuid.uuid4().hex, SessionStarted("hand", "root", shape))
    )
    born = envelope.encode(
        envelope.make(
            session_id, 1, now, uuid.uuid4().hex,
            AgentLifecycle("root", "born", config=shape.root, task="hand", task_index=0),
        )
    )  # fmt: skip
    if tamper == "plugin":
        raw = msgspec.msgpack.decode(started)
        raw[5]["shape"]["plugins"][0]["version"] = 7
        started = msgspec.msgpack.encode(raw)
    return session_id, [started, born]


def test_a_corrupt_or_undecodable_pin_strands_the_session_and_names_the_pin(mesh: Mesh) -> None:
    # A correct `tone` is in the catalog: a resume that re-resolved would find it.
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V1}).status_code == 200
    wrong_digest, entries = hand_written_start(tamper="digest")
    publish_raw(mesh.nats_url, wrong_digest, entries)
    bad_plugin, entries = hand_written_start(tamper="plugin")
    publish_raw(mesh.nats_url, bad_plugin, entries)

    restart_daemon(mesh)
    listed = recoverable(mesh.url)
    expected = {wrong_digest: "skill tone", bad_plugin: "plugin apomesh"}
    for session_id, pin in expected.items():
        entry = listed[session_id]
        assert entry["category"] == "pin_mismatch", entry
        assert entry["reason"].startswith("stranded by pin mismatch: ")
        assert f"pin {pin!r}" in entry["reason"]

        refused = post(mesh.url, f"/v1/sessions/{session_id}/resume", {"confirm": True})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "corrupt_pin"
        assert f"pin {pin!r}" in refused.json()["message"]

        assert session_view(mesh.url, session_id)["status"] == "recoverable"
        assert stored_count(mesh.nats_url, session_id) == 2  # nothing appended, nothing re-resolved
    assert "digest" in listed[wrong_digest]["reason"]
    assert "undecodable plugin pin" in listed[bad_plugin]["reason"]

    # Loud after another restart too: the verdict comes from the record every time.
    restart_daemon(mesh)
    assert {s: recoverable(mesh.url)[s]["category"] for s in expected} == {
        wrong_digest: "pin_mismatch",
        bad_plugin: "pin_mismatch",
    }


# --- a pinned plugin uninstalled, downgraded, migrated -------------------------------------------


def debate_agent(rounds: int, delay: float = 0.3) -> dict[str, Any]:
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


def turns_done(url: str, session_id: str) -> int:
    agents = session_view(url, session_id)["agents"]
    return sum(1 for a in agents if a["parent"] == "root" and a["phase"] == "completed")


def start_debate(mesh: Mesh, rounds: int) -> str:
    response = post(
        mesh.url, "/v1/sessions", {"goal": "motion", "definition": debate_agent(rounds)}
    )
    assert response.status_code == 201, response.text
    session_id: str = response.json()["session_id"]
    wait_until(lambda: turns_done(mesh.url, session_id) >= 1, what="the first turn")
    return session_id


@pytest.fixture
def restore_daemon_env(mesh: Mesh) -> Iterator[None]:
    yield
    for key in ("PYTHONPATH", "APOMESH_PLUGINS_BLOCK"):
        mesh.daemon.env.pop(key, None)


def test_a_plugin_uninstalled_or_downgraded_strands_the_session_until_its_pin_is_satisfied(
    mesh: Mesh, debate_builds: dict[str, Path], restore_daemon_env: None
) -> None:
    version = installed_debate_version()
    pin = f"{DEBATE}=={version}"
    session_id = start_debate(mesh, rounds=4)

    restart_daemon(mesh, APOMESH_PLUGINS_BLOCK=DEBATE)
    entry = recoverable(mesh.url)[session_id]
    assert entry["category"] == "pin_mismatch"
    assert f"pin {pin!r}: the plugin is not installed" in entry["reason"]
    assert entry["pin_diff"] == [{"name": DEBATE, "old": version, "new": None}]
    stored = stored_count(mesh.nats_url, session_id)
    refused = post(mesh.url, f"/v1/sessions/{session_id}/resume", {"confirm": True})
    assert refused.status_code == 409
    assert refused.json()["error"] == "plugin_pin_mismatch"
    assert pin in refused.json()["message"]
    migrate = {"confirm": True, "migrate_pins": {DEBATE: version}}
    refused = post(mesh.url, f"/v1/sessions/{session_id}/resume", migrate)
    assert refused.status_code == 409 and "not installed" in refused.json()["message"]
    assert stored_count(mesh.nats_url, session_id) == stored

    restart_daemon(mesh, APOMESH_PLUGINS_BLOCK=None, PYTHONPATH=str(debate_builds["0.0.9"]))
    entry = recoverable(mesh.url)[session_id]
    assert entry["category"] == "pin_mismatch"
    assert f"pin {pin!r}: the plugin is installed at version 0.0.9" in entry["reason"]
    assert stored_count(mesh.nats_url, session_id) == stored

    # The pinned version is back: the session resumes by itself and completes.
    restart_daemon(mesh, PYTHONPATH=None)
    assert session_id not in recoverable(mesh.url)
    view = wait_terminal(mesh.url, session_id)
    assert view["status"] == "completed", view
    assert view["output"] == "verdict: pro wins"


def test_an_operator_migrates_a_stranded_pin_and_the_session_completes_on_the_new_version(
    mesh: Mesh, debate_builds: dict[str, Path], restore_daemon_env: None
) -> None:
    old = installed_debate_version()
    session_id = start_debate(mesh, rounds=4)
    new_build = str(debate_builds["0.2.0"])

    restart_daemon(mesh, PYTHONPATH=new_build)
    entry = recoverable(mesh.url)[session_id]
    assert entry["category"] == "pin_mismatch"
    assert "the plugin is installed at version 0.2.0" in entry["reason"]

    # The operator sees the difference first: resuming without `confirm` answers the preview.
    preview = post(mesh.url, f"/v1/sessions/{session_id}/resume", {})
    assert preview.status_code == 409 and preview.json()["error"] == "confirm_required"
    assert preview.json()["preview"]["pin_diff"] == [{"name": DEBATE, "old": old, "new": "0.2.0"}]
    for wrong, status in (({DEBATE: "0.3.0"}, 409), ({"not-a-pin": "1.0"}, 400)):
        body = {"confirm": True, "migrate_pins": wrong}
        assert post(mesh.url, f"/v1/sessions/{session_id}/resume", body).status_code == status

    done = run_cli(
        mesh.url, "recover", "resume", session_id, "--migrate-pin", f"{DEBATE}=0.2.0", "--yes"
    )
    assert f"{DEBATE}: {old} -> 0.2.0" in done.stdout
    assert f"migrating pin {DEBATE}: {old} -> 0.2.0" in done.stdout
    assert f"resumed {session_id}" in done.stdout

    # The migrated pins are the session's pins now: another restart resumes it by itself.
    before = turns_done(mesh.url, session_id)
    wait_until(lambda: turns_done(mesh.url, session_id) > before, what="a turn after the migration")
    assert session_view(mesh.url, session_id)["status"] == "running"
    restart_daemon(mesh)
    assert session_id not in recoverable(mesh.url)
    view = wait_terminal(mesh.url, session_id)
    assert view["status"] == "completed", view

    log = events(mesh.url, session_id)
    kinds = [e["kind"] for e in log]
    actions = [e["event"] for e in log if e["kind"] == "OperatorAction"]
    assert [a["action"] for a in actions] == ["migrate_pin", "resume"]
    assert actions[0]["detail"] == {"pins": {DEBATE: "0.2.0"}, "from": {DEBATE: old}}
    migrated_at = kinds.index("OperatorAction")
    assert "SessionRecovered" in kinds[migrated_at + 2 :]
    started = log[0]["event"]["shape"]["plugins"]
    assert {"name": DEBATE, "version": old} in started  # the record of the start is unchanged


# --- the digest is checked again where the body reaches the model ---------------------------------


def test_a_worker_refuses_a_dispatch_whose_skill_body_does_not_match_its_pin(
    tmp_path: Path,
) -> None:
    import asyncio

    from apomesh.builtin.models import ScriptedProvider
    from apomesh.core.definition import AgentConfig, Budget, ModelSpec, ScriptTurn
    from apomesh.runtime.agent_loop import run_agent
    from apomesh.runtime.protocol import Reply, Run

    spoiled = PinnedSkill("tone", TONE_V2, sha256(TONE_V1), "catalog")
    config = AgentConfig(
        name="w", version="", role="root", instructions="",
        model=ModelSpec(turns=[ScriptTurn(final="done")]), tools=[], skills=[spoiled], budget=Budget(),
    )  # fmt: skip
    reports: list[Any] = []

    async def send(report: Any) -> Reply:
        reports.append(report)
        return Reply("ok")

    done = asyncio.run(
        run_agent(
            Run("s", "root", 1, config, "act", "go"), worker_id="w", workspace=tmp_path,
            tools={}, providers={"scripted": ScriptedProvider()}, supervisors=[], send=send,
        )
    )  # fmt: skip
    assert done.outcome == "failed"
    assert "pin 'skill tone'" in done.reason and "digest" in done.reason
    assert reports == []  # the model was never called
